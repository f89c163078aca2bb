"""service.cpu_limit: the CPU quota of the process's cgroup (v2 cpu.max, v1
cpu.cfs_quota_us / cpu.cfs_period_us; the smallest along the path to the mount; a
container's own cgroup shown as the mount's root), and the warning at service start
when the BLAS runs more threads than the quota gives cores."""

from __future__ import annotations

import logging

import pytest

from service import cpu_limit
from service.cpu_limit import blas_threads_over_quota, cpu_quota
from tests.service.conftest import make_client


def _tree(tmp_path, proc: str, files: dict[str, str]):
    (tmp_path / "proc").write_text(proc)
    root = tmp_path / "cg"
    for rel, text in files.items():
        f = root / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)
    root.mkdir(exist_ok=True)
    return tmp_path / "proc", root


@pytest.mark.parametrize("cpu_max, expect", [("max 100000\n", None), ("150000 100000\n", 1.5),
                                             ("200000 100000\n", 2.0), ("garbage\n", None)])
def test_cgroup_v2_own_cgroup(tmp_path, cpu_max, expect):
    proc, root = _tree(tmp_path, "0::/app.slice/nnetc.service\n",
                       {"cgroup.controllers": "cpu memory\n",
                        "app.slice/nnetc.service/cpu.max": cpu_max})
    assert cpu_quota(proc, root) == expect


def test_cgroup_v2_smallest_along_the_path(tmp_path):
    proc, root = _tree(tmp_path, "0::/a/b\n",
                       {"cgroup.controllers": "cpu\n", "a/cpu.max": "100000 100000\n",
                        "a/b/cpu.max": "400000 100000\n"})
    assert cpu_quota(proc, root) == 1.0


def test_cgroup_v2_container_sees_its_cgroup_as_the_root(tmp_path):
    """In a container /proc/self/cgroup names the host's path, which its own
    /sys/fs/cgroup does not have: the mount's root is the container's cgroup."""
    proc, root = _tree(tmp_path, "0::/docker/abc123\n",
                       {"cgroup.controllers": "cpu\n", "cpu.max": "200000 100000\n"})
    assert cpu_quota(proc, root) == 2.0


@pytest.mark.parametrize("quota, expect", [("-1", None), ("50000", 0.5), ("300000", 3.0)])
def test_cgroup_v1(tmp_path, quota, expect):
    proc, root = _tree(tmp_path, "4:memory:/x\n2:cpu,cpuacct:/docker/abc\n0::/\n",
                       {"cpu,cpuacct/cpu.cfs_quota_us": f"{quota}\n",
                        "cpu,cpuacct/cpu.cfs_period_us": "100000\n"})
    assert cpu_quota(proc, root) == expect


def test_no_cgroup_information(tmp_path):
    assert cpu_quota(tmp_path / "missing", tmp_path) is None
    proc, root = _tree(tmp_path, "1:cpu:/\n0::/\n", {})
    assert cpu_quota(proc, root) is None


def test_this_machine_reads_without_error():
    q = cpu_quota()
    assert q is None or q > 0


@pytest.mark.parametrize("threads, quota, cores", [(64, 2.0, 2), (4, 1.5, 2), (3, 0.5, 1)])
def test_warning_when_the_blas_runs_more_threads_than_the_quota(threads, quota, cores):
    msg = blas_threads_over_quota(threads, quota)
    assert f"runs {threads} threads" in msg and f"OPENBLAS_NUM_THREADS={cores}" in msg


@pytest.mark.parametrize("threads, quota", [(2, 2.0), (2, 1.5), (None, 1.0), (8, None)])
def test_no_warning_within_the_quota(threads, quota):
    assert blas_threads_over_quota(threads, quota) is None


def test_service_start_warns(monkeypatch):
    """The service's own log (JSON lines, not propagated to the root logger) gets the
    warning when it starts with more BLAS threads than the quota gives cores."""
    monkeypatch.setattr(cpu_limit, "cpu_quota", lambda: 1.0)
    from engine.runtime import blas  # noqa: PLC0415
    monkeypatch.setattr(blas, "blas_libraries",
                        lambda: [{"library": "openblas", "threads": 8, "architecture": "X",
                                  "version": "0"}])
    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())
    make_client(log_level="WARNING")          # (configures the service's logger)
    seen.clear()
    handler = Keep()
    logging.getLogger("nnetc").addHandler(handler)
    try:
        make_client(log_level="WARNING")
    finally:
        logging.getLogger("nnetc").removeHandler(handler)
    assert any("runs 8 threads" in m and "OPENBLAS_NUM_THREADS=1" in m for m in seen)
