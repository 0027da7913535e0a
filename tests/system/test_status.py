"""memory.status() and memory.limits(): container-aware lines, tables, and dicts for JSON."""

from __future__ import annotations

import json
import os
import re
import warnings
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from tierflow import config, memory
from tierflow.errors import SpillError
from tierflow.system import status as status_module
from tierflow.system.devices import FakeGpus, use_provider
from tierflow.system.limits import MemoryFigures
from tierflow.system.status import Limits, limits

from .cgroupfs import MB, FakeSystem

GB = 1 << 30

# The line as the documentation shows it; GPUs are "cuda:N free/total GB free" or "no GPU".
LINE = re.compile(
    r"^RAM (?P<free>\d+\.\d)/(?P<usable>\d+\.\d) GB free "
    r"\(this program (?P<rss>\d+\.\d\d) GB, budget (?P<budget>\d+\.\d) GB\)"
    r" \| swap (?P<swap>\d+\.\d) GB"
    r" \| SSD (?P<ssd>\d+(\.\d)?) GB free at (?P<spill>\S.*?)"
    r" \| (?P<cores>\d+) cores?, load (?P<load>\d+\.\d\d|n/a)"
    r" \| (?P<gpus>no GPU|{gpu}(, {gpu})*)$".replace(
        "{gpu}",
        r"cuda:\d+ \d+\.\d/\d+\.\d GB free \(budget [0-9.]+ [KMGT]?B, tierflow [0-9.]+ [KMGT]?B, "
        r"(ok|moderate|high|critical)\)",
    )
)


@pytest.fixture(autouse=True)
def _no_gpu() -> Iterator[None]:
    with use_provider(FakeGpus([])):
        yield


@pytest.fixture
def machine(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> SimpleNamespace:
    """Fixed figures: a 7.8 GB cgroup with 7.3 GB free, 29 GB of SSD, 2 cores, load 0.34."""
    figures = SimpleNamespace(
        memory=MemoryFigures(
            usable=int(7.8 * GB),
            free=int(7.3 * GB),
            source="cgroup v1",
            cgroup_dir=None,
            host_total=64 * GB,
        ),
        rss=int(0.04 * GB),
        budget=int(5.1 * GB),
        swap=0,
        ssd=int(29.2 * GB),
        load=(0.34, 0.2, 0.1),
        measured=[],
    )
    monkeypatch.setattr(
        status_module.memory_limits, "read_memory", lambda root=None: figures.memory
    )
    monkeypatch.setattr(status_module.budget, "budget_bytes", lambda: figures.budget)
    monkeypatch.setattr(status_module.devices, "cpu_cores", lambda root=None: 2)
    monkeypatch.setattr(
        status_module,
        "psutil",
        SimpleNamespace(
            Process=lambda: SimpleNamespace(memory_info=lambda: SimpleNamespace(rss=figures.rss)),
            swap_memory=lambda: SimpleNamespace(used=figures.swap),
        ),
    )

    def disk_usage(path: str) -> SimpleNamespace:
        figures.measured.append(path)
        return SimpleNamespace(free=figures.ssd)

    monkeypatch.setattr(status_module.shutil, "disk_usage", disk_usage)
    monkeypatch.setattr(status_module.os, "getloadavg", lambda: figures.load)
    # A home folder of our own, so that the spill folder prints as ~/.tierflow/spill
    # without touching the real one.
    monkeypatch.setenv("HOME", str(tmp_path))
    config.set(spill_dir="~/.tierflow/spill")
    figures.home = tmp_path
    return figures


def test_line_with_fixed_figures(machine: SimpleNamespace) -> None:
    line = str(memory.status())
    assert line == (
        "RAM 7.3/7.8 GB free (this program 0.04 GB, budget 5.1 GB) | swap 0.0 GB"
        " | SSD 29 GB free at ~/.tierflow/spill | 2 cores, load 0.34 | no GPU"
    )
    assert LINE.match(line)


def test_ram_figures_are_the_cgroups_not_the_hosts(machine: SimpleNamespace) -> None:
    machine.memory = MemoryFigures(
        usable=512 << 20, free=300 << 20, source="cgroup v2", cgroup_dir="/x", host_total=64 * GB
    )
    found = memory.status()
    assert str(found).startswith("RAM 0.3/0.5 GB free")
    assert (found.ram_usable, found.ram_free, found.memory_source) == (
        512 << 20,
        300 << 20,
        "cgroup v2",
    )
    assert "container (cgroup v2)" in found._repr_html_()


def test_line_with_gpus(machine: SimpleNamespace) -> None:
    gpus = [(int(130.1 * GB), int(139.8 * GB)), (int(2.5 * GB), 80 * GB)]
    with use_provider(FakeGpus(gpus, names=["NVIDIA H200", "NVIDIA A100"])):
        line = str(memory.status())
    # Margins: 10 % of 139.8 GB (14.0 GB), and 10 % of 80 GB (8 GB, more than is free).
    assert line.endswith(
        "| 2 cores, load 0.34 | cuda:0 130.1/139.8 GB free (budget 116.1 GB, tierflow 0 B, ok), "
        "cuda:1 2.5/80.0 GB free (budget 0 B, tierflow 0 B, critical)"
    )
    assert LINE.match(line)


def test_gpu_budgets_show_what_tierflow_holds_and_the_level(machine: SimpleNamespace) -> None:
    from tierflow.system.device_budget import ledger

    with use_provider(FakeGpus([(6 * GB, 8 * GB), (GB, 8 * GB)])), config.set(gpu_margin="1GB"):
        seat = ledger.force("cuda:0", 512 << 20)
        try:
            found = memory.status()
        finally:
            ledger.release(seat)
    assert str(found).endswith(
        "cuda:0 6.0/8.0 GB free (budget 5.0 GB, tierflow 512.0 MB, ok), "
        "cuda:1 1.0/8.0 GB free (budget 0 B, tierflow 0 B, moderate)"
    )
    data = json.loads(json.dumps(found.as_dict()))
    first = data["gpu_budgets"][0]
    assert first | {"text": None} == {
        "id": "cuda:0",
        "name": "Fake GPU 0",
        "free": 6 * GB,
        "total": 8 * GB,
        "margin": GB,
        "budget": 5 * GB,
        "admitted": 512 << 20,
        "kept": 0,
        "level": "ok",
        "text": None,
    }
    assert data["gpu_budgets"][1]["level"] == "moderate"
    page = found._repr_html_()
    assert "cuda:0 budget" in page and "tierflow holds 512.0 MB, pressure ok" in page


def test_small_disk_keeps_a_decimal_and_no_load_average(
    machine: SimpleNamespace, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_load() -> tuple[float, float, float]:
        raise OSError("no load average")

    machine.ssd = int(3.24 * GB)
    monkeypatch.setattr(status_module.os, "getloadavg", no_load)
    line = str(memory.status())
    assert "| SSD 3.2 GB free at ~/.tierflow/spill |" in line
    assert "| 2 cores, load n/a |" in line
    assert memory.status().load_1m is None
    assert LINE.match(line)


def test_ssd_is_measured_at_the_nearest_existing_folder_without_creating_it(
    machine: SimpleNamespace,
) -> None:
    found = memory.status()
    assert found.spill_dir == str(machine.home / ".tierflow/spill")
    assert found.ssd_path == str(machine.home)
    assert machine.measured == [str(machine.home)]
    assert not (machine.home / ".tierflow").exists()


def test_spill_folder_outside_home_is_shown_in_full(
    machine: SimpleNamespace, tmp_path_factory: pytest.TempPathFactory
) -> None:
    elsewhere = tmp_path_factory.mktemp("elsewhere") / "spill"
    elsewhere.mkdir()
    config.set(spill_dir=str(elsewhere))
    found = memory.status()
    assert f"| SSD 29 GB free at {elsewhere} |" in str(found)
    assert found.ssd_path == str(elsewhere)


def test_a_spill_folder_that_cannot_be_made_is_shown_and_warned_of(
    machine: SimpleNamespace, tmp_path_factory: pytest.TempPathFactory
) -> None:
    blocker = tmp_path_factory.mktemp("elsewhere") / "a-file"
    blocker.write_text("not a folder")
    config.set(spill_dir=str(blocker / "spill"))
    with pytest.warns(status_module.SpillFolderWarning) as caught:
        found = memory.status()
    assert found.spill_problem == f"{blocker} is not a folder"
    assert (
        f"| SSD: cannot write {blocker}/spill ({blocker} is not a folder), nothing can spill |"
        in str(found)
    )
    (warning,) = caught
    assert str(warning.message) == (
        f"spill files cannot be made in {blocker}/spill ({blocker} is not a folder). "
        "tierflow has no other place to spill: an array or a block that does not fit the "
        "RAM budget raises SpillError. Point TIERFLOW_SPILL_DIR (setting spill_dir) at a "
        "writable folder on a local disk"
    )
    assert warning.filename == __file__  # the caller's line
    assert json.loads(json.dumps(found.as_dict()))["spill_problem"] == found.spill_problem
    assert "cannot spill" in found._repr_html_()


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux's /proc")
def test_a_spill_folder_on_a_filesystem_that_makes_no_folders_is_unwritable(
    machine: SimpleNamespace,
) -> None:
    config.set(spill_dir="/proc/tierflow-spill")  # root cannot make a folder there either
    with pytest.warns(status_module.SpillFolderWarning, match="No such file or directory"):
        found = memory.status()
    assert found.spill_problem == "No such file or directory"


def test_a_writable_spill_folder_gives_no_warning_and_leaves_nothing_behind(
    machine: SimpleNamespace,
) -> None:
    (machine.home / "spill").mkdir()
    config.set(spill_dir=str(machine.home / "spill"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        found = memory.status()
    assert found.spill_problem is None
    assert list((machine.home / "spill").iterdir()) == []


def test_where_status_says_nothing_can_spill_a_spilling_array_raises(tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    with config.set(spill_dir=str(blocker / "spill"), ram_budget="1MB"):
        with pytest.warns(status_module.SpillFolderWarning):
            assert memory.status().spill_problem is not None
        with pytest.raises(SpillError, match="cannot create spill files in"):
            memory.array((1 << 20,), "float64")  # 8 MB, over the budget: a spill file


def test_home_prefix_is_only_replaced_at_a_folder_boundary(machine: SimpleNamespace) -> None:
    sibling = f"{machine.home}-other/spill"
    assert status_module._home_short(sibling) == sibling
    assert status_module._home_short(f"{machine.home}/spill") == "~/spill"


def test_dict_is_json_with_bytes(machine: SimpleNamespace) -> None:
    found = memory.status()
    data = json.loads(json.dumps(found.as_dict()))
    assert data["ram_free"] == int(7.3 * GB)
    assert data["ram_usable"] == int(7.8 * GB)
    assert data["memory_source"] == "cgroup v1"
    assert data["rss"] == int(0.04 * GB)
    assert data["budget"] == int(5.1 * GB)
    assert data["ssd_free"] == int(29.2 * GB)
    assert data["cores"] == 2
    assert data["load_1m"] == 0.34
    assert data["gpus"] == []
    assert data["gpu_budgets"] == []
    assert data["text"] == str(found)


def test_repr_and_html(machine: SimpleNamespace) -> None:
    found = memory.status()
    assert repr(found) == f"<Status {found}>"
    page = found._repr_html_()
    assert page.startswith("<table>") and page.endswith("</table>")
    assert "~/.tierflow/spill" in page
    assert "container (cgroup v1)" in page
    assert "<th style='text-align:left'>GPU</th>" in page


def test_real_status_on_this_machine_parses() -> None:
    found = memory.status()
    match = LINE.match(str(found))
    assert match, str(found)
    assert 0 <= found.ram_free <= found.ram_usable
    assert found.rss > 0
    assert found.budget > 0
    assert found.cores >= 1
    assert found.ssd_free > 0
    assert os.path.isdir(found.ssd_path)
    assert found.spill_dir == os.path.abspath(os.path.expanduser(config.get("spill_dir")))


# -- the Limits object -----------------------------------------------------------------------


def test_limits_str_in_a_container() -> None:
    shown = Limits(
        usable=int(5.8 * GB), free=int(5.8 * GB), budget=4 * GB, source="cgroup v1",
        host_total=int(23.4 * GB),
    )  # fmt: skip
    assert str(shown) == "5.8 GB usable (container (cgroup v1)), 5.8 GB free, budget 4.0 GB"
    assert repr(shown) == (
        "Limits(usable=5.8 GB, free=5.8 GB, budget=4.0 GB, source='cgroup v1', host_total=23.4 GB)"
    )


def test_limits_str_on_the_host() -> None:
    shown = Limits(int(23.4 * GB), 20 * GB, 14 * GB, "host", int(23.4 * GB))
    assert str(shown) == "23.4 GB usable (host), 20.0 GB free, budget 14.0 GB"


def test_limits_as_dict_for_json() -> None:
    shown = Limits(2 * GB, 1 * GB, 512 * MB, "cgroup v2", 16 * GB, limited_by="/job")
    assert shown.as_dict() == {
        "usable": 2 * GB, "free": 1 * GB, "budget": 512 * MB, "source": "cgroup v2",
        "host_total": 16 * GB, "limited_by": "/job", "where": "container (cgroup v2)",
        "text": "2.0 GB usable (container (cgroup v2)), 1.0 GB free, budget 512.0 MB",
    }  # fmt: skip


def test_limits_html_is_a_small_escaped_table() -> None:
    shown = Limits(2 * GB, 1 * GB, 512 * MB, "cgroup v2", 16 * GB, limited_by="/a<b>")
    page = shown._repr_html_()
    assert page.startswith("<table>") and page.endswith("</table>")
    assert page.count("<tr>") == 4
    assert "container (cgroup v2): /a&lt;b&gt;" in page
    assert "512.0 MB" in page and "16.0 GB" in page


def test_limits_reads_figures_and_the_budget(tmp_path: Path) -> None:
    fake = FakeSystem(tmp_path / "root", total=16 * GB, available=12 * GB)
    fake.mount_v1("/job")
    fake.v1("/job", limit=6 * GB, usage=2 * GB)
    with config.set(proc_root=fake.root, ram_budget="3GB"):
        shown = limits()
    assert (shown.usable, shown.free, shown.budget, shown.source) == (
        6 * GB, 4 * GB, 3 * GB, "cgroup v1",
    )  # fmt: skip
    assert str(shown) == "6.0 GB usable (container (cgroup v1)), 4.0 GB free, budget 3.0 GB"
