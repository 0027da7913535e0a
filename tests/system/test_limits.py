"""Usable and free memory from /proc/meminfo and memory cgroups (tierflow/system/limits.py)."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tierflow import config
from tierflow.system import limits as limits_module
from tierflow.system.limits import MemoryFigures, own_cgroup, read_memory

import cgroups
from .cgroupfs import GB, MB, V1_UNLIMITED, FakeSystem, V1Stat

LOGGER = "tierflow.system"


@pytest.fixture(autouse=True)
def _fresh_warnings() -> Iterator[None]:
    # Warnings are logged once per process; each test checks its own.
    limits_module._warned.clear()
    yield
    limits_module._warned.clear()


@pytest.fixture
def fake(tmp_path: Path) -> FakeSystem:
    return FakeSystem(tmp_path / "root", total=16 * GB, available=12 * GB)


def warnings_of(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


# -- host ------------------------------------------------------------------------------------


def test_host_only_reads_meminfo(fake: FakeSystem, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, LOGGER)
    figures = read_memory(fake.root)
    assert figures == MemoryFigures(
        usable=16 * GB, free=12 * GB, source="host", cgroup_dir=None, host_total=16 * GB
    )
    assert warnings_of(caplog) == []


def test_meminfo_without_memavailable_estimates_it(fake: FakeSystem) -> None:
    fake.meminfo(16 * GB, None, free=3 * GB)  # Cached = 0 then; MemFree + Buffers + Cached
    assert read_memory(fake.root).free == 3 * GB


def test_root_defaults_to_the_proc_root_setting(fake: FakeSystem) -> None:
    with config.set(proc_root=fake.root):
        assert read_memory().host_total == 16 * GB


# -- cgroup v1 -------------------------------------------------------------------------------


def test_v1_limit_below_host_wins(fake: FakeSystem) -> None:
    fake.mount_v1("/job")
    fake.v1("/job", limit=6 * GB, usage=3 * GB, inactive_file=1 * GB)
    figures = read_memory(fake.root)
    assert figures.usable == 6 * GB
    assert figures.source == "cgroup v1"
    assert figures.limited_by == "/job"
    # 6 GB - (3 GB used - 1 GB reclaimable cache)
    assert figures.free == 4 * GB
    assert figures.host_total == 16 * GB


def test_v1_total_inactive_file_is_preferred(fake: FakeSystem) -> None:
    fake.mount_v1("/job")
    fake.v1(
        "/job",
        limit=6 * GB,
        usage=3 * GB,
        inactive_file=1 * GB,
        stat=V1Stat(total_inactive_file=2 * GB),
    )
    assert read_memory(fake.root).free == 5 * GB


def test_v1_inactive_file_used_without_total(fake: FakeSystem) -> None:
    fake.mount_v1("/job")
    fake.v1(
        "/job",
        limit=6 * GB,
        usage=3 * GB,
        inactive_file=1 * GB,
        stat=V1Stat(total_inactive_file=-1),
    )
    assert read_memory(fake.root).free == 4 * GB


def test_v1_nested_smallest_limit_wins(fake: FakeSystem) -> None:
    fake.mount_v1("/a/b/c")
    fake.v1("/a", limit=8 * GB, usage=7 * GB)  # the tightest free figure
    fake.v1("/a/b", limit=4 * GB, usage=1 * GB)  # the smallest limit
    fake.v1("/a/b/c", limit=6 * GB, usage=512 * MB)
    figures = read_memory(fake.root)
    assert (figures.usable, figures.source, figures.limited_by) == (4 * GB, "cgroup v1", "/a/b")
    assert figures.free == 1 * GB


def test_v1_other_controllers_are_not_read(fake: FakeSystem) -> None:
    cpu = fake.mount_v1("/batch", point="/sys/fs/cgroup/cpu,cpuacct", controllers="cpu,cpuacct")
    (cpu / "memory.limit_in_bytes").parent.mkdir(parents=True)
    (cpu / "memory.limit_in_bytes").write_text(f"{1 * GB}\n")  # a decoy: not the memory hierarchy
    fake.mount_v1("/job")
    fake.v1("/job", limit=4 * GB)
    assert read_memory(fake.root).usable == 4 * GB


def test_v1_memory_mounted_with_other_controllers(fake: FakeSystem) -> None:
    fake.mount_v1("/job", point="/sys/fs/cgroup/cpu,memory", controllers="cpu,memory")
    fake.v1("/job", limit=4 * GB)
    assert read_memory(fake.root).usable == 4 * GB


def test_v1_ancestor_without_hierarchy_does_not_bind(fake: FakeSystem) -> None:
    fake.mount_v1("/a/b")
    fake.v1("/a", limit=1 * GB, stat=V1Stat(use_hierarchy=0))
    assert read_memory(fake.root).source == "host"


@pytest.mark.parametrize("value", [V1_UNLIMITED, 2**62, 2**63 - 1])
def test_v1_unlimited_values_leave_the_host_figure(fake: FakeSystem, value: int) -> None:
    fake.mount_v1("/job")
    fake.v1("/job", limit=value, usage=1 * GB)
    figures = read_memory(fake.root)
    assert (figures.usable, figures.source, figures.limited_by) == (16 * GB, "host", None)
    assert figures.free == 12 * GB


@pytest.mark.parametrize("limit", [64 * GB, 16 * GB])
def test_limit_at_or_above_host_ram_loses_to_the_host(fake: FakeSystem, limit: int) -> None:
    fake.mount_v1("/job")
    fake.v1("/job", limit=limit, usage=1 * GB)
    figures = read_memory(fake.root)
    assert (figures.usable, figures.source) == (16 * GB, "host")
    assert figures.free == 12 * GB  # MemAvailable is tighter than the limit - 1 GB


def test_cgroup_free_can_be_tighter_than_host(fake: FakeSystem) -> None:
    fake.mount_v1("/job")
    fake.v1("/job", limit=6 * GB, usage=5 * GB)
    assert read_memory(fake.root).free == 1 * GB
    fake.meminfo(16 * GB, 512 * MB)  # the host is even shorter
    assert read_memory(fake.root).free == 512 * MB


def test_free_is_never_negative(fake: FakeSystem) -> None:
    fake.mount_v1("/job")
    fake.v1("/job", limit=1 * GB, usage=2 * GB)
    assert read_memory(fake.root).free == 0


# -- cgroup v2 -------------------------------------------------------------------------------


def test_v2_memory_max(fake: FakeSystem) -> None:
    folder = fake.mount_v2("/user.slice/job.scope")
    fake.v2("/user.slice/job.scope", max=2 * GB, current=1 * GB, inactive_file=256 * MB)
    figures = read_memory(fake.root)
    assert (figures.usable, figures.source) == (2 * GB, "cgroup v2")
    assert figures.free == 2 * GB - (1 * GB - 256 * MB)
    assert figures.cgroup_dir == str(folder)
    assert figures.limited_by == "/user.slice/job.scope"


def test_v2_memory_high_counts_when_lower(fake: FakeSystem) -> None:
    fake.mount_v2("/job")
    fake.v2("/job", max=4 * GB, high=3 * GB, current=1 * GB)
    figures = read_memory(fake.root)
    assert (figures.usable, figures.free) == (3 * GB, 2 * GB)


def test_v2_max_means_unlimited(fake: FakeSystem, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, LOGGER)
    fake.mount_v2("/job")
    fake.v2("/job", max="max", high="max", current=10 * GB)
    figures = read_memory(fake.root)
    assert (figures.usable, figures.free, figures.source) == (16 * GB, 12 * GB, "host")
    assert warnings_of(caplog) == []  # the root cgroup has no memory.max, and that is fine


def test_v2_nested_smallest_limit_wins(fake: FakeSystem) -> None:
    fake.mount_v2("/a/b")
    fake.v2("/a", max=3 * GB, current=2 * GB)
    fake.v2("/a/b", max=5 * GB, current=1 * GB)
    figures = read_memory(fake.root)
    assert (figures.usable, figures.limited_by, figures.free) == (3 * GB, "/a", 1 * GB)


def test_v2_without_memory_controller_is_ignored(fake: FakeSystem) -> None:
    fake.mount_v2("/job", memory=False)
    job = fake.v2("/job", max=1 * GB)
    (job / "cgroup.controllers").write_text("cpu io pids\n")
    figures = read_memory(fake.root)
    assert figures.source == "host"
    assert figures.cgroup_dir is not None  # still where memory.pressure lives


# -- hybrid ----------------------------------------------------------------------------------


def test_hybrid_reads_v1_memory_and_reports_the_v2_folder(fake: FakeSystem) -> None:
    fake.mount_v1("/job")
    unified = fake.mount_v2("/", point="/sys/fs/cgroup/unified", memory=False)
    fake.v1("/job", limit=5 * GB, usage=1 * GB)
    figures = read_memory(fake.root)
    assert (figures.usable, figures.source) == (5 * GB, "cgroup v1")
    assert figures.cgroup_dir == str(unified)
    cgroup = own_cgroup(fake.root)
    assert cgroup is not None and (cgroup.version, cgroup.name) == (1, "/job")


def test_hybrid_v1_wins_over_a_v2_tree_listing_memory(fake: FakeSystem) -> None:
    fake.mount_v1("/job")
    fake.mount_v2("/job", point="/sys/fs/cgroup/unified")
    fake.v2("/job", max=1 * GB)
    fake.v1("/job", limit=5 * GB)
    assert read_memory(fake.root).usable == 5 * GB


# -- containers ------------------------------------------------------------------------------


def test_container_v1_mount_root_is_the_cgroup_itself(fake: FakeSystem) -> None:
    cid = "/kubepods/burstable/pod1/0123abcd"
    folder = fake.mount_v1(cid, mount_root=cid)
    fake.v1(cid, limit=6 * GB, usage=1 * GB)
    # The container's cgroup is the mount point itself: no ancestor is visible.
    assert folder == fake.base / "sys/fs/cgroup/memory"
    figures = read_memory(fake.root)
    assert (figures.usable, figures.source, figures.limited_by) == (6 * GB, "cgroup v1", cid)


def test_container_v1_hidden_ancestor_limit_from_memory_stat(fake: FakeSystem) -> None:
    cid = "/docker/0123abcd"
    fake.mount_v1(cid, mount_root=cid)
    fake.v1(cid, limit=V1_UNLIMITED, usage=1 * GB, stat=V1Stat(hierarchical_limit=3 * GB))
    figures = read_memory(fake.root)
    assert (figures.usable, figures.free) == (3 * GB, 2 * GB)
    assert figures.limited_by == f"an ancestor of {cid}"


def test_container_v2_with_cgroup_namespace(fake: FakeSystem) -> None:
    folder = fake.mount_v2("/")  # the namespace's root: /proc/self/cgroup says 0::/
    fake.v2("/", max=2 * GB, current=1 * GB)
    figures = read_memory(fake.root)
    assert (figures.usable, figures.source, figures.cgroup_dir) == (
        2 * GB,
        "cgroup v2",
        str(folder),
    )


def test_container_v2_mount_root_is_the_cgroup_itself(fake: FakeSystem) -> None:
    cid = "/system.slice/docker-0123.scope"
    fake.mount_v2(cid, mount_root=cid)
    fake.v2(cid, max=1 * GB, current=256 * MB)
    figures = read_memory(fake.root)
    assert (figures.usable, figures.free, figures.limited_by) == (1 * GB, 768 * MB, cid)


def test_mount_point_with_a_space(fake: FakeSystem) -> None:
    fake.mount_v1("/job", point="/sys/fs/cgroup/my memory")
    fake.v1("/job", limit=2 * GB)
    assert read_memory(fake.root).usable == 2 * GB


def test_mount_root_not_above_the_cgroup_reads_the_mount_point(
    fake: FakeSystem, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, LOGGER)
    fake.mount_v1("/other", mount_root="/other")
    fake.v1("/other", limit=2 * GB)
    fake.write("proc/self/cgroup", "4:memory:/elsewhere/job\n")
    assert read_memory(fake.root).usable == 2 * GB
    assert any("is not under the mounted cgroup /other" in m for m in warnings_of(caplog))


# -- missing files and garbage: the host figure (or the next level) with a warning -----------


def test_garbage_limit_falls_back_to_the_host(
    fake: FakeSystem, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, LOGGER)
    folder = fake.mount_v1("/job")
    fake.v1("/job", limit="lots of memory", usage=1 * GB)
    figures = read_memory(fake.root)
    assert (figures.usable, figures.free, figures.source) == (16 * GB, 12 * GB, "host")
    (message,) = warnings_of(caplog)
    assert message == (
        f"cannot read the memory limit: {folder}/memory.limit_in_bytes holds "
        f"'lots of memory', not a number; skipping this cgroup level"
    )


def test_missing_limit_falls_back_to_the_next_level(
    fake: FakeSystem, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, LOGGER)
    folder = fake.mount_v1("/a/job")
    fake.v1("/a", limit=3 * GB)
    # memory.stat's hierarchical limit would name the right figure; leave it out too.
    fake.v1("/a/job", limit=1 * GB, stat=V1Stat(hierarchical_limit=V1_UNLIMITED))
    fake.remove(folder / "memory.limit_in_bytes")
    assert read_memory(fake.root).usable == 3 * GB
    assert warnings_of(caplog) == [
        f"cannot read the memory limit: {folder}/memory.limit_in_bytes is missing or "
        f"unreadable; skipping this cgroup level"
    ]


def test_garbage_v2_max_is_ignored_with_a_warning(
    fake: FakeSystem, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, LOGGER)
    folder = fake.mount_v2("/job")
    fake.v2("/job", max="", high=2 * GB)
    assert read_memory(fake.root).usable == 2 * GB
    assert warnings_of(caplog) == [
        f"cannot read the memory limit: {folder}/memory.max is empty; ignoring it"
    ]


def test_missing_v2_max_warns(fake: FakeSystem, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, LOGGER)
    folder = fake.mount_v2("/job")
    fake.remove(folder / "memory.max")
    assert read_memory(fake.root).source == "host"
    assert warnings_of(caplog) == [f"{folder}/memory.max is missing; skipping this cgroup level"]


def test_garbage_usage_keeps_the_limit_but_not_its_free_figure(
    fake: FakeSystem, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, LOGGER)
    fake.mount_v1("/job")
    fake.v1("/job", limit=6 * GB, usage="-1")
    figures = read_memory(fake.root)
    assert (figures.usable, figures.free) == (6 * GB, 6 * GB)  # MemAvailable, capped at usable
    (message,) = warnings_of(caplog)
    assert "memory.usage_in_bytes holds '-1', not a number" in message
    assert "free memory leaves out the 6.0 GB limit of this cgroup" in message


def test_stat_without_inactive_file_counts_cache_as_used(
    fake: FakeSystem, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, LOGGER)
    folder = fake.mount_v2("/job")
    fake.v2("/job", max=4 * GB, current=3 * GB, inactive_file=2 * GB)
    fake.write(str((folder / "memory.stat").relative_to(fake.base)), "anon 1\nfile: garbage\n")
    assert read_memory(fake.root).free == 1 * GB
    assert warnings_of(caplog) == [
        f"no inactive_file in {folder}/memory.stat; counting all page cache of this cgroup as used"
    ]


@pytest.mark.parametrize("content", [None, "MemTotal: lots\n", ""])
def test_bad_meminfo_falls_back_to_the_c_library(
    fake: FakeSystem, caplog: pytest.LogCaptureFixture, content: str | None
) -> None:
    caplog.set_level(logging.WARNING, LOGGER)
    if content is None:
        fake.remove("proc/meminfo")
    else:
        fake.write("proc/meminfo", content)
    figures = read_memory(fake.root)
    assert figures.host_total > 0
    assert 0 <= figures.free <= figures.usable == figures.host_total
    (message,) = warnings_of(caplog)
    why = "missing" if content is None else "garbled"
    assert message.startswith(f"cannot read MemTotal from {fake.root}/proc/meminfo ({why})")


@pytest.mark.parametrize("file", ["proc/self/mountinfo", "proc/self/cgroup"])
def test_missing_proc_files_fall_back_to_the_host(
    fake: FakeSystem, caplog: pytest.LogCaptureFixture, file: str
) -> None:
    caplog.set_level(logging.WARNING, LOGGER)
    fake.mount_v1("/job")
    fake.v1("/job", limit=1 * GB)
    fake.remove(file)
    assert read_memory(fake.root).source == "host"
    assert warnings_of(caplog) == [
        f"cannot read {fake.root}/{file}; memory cgroup limits are not known, using the host figure"
    ]


def test_garbage_proc_files_do_not_crash(fake: FakeSystem) -> None:
    fake.mount_v1("/job")
    fake.v1("/job", limit=1 * GB)
    fake.write("proc/self/mountinfo", "\x00\x01 nonsense - - \n\n 1 2 3\n")
    fake.write("proc/self/cgroup", "::::\nmemory\n")
    assert read_memory(fake.root).source == "host"


def test_missing_cgroup_folder_reads_from_the_nearest_ancestor(
    fake: FakeSystem, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, LOGGER)
    fake.mount_v1("/a")
    fake.v1("/a", limit=2 * GB)
    fake.write("proc/self/cgroup", "4:memory:/a/gone/job\n")
    assert read_memory(fake.root).usable == 2 * GB
    assert any("folder of memory cgroup /a/gone/job is missing" in m for m in warnings_of(caplog))


def test_a_warning_is_logged_once(fake: FakeSystem, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, LOGGER)
    fake.mount_v1("/job")
    fake.v1("/job", limit="garbage")
    read_memory(fake.root)
    read_memory(fake.root)
    levels = [r.levelno for r in caplog.records if "garbage" in r.getMessage()]
    assert levels == [logging.WARNING, logging.DEBUG]


# -- where tests/cgroups.py makes its cgroups -----------------------------------------------


def test_cgroup_helper_uses_the_own_v1_cgroup(fake: FakeSystem) -> None:
    folder = fake.mount_v1("/job")
    assert cgroups._parent(fake.root) == (folder, 1)


def test_cgroup_helper_climbs_to_a_v2_cgroup_that_hands_out_memory(fake: FakeSystem) -> None:
    fake.mount_v2("/a/b/job")
    fake.write("sys/fs/cgroup/a/b/job/cgroup.subtree_control", "\n")
    fake.write("sys/fs/cgroup/a/b/cgroup.subtree_control", "cpu pids\n")
    fake.write("sys/fs/cgroup/a/cgroup.subtree_control", "cpu memory pids\n")
    assert cgroups._parent(fake.root) == (fake.base / "sys/fs/cgroup/a", 2)


def test_cgroup_helper_explains_a_v2_tree_without_memory(fake: FakeSystem) -> None:
    fake.mount_v2("/job")
    reason = cgroups._parent(fake.root)
    assert reason == (
        f"cgroup v2: no cgroup from {fake.root}/sys/fs/cgroup/job up to {fake.root}/sys/fs/cgroup "
        f"lists memory in cgroup.subtree_control, so no child can get a memory limit"
    )


def test_cgroup_helper_without_a_memory_controller(fake: FakeSystem) -> None:
    assert cgroups._parent(fake.root) == "no memory cgroup controller is mounted on this machine"


# -- this machine ----------------------------------------------------------------------------


def test_this_machine_reads_consistently() -> None:
    figures = read_memory("/")
    assert figures.source in ("host", "cgroup v1", "cgroup v2")
    assert 0 < figures.usable <= figures.host_total
    assert 0 <= figures.free <= figures.usable


_REPORT = (
    "import json; from tierflow.system.limits import read_memory; "
    "f = read_memory('/'); "
    "print(json.dumps({'usable': f.usable, 'source': f.source, 'limited_by': f.limited_by}))"
)


def _skip_without_cgroups() -> None:
    reason = cgroups.skip_reason()
    if reason is not None:
        pytest.skip(reason)


@pytest.mark.cgroup
def test_a_process_in_a_512mb_cgroup_sees_the_limit() -> None:
    _skip_without_cgroups()
    with cgroups.memory_cgroup(512 * MB) as cg:
        done = cg.run([sys.executable, "-c", _REPORT], timeout=60, check=True)
        seen = json.loads(done.stdout)
    assert seen["usable"] <= 512 * MB
    assert seen["source"] == f"cgroup v{cg.version}"
    assert seen["limited_by"].endswith("/" + cg.name)
    assert not cg.path.exists()


@pytest.mark.cgroup
def test_a_process_over_the_limit_is_killed_by_the_kernel() -> None:
    _skip_without_cgroups()
    with cgroups.memory_cgroup(64 * MB) as cg:
        done = cg.run([sys.executable, "-c", "x = b'x' * (256 << 20)"], timeout=60)
        assert done.returncode == -9
        assert cg.oom_kills() >= 1
        peak = cg.peak_bytes()
        assert peak is None or peak <= 64 * MB
    assert not cg.path.exists()


@pytest.mark.cgroup
def test_leaving_the_cgroup_kills_what_is_left_and_removes_it() -> None:
    _skip_without_cgroups()
    with pytest.raises(RuntimeError, match="body failed"), cgroups.memory_cgroup(64 * MB) as cg:
        proc = subprocess.Popen(cg.wrap(["sleep", "60"]))
        for _ in range(200):  # until sh has moved itself in
            if cg.pids():
                break
            subprocess.run(["sleep", "0.01"], check=True)
        assert cg.pids() == [proc.pid]
        raise RuntimeError("body failed")
    assert proc.wait(timeout=10) == -9
    assert not cg.path.exists()


@pytest.mark.cgroup
def test_cgroups_get_unique_names() -> None:
    _skip_without_cgroups()
    with cgroups.memory_cgroup(64 * MB) as one, cgroups.memory_cgroup(64 * MB) as two:
        assert one.path != two.path
        assert one.path.name.startswith(cgroups.PREFIX)
        assert (one.limit_bytes, one.usage_bytes()) == (64 * MB, 0)
