# Two commands on a fresh clone: `make demo` and `make test`. CI runs `.ci/run`.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-test
DSTAMP := $(VENV)/.installed

.PHONY: demo test lint fuzz stress bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip

$(DSTAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet -e .
	touch $@

$(STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install --quiet -e '.[test]'
	touch $@ $(DSTAMP)

demo: $(DSTAMP)
	$(PY) -m tierflow demo

# The profile report's test opens it in a real browser: Debian's chromium, installed
# here when missing and we are root (the test skips, saying why, where it is absent).
test: $(STAMP)
	@if [ ! -x /usr/bin/chromium ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get install -y chromium >/dev/null 2>&1 || \
		{ apt-get update >/dev/null 2>&1 && apt-get install -y chromium >/dev/null 2>&1; } || \
		echo "chromium could not be installed: the browser test of the profile report will skip"; \
	fi
	$(PY) -m pytest -q

# lint-imports checks the import contracts in pyproject.toml ([tool.importlinter]).
lint: $(STAMP)
	$(VENV)/bin/ruff check tierflow tests examples
	$(VENV)/bin/ruff format --check tierflow tests examples
	$(VENV)/bin/mypy
	$(VENV)/bin/lint-imports

# The property tests (hypothesis) with fresh seeds and 20 times the examples, and the
# conformance suite with a fresh seed and 20 times the samples per entry (its failures
# print the seed to replay: TIERFLOW_CONFORMANCE_SEED=...): for a local run now and
# then, not for CI. A hypothesis failure found is replayed first next time.
fuzz: $(STAMP)
	HYPOTHESIS_PROFILE=fuzz $(PY) -m pytest -q -m "hypothesis or conformance" --timeout=3600

# The tests that race (clusters, worker processes, computes at once) STRESS_RUNS times in
# a row, each run under a watchdog that prints every thread's stack before it kills a hung
# run (tests/stress.py); stops at the first failure, the logs in .stress/.
STRESS_RUNS ?= 20
stress: $(STAMP)
	HYPOTHESIS_PROFILE=ci $(PY) tests/stress.py --runs $(STRESS_RUNS)

bench: $(STAMP)
	$(PY) -m pytest tests/benchmarks -q --benchmark-enable -o python_files="bench_*.py"

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache .import_linter_cache .stress
