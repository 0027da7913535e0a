"""Every script in ``examples/`` runs, with small sizes, and prints what it promises.

Each script runs in its own Python process, as a user would run it, with ``TMPDIR``
pointed at an empty folder: after it exits, that folder and the spill folder must hold
no file, since every example says it removes what it made. A new example needs an
entry in ``CASES``; a test fails until it has one.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@dataclass(frozen=True)
class Case:
    """How to run one example small, and lines (regular expressions) its output must hold."""

    args: tuple[str, ...] = ()
    expect: tuple[str, ...] = ()
    needs: tuple[str, ...] = ()  # optional packages the checked output needs
    marks: tuple[pytest.MarkDecorator, ...] = field(default=())


CASES: dict[str, Case] = {
    "spill_array.py": Case(
        expect=(
            r"^small in RAM: True; big on the SSD: True$",
            r"^filled 256 MB in ",
            r"^big lives in .* \(268435456 bytes\)$",
            r"^after memory\.free\(big\) the file exists: False$",
        ),
    ),
    "stream_big_file.py": Case(
        expect=(
            r"^column means: \[0\.5 1\.5 2\.5 3\.5 4\.5 5\.5 6\.5 7\.5\]$",
            r"^memory\.map result: \(8388608, 8\) float32, on the SSD: True$",
        ),
        # A fixed 256 MB file, written and fsynced: seconds, more on a busy disk.
        marks=(pytest.mark.slow,),
    ),
    "cached_across_runs.py": Case(
        args=("--seconds", "0.05"),
        expect=(r"^cache_info: hits=0, misses=3, entries=3$",),
    ),
    "big_file_pipeline.py": Case(
        args=("--size", "16MB", "--budget", "8MB"),
        expect=(
            r"^wrote 16\.0 MB \(524,288 rows x 8 float32\) .*RAM budget 8\.0 MB",
            r"^pass 1, mean and std of every column: [\d.]+ s, [\d.]+ GB/s$",
            r"^  kept [\d,]+ of 524,288 rows \(9\d\.\d\d%\)",
            r"^  the first [\d,]+ output rows match NumPy: True$",
            r"^memory: budget 8\.0 MB; the scheduler planned at most ",
            r"^  peak RSS .*: [\d.]+ MB, of which",
        ),
    ),
    "feature_extraction.py": Case(
        args=("--files", "40"),
        expect=(
            r"^embedded 40 files in [\d.]+ s \([\d,]+ files/s\) on (cpu|cuda:\d)",
            r"embeddings\.npy: \(40, 64\) float32$",
            r"^the first 16 rows match the model run directly: True",
        ),
        needs=("torch",),
        # Importing torch alone takes seconds on a small machine.
        marks=(pytest.mark.torch, pytest.mark.slow),
    ),
    "plain_python_rows.py": Case(
        args=("--rows", "40000"),
        expect=(
            r"^ +serial: +[\d.]+ s$",
            r"^processes: +[\d.]+ s \(the first compute starts the worker pool\)$",
            r"^the three executors agree: True$",
            r"^scores\.npy: \(40000, 1\) float64, first rows match: True$",
        ),
    ),
    "cluster_pipeline.py": Case(
        args=("--rows", "40000"),
        expect=(
            r"^40,000 rows x 8 float32 on DaskExecutor\(workers=2, ",
            r"^standardised file identical: True$",
            r"^score sums identical: True$",
            r"^masked rows identical: True \([\d,]+ rows\)$",
        ),
        marks=(pytest.mark.slow,),  # starts a LocalCluster of two processes
    ),
    "no_shared_disk.py": Case(
        args=("--rows", "40000"),
        expect=(
            r"^40,000 rows x 8 float32 in s3://example/tierflow-example/input\.zarr, on DaskExecutor",
            r"^sorted by column 0 into .*sorted\.zarr in [\d.]+ s; identical to NumPy's: True$",
            r"^rows with x\[:, 0\] > 1\.5: [\d,]+; identical to NumPy's: True$",
            r"cache.*: second run 2 hits, the same values: True; equal to threads': True$",
            r"^objects left under s3://example/tierflow-example/tmp: 0$",
        ),
        needs=("distributed", "s3fs", "zarr", "moto"),
        marks=(pytest.mark.slow,),  # starts a local S3 server and two Dask workers
    ),
    "dask_interop.py": Case(
        # The cluster path: its worker processes unpickle the tierflow graph.
        args=("--rows", "40000", "--distributed"),
        expect=(
            r"^on a distributed cluster of 2 worker processes$",
            r"^dask -> tierflow -> dask: \(40000, 1\) float32 in 8 chunks, .*matches dask alone: True$",
            r"^after a dask mask: shape \(None, 8\), 8 blocks of unknown size; .*matches dask's: True$",
        ),
        marks=(pytest.mark.slow,),  # starts a LocalCluster of two processes
    ),
    "explore.py": Case(
        args=("--rows", "200000", "--budget", "8MB"),
        expect=(
            r"^  pending  3: \[:, 0\] -> greater -> mask$",
            r"^[\d,]+ of 200,000 rows have x\[:, 0\] > 0 \(\d\d\.\d%\)$",
            r"^row ([\d,]+) \(the spike was planted at row \1\): ",
            r"^n\d+ +mask +\(\?, 8\) float32",
            r"^total: (RAM|SSD) 3\.0\d\d MB in 1 array$",
        ),
    ),
    "xarray_climate.py": Case(
        args=("--years", "1", "--lat", "8", "--lon", "16"),
        expect=(
            r"^wrote 365 days of tas and pr on a 8 x 16 grid",
            r"^tas is a tierflow array in blocks of 365 days$",
            r"^mean and std over time: [\d.]+ s$",
            r"^anomalies written to Zarr: [\d.]+ s$",
            r"^monthly climatology and monthly means: [\d.]+ s$",
            r"^mean temperature where pr > 2: [\d.]+ s$",
            r"^removed tierflow-xarray-\w+: True$",
        ),
        needs=("xarray", "zarr"),
    ),
    "zarr_pipeline.py": Case(
        args=("--size", "32MB", "--budget", "8MB"),
        expect=(
            r"^wrote 32\.0 MB decoded \(1,048,576 rows x 8 float32\) as [\d.]+ MB of blosc-lz4",
            r"^  sources  from_zarr\('features\.zarr'\)$",
            r"^pass 1, mean and std of every column: [\d.]+ s, [\d.]+ GB/s decoded$",
            r"^  kept\.zarr: \(10[0-9,]+, 8\) float32 in .*; marked complete: True$",
            r"^  the first [\d,]+ rows read back match NumPy: True$",
        ),
        needs=("zarr",),
    ),
}


def run_example(
    name: str, args: tuple[str, ...], tmp: Path, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp,
        env={**os.environ, "TMPDIR": str(tmp), **(env or {})},
    )


def files_under(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*") if p.is_file()] if folder.exists() else []


def check_output(result: subprocess.CompletedProcess[str], expect: tuple[str, ...]) -> None:
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"
    for pattern in expect:
        assert re.search(pattern, result.stdout, re.MULTILINE), (
            f"no line matches {pattern!r} in:\n{result.stdout}\n{result.stderr}"
        )


def test_every_example_has_a_case() -> None:
    scripts = sorted(p.name for p in EXAMPLES.glob("*.py"))
    assert scripts, f"no examples found in {EXAMPLES}"
    assert sorted(CASES) == scripts, "add an entry to CASES for each script in examples/"


def test_the_readme_lists_every_example() -> None:
    readme = (EXAMPLES.parent / "README.md").read_text()
    table = readme.split("\n## Examples\n", 1)[1].split("\n## ", 1)[0]
    listed = re.findall(r"^\| \[`examples/([^`]+)`\]\(examples/\1\) \| \S", table, re.M)
    shipped = sorted(p.name for p in EXAMPLES.iterdir() if p.suffix in (".py", ".ipynb"))
    assert sorted(listed) == shipped, "give each example a row in the README's table"


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=c.marks, id=n.removesuffix(".py")) for n, c in CASES.items()]
)
def test_example_runs_and_cleans_up(name: str, tmp_path: Path) -> None:
    case = CASES[name]
    for module in case.needs:
        pytest.importorskip(module, reason=f"{name} needs {module} for the output checked here")
    args = case.args
    if name == "cached_across_runs.py":
        args = (*args, "--dir", str(tmp_path / "cache"))
    result = run_example(name, args, tmp_path)
    check_output(result, case.expect)
    assert "Traceback" not in result.stderr, result.stderr
    left = [p for p in files_under(tmp_path) if not p.is_relative_to(tmp_path / "cache")]
    assert left == [], f"{name} left files behind: {left}"
    spill = Path(os.environ["TIERFLOW_SPILL_DIR"])
    assert files_under(spill) == [], f"{name} left spill files: {files_under(spill)}"


def test_cached_example_hits_on_the_second_run(tmp_path: Path) -> None:
    args = ("--seconds", "0.05", "--dir", str(tmp_path / "cache"))
    first = run_example("cached_across_runs.py", args, tmp_path)
    check_output(first, (r"^spectrum\(1\): miss ",))
    second = run_example("cached_across_runs.py", args, tmp_path)
    check_output(
        second,
        (
            r"^spectrum\(1\): hit ",
            r"^spectrum\(3\): hit .*memmap$",
            r"^cache_info: hits=3, misses=0",
        ),
    )


def test_feature_extraction_without_torch_says_so_and_exits_0(tmp_path: Path) -> None:
    # A None entry in sys.modules makes `import torch` raise ImportError, as on a
    # machine without torch.
    code = (
        "import runpy, sys; sys.modules['torch'] = None; "
        f"sys.argv = ['feature_extraction.py', '--files', '5']; "
        f"runpy.run_path({str(EXAMPLES / 'feature_extraction.py')!r}, run_name='__main__')"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
        env={**os.environ, "TMPDIR": str(tmp_path)},
    )
    check_output(result, (r"^this example needs torch, .*pip install -e '.*\[torch\]' ",))
    assert files_under(tmp_path) == []


@pytest.mark.slow  # starts a local Ray
def test_cluster_example_runs_on_ray(tmp_path: Path) -> None:
    result = run_example("cluster_pipeline.py", ("--rows", "40000", "--ray"), tmp_path)
    check_output(
        result,
        (
            r"^40,000 rows x 8 float32 on RayExecutor\(workers=2\)$",
            r"^standardised file identical: True$",
            r"^score sums identical: True$",
            r"^masked rows identical: True \([\d,]+ rows\)$",
        ),
    )
    assert "Traceback" not in result.stderr, result.stderr
    spill = Path(os.environ["TIERFLOW_SPILL_DIR"])
    assert files_under(spill) == [], f"left spill files: {files_under(spill)}"


# The scheduler answers heartbeats 3 s late and the cluster closes once each worker has
# one in flight:
# distributed then logs "Failed to communicate with scheduler during heartbeat" with a
# traceback (dask/distributed#7192), which failed the dask examples' check of stderr
# about one run in five.
SLOW_HEARTBEATS = """
import asyncio, importlib.util, logging, sys, time
from distributed import Client, LocalCluster

def main():
    spec = importlib.util.spec_from_file_location("example", sys.argv[1])
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    with (
        LocalCluster(n_workers=2, threads_per_worker=1, dashboard_address=None,
                     silence_logs=logging.ERROR) as cluster,
        Client(cluster) as client,
    ):
        if sys.argv[2] == "quiet":
            example.quiet_close(client)
        answer = cluster.scheduler.handlers["heartbeat_worker"]
        waiting = set()

        async def late(*args, **kwargs):
            waiting.add(kwargs["address"])
            await asyncio.sleep(3)
            return answer(*args, **kwargs)

        cluster.scheduler.handlers["heartbeat_worker"] = late
        deadline = time.monotonic() + 60
        while len(waiting) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)  # until each worker has a heartbeat waiting
    print("closed")

if __name__ == "__main__":
    main()
"""


@pytest.mark.slow  # starts two LocalClusters of two processes
@pytest.mark.parametrize("name", ["dask_interop.py", "cluster_pipeline.py"])
def test_dask_examples_close_their_cluster_without_a_traceback(name: str, tmp_path: Path) -> None:
    pytest.importorskip("distributed")
    script = tmp_path / "slow_heartbeats.py"
    script.write_text(SLOW_HEARTBEATS)

    def run(mode: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, str(script), str(EXAMPLES / name), mode]
        env = {**os.environ, "TMPDIR": str(tmp_path)}
        return subprocess.run(command, capture_output=True, text=True, timeout=120, env=env)

    loud = run("loud")  # the race is really there without the example's filter
    assert "Failed to communicate with scheduler during heartbeat" in loud.stderr, loud
    quiet = run("quiet")
    assert quiet.stdout.strip() == "closed", quiet
    assert "Traceback" not in quiet.stderr, quiet.stderr
