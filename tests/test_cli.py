"""The ``tierflow`` command: status (text, JSON, --watch), demo, --version, exit codes."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest

import tierflow
from tierflow.cli import main
from tierflow.system.devices import FakeGpus, use_provider

GB = 1 << 30
STATUS_LINE = re.compile(r"^RAM \d+\.\d/\d+\.\d GB free \(this program \d+\.\d\d GB, budget .* \| ")


@pytest.fixture(autouse=True)
def _default_provider() -> Iterator[None]:
    with use_provider(None):
        yield


def run_cli(*args: str, **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tierflow", *args],
        capture_output=True,
        text=True,
        timeout=60,
        **kwargs,  # type: ignore[call-overload]
    )


def test_status_prints_status_limits_pressure_and_devices(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["status"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert STATUS_LINE.match(lines[0]), lines[0]
    assert re.match(r"^limits: +\d+\.\d GB usable \((host|container \(cgroup v[12]\))\)", lines[1])
    assert re.match(r"^pressure: +(ok|moderate|high|critical): ", lines[2])
    assert lines[3] == "devices:"
    assert re.match(r"^  cpu: \d+ cores?, \d+\.\d GB free$", lines[4])


def test_status_prints_each_gpus_budget_holdings_and_level(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with use_provider(FakeGpus([(6 * GB, 8 * GB), (GB // 2, 8 * GB)])):
        assert main(["status"]) == 0
    lines = capsys.readouterr().out.splitlines()
    at = lines.index("gpu budgets:")
    assert lines[at + 1 :] == [
        "  cuda:0 budget 5.2 GB (6.0 GB free of 8.0 GB, margin 819.2 MB), tierflow holds 0 B, "
        "pressure ok",
        "  cuda:1 budget 0 B (512.0 MB free of 8.0 GB, margin 819.2 MB), tierflow holds "
        "0 B, pressure high",
    ]


def test_status_without_a_gpu_prints_no_gpu_budgets(capsys: pytest.CaptureFixture[str]) -> None:
    with use_provider(FakeGpus([])):
        assert main(["status"]) == 0
    assert "gpu budgets:" not in capsys.readouterr().out


def test_status_json_has_every_part_in_bytes(capsys: pytest.CaptureFixture[str]) -> None:
    with use_provider(FakeGpus([(6 * GB, 8 * GB)], names=["NVIDIA Test"])):
        assert main(["status", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data) == {"status", "limits", "pressure", "devices"}
    status = data["status"]
    for key in ("ram_free", "ram_usable", "rss", "budget", "swap_used", "ssd_free", "cores"):
        assert isinstance(status[key], int), key
    assert status["text"].endswith("| cuda:0 6.0/8.0 GB free (budget 5.2 GB, tierflow 0 B, ok)")
    assert status["gpus"][0]["free"] == 6 * GB
    # The default margin: 5 % of 8 GB (above the 256 MB floor).
    assert status["gpu_budgets"][0] | {"text": None} == {
        "id": "cuda:0",
        "name": "NVIDIA Test",
        "free": 6 * GB,
        "total": 8 * GB,
        "margin": int(0.10 * 8 * GB),
        "budget": 6 * GB - int(0.10 * 8 * GB),
        "admitted": 0,
        "kept": 0,
        "level": "ok",
        "text": None,
    }
    limits = data["limits"]
    assert {"usable", "free", "budget", "source", "text"} <= set(limits)
    assert limits["usable"] == status["ram_usable"]
    assert limits["budget"] == status["budget"]
    pressure = data["pressure"]
    assert pressure["level"] in ("ok", "moderate", "high", "critical")
    assert isinstance(pressure["free"], int)
    assert [d["id"] for d in data["devices"]] == ["cpu", "cuda:0"]
    assert data["devices"][1] | {"text": None} == {
        "id": "cuda:0",
        "kind": "cuda",
        "index": 0,
        "name": "NVIDIA Test",
        "free": 6 * GB,
        "total": 8 * GB,
        "cores": None,
        "backend": "fake",
        "text": None,
    }


def test_demo_prints_status_then_runs_the_pipeline_on_a_file_bigger_than_the_budget(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["demo", "--budget", "8MB", "--size", "32MB"]) == 0
    out = capsys.readouterr().out
    assert STATUS_LINE.match(out.splitlines()[0])
    assert "8.0 MB" in out
    assert "peak RSS" in out


def test_demo_refuses_a_malformed_size(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--size", "lots"]) == 2
    assert "--size='lots' is not a size" in capsys.readouterr().err


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.strip() == f"tierflow {tierflow.__version__}"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "give a command: status, demo or profile"),
        (["bogus"], "invalid choice: 'bogus'"),
        (["status", "--yaml"], "unrecognized arguments: --yaml"),
    ],
)
def test_bad_usage_exits_2(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: tierflow")
    assert message in err


def test_malformed_setting_exits_2_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TIERFLOW_RAM_BUDGET", "lots")
    tierflow.config.reset()
    assert main(["status"]) == 2
    assert re.search(
        r"^tierflow: error: TIERFLOW_RAM_BUDGET='lots' is not a size", capsys.readouterr().err
    )


def test_python_dash_m_tierflow_status() -> None:
    done = run_cli("status")
    assert done.returncode == 0, done.stderr
    assert STATUS_LINE.match(done.stdout.splitlines()[0])
    assert "devices:" in done.stdout
    assert run_cli("nonsense").returncode == 2


def _sigint_as_in_a_terminal() -> None:
    # A child keeps an ignored SIGINT across exec (a shell without job control starts
    # background commands so), and Python then installs no handler: Ctrl-C, as a
    # terminal sends it, must reach the command under test.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _watch(*extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "tierflow", "status", "--watch", *extra],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_sigint_as_in_a_terminal,
    )


def _stop(child: subprocess.Popen[str]) -> tuple[int, str, str]:
    """SIGINT, as Ctrl-C sends; the exit code and the rest of the output."""
    child.send_signal(signal.SIGINT)
    try:
        out, err = child.communicate(timeout=30)
    finally:
        child.kill()
    return child.returncode, out, err


def test_status_watch_prints_a_line_per_interval_and_ctrl_c_exits_0() -> None:
    child = _watch("--interval", "0.2")
    assert child.stdout is not None
    first, second = child.stdout.readline(), child.stdout.readline()  # waits for them
    code, rest, err = _stop(child)
    assert STATUS_LINE.match(first), first
    assert STATUS_LINE.match(second), second
    assert all(STATUS_LINE.match(line) for line in rest.splitlines())
    assert code == 0, err
    assert "Traceback" not in err
    assert "KeyboardInterrupt" not in err


def test_status_watch_json_prints_one_object_per_line() -> None:
    child = _watch("--json", "--interval", "0.2")
    assert child.stdout is not None
    lines = [child.stdout.readline(), child.stdout.readline()]
    code, _, err = _stop(child)
    assert code == 0, err
    for line in lines:
        assert json.loads(line)["text"].startswith("RAM ")


@pytest.mark.parametrize("interval", ["0", "-1", "soon"])
def test_status_watch_refuses_an_interval_that_is_not_positive(
    interval: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["status", "--watch", "--interval", interval]) == 2
    assert "give a number of seconds above 0" in capsys.readouterr().err


@pytest.mark.cgroup
def test_status_inside_a_512_mb_cgroup_reports_at_most_512_mb() -> None:
    try:
        from cgroups import memory_cgroup, skip_reason
    except ImportError as exc:
        pytest.skip(f"the cgroup test helper is not importable: {exc}")
    if (reason := skip_reason()) is not None:
        pytest.skip(reason)
    limit = 512 << 20
    with memory_cgroup(limit) as cgroup:
        done = cgroup.run(
            [sys.executable, "-m", "tierflow", "status", "--json"],
            timeout=60,
            env=os.environ.copy(),
        )
    assert done.returncode == 0, done.stderr
    data = json.loads(done.stdout)
    assert 0 < data["limits"]["usable"] <= limit
    assert data["limits"]["source"].startswith("cgroup v")
    assert data["status"]["ram_usable"] <= limit
    assert data["status"]["ram_free"] <= limit
    assert data["status"]["budget"] < limit
    assert data["devices"][0]["total"] <= limit
    assert data["status"]["text"].startswith("RAM ")
    assert "/0.5 GB free" in data["status"]["text"]


def test_a_reader_that_goes_away_is_not_an_error() -> None:
    # `tierflow status | head -c 1`: the pipe closes before the output is written.
    child = subprocess.Popen(
        [sys.executable, "-m", "tierflow", "status"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert child.stdout is not None and child.stderr is not None
    child.stdout.close()
    err = child.stderr.read().decode()
    assert child.wait(timeout=60) == 0
    assert "Traceback" not in err


SCRIPT = """
import sys
import numpy as np
import tierflow as tw

x = tw.from_array(np.arange(40_000.0).reshape(10_000, 4), rows=1_000)
mean, std = tw.compute(x.mean(axis=0), x.std(axis=0))
print("args", sys.argv[1:], float(x.sum().compute()))
sys.exit(int(sys.argv[1]) if sys.argv[1:] and sys.argv[1].isdigit() else 0)
"""


def test_profile_runs_a_script_and_writes_its_report_beside_it(tmp_path: object) -> None:
    from pathlib import Path

    script = Path(str(tmp_path)) / "job.py"
    script.write_text(SCRIPT)
    done = run_cli("profile", str(script), "--rows", "x")
    assert done.returncode == 0, done.stderr
    assert "args ['--rows', 'x'] 799980000.0" in done.stdout
    report = Path(str(tmp_path)) / "job.profile.html"
    # 10 blocks and 2 finishes (mean, std), then 10 blocks and 1 finish (sum)
    assert f"profile of 2 compute(s), 23 tasks written to {report}" in done.stderr
    text = report.read_text()
    assert text.count("data:image/png;base64,") == 1
    assert "compute 1: sum()" in text


def test_profile_returns_the_scripts_exit_status_and_still_writes_the_report(
    tmp_path: object, capsys: pytest.CaptureFixture[str]
) -> None:
    from pathlib import Path

    script = Path(str(tmp_path)) / "job.py"
    script.write_text(SCRIPT)
    assert main(["profile", str(script), "3"]) == 3
    assert "args ['3']" in capsys.readouterr().out
    assert (Path(str(tmp_path)) / "job.profile.html").exists()
    assert main(["profile", str(Path(str(tmp_path)) / "missing.py")]) == 2
    assert "no script at" in capsys.readouterr().err


def test_profile_without_a_script_asks_for_the_script_only(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["profile"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: tierflow profile [-h] script [args ...]\n")
    assert err.rstrip().endswith("the following arguments are required: script")
    assert main(["profile", "--help"]) == 0
    assert "its arguments (optional)" in capsys.readouterr().out


FAILING = """
import numpy as np
import tierflow as tw


def broken(n):
    raise ValueError(f"no rows in {n}")


tw.from_array(np.ones((4, 2))).sum().compute()
broken(3)
"""


def test_a_failing_script_shows_its_traceback_from_the_script_down(tmp_path: object) -> None:
    from pathlib import Path

    script = Path(str(tmp_path)) / "job.py"
    script.write_text(FAILING)
    done = run_cli("profile", str(script))
    direct = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == direct.returncode == 1
    traceback_lines = done.stderr.split("\ntierflow: profile of")[0]
    assert traceback_lines == direct.stderr.rstrip("\n")
    assert traceback_lines.splitlines()[1] == f'  File "{script}", line 11, in <module>'
    assert "tierflow: profile of 1 compute(s)" in done.stderr
    assert (Path(str(tmp_path)) / "job.profile.html").exists()


def test_a_script_that_exits_with_a_message_prints_it(
    tmp_path: object, capsys: pytest.CaptureFixture[str]
) -> None:
    from pathlib import Path

    script = Path(str(tmp_path)) / "job.py"
    script.write_text("import sys\nsys.exit('no input given')\n")
    assert main(["profile", str(script)]) == 1
    assert capsys.readouterr().err.startswith("no input given\n")


def test_status_warns_on_stderr_when_nothing_can_spill(tmp_path: object) -> None:
    from pathlib import Path

    blocker = Path(str(tmp_path)) / "a-file"
    blocker.write_text("not a folder")
    env = {**os.environ, "TIERFLOW_SPILL_DIR": str(blocker / "spill")}
    done = run_cli("status", env=env)
    assert done.returncode == 0, done.stderr
    assert f"| SSD: cannot write {blocker}/spill ({blocker} is not a folder)" in done.stdout
    assert done.stderr == (
        f"tierflow: warning: spill files cannot be made in {blocker}/spill ({blocker} is not "
        "a folder). tierflow has no other place to spill: an array or a block that does not "
        "fit the RAM budget raises SpillError. Point TIERFLOW_SPILL_DIR (setting spill_dir) "
        "at a writable folder on a local disk\n"
    )


def test_profile_without_matplotlib_writes_the_report_and_says_why_it_has_no_picture(
    tmp_path: object,
) -> None:
    from pathlib import Path

    script = Path(str(tmp_path)) / "job.py"
    script.write_text(SCRIPT)
    code = (
        "import sys; sys.modules['matplotlib'] = None\n"
        "from tierflow.cli import main\n"
        f"sys.exit(main(['profile', {str(script)!r}]))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    report = Path(str(tmp_path)) / "job.profile.html"
    assert (
        f"tierflow: warning: the profile at {report} has no picture: a profile picture needs "
        "the optional package 'matplotlib': pip install -e " in done.stderr
    )
    assert f"written to {report}" in done.stderr
    text = report.read_text()
    assert "data:image/png" not in text and "No picture: " in text
    assert "compute 1: sum()" in text
