"""The CPU limit of this process's cgroup (a container's ``--cpus``, a systemd unit's
CPUQuota), in cores, for the warning at service start when the BLAS runs more threads
than that.

OpenBLAS sizes its thread pool by the cores it may run on (the affinity mask), which a
CPU quota does not shrink: in a container limited to two CPUs on a 64-core host each
product is split 64 ways and the threads then wait out the quota's throttling.  The
limit is read from cgroup v2 (``cpu.max``: ``max 100000`` or ``QUOTA PERIOD``) or v1
(``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``, -1 for none), for the process's own cgroup
(``/proc/self/cgroup``) and each of its ancestors up to the mount, the smallest one
counting; where a container shows its own cgroup as the mount's root, that is read.
"""

from __future__ import annotations

import math
from pathlib import Path


def _v2_limit(directory: Path) -> float | None:
    try:
        quota, period = (directory / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return None
    if quota == "max":
        return None
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


def _v1_limit(directory: Path) -> float | None:
    try:
        q = int((directory / "cpu.cfs_quota_us").read_text().strip())
        p = int((directory / "cpu.cfs_period_us").read_text().strip())
    except (OSError, ValueError):
        return None
    return q / p if q > 0 and p > 0 else None


def _smallest_along(mount: Path, path: str, read) -> float | None:
    """The smallest limit ``read`` finds in the cgroup ``path`` under ``mount`` and its
    ancestors up to ``mount`` (only the mount itself when ``path`` is not there: a
    container's own cgroup shown as the root)."""
    start = mount / path.lstrip("/")
    here = start if start.is_dir() else mount
    limits = []
    while True:
        limit = read(here)
        if limit is not None:
            limits.append(limit)
        if here == mount or mount not in here.parents:
            break
        here = here.parent
    return min(limits, default=None)


def cpu_quota(proc_cgroup: Path = Path("/proc/self/cgroup"),
              root: Path = Path("/sys/fs/cgroup")) -> float | None:
    """This process's CPU limit in cores (1.5 for a quota of one and a half CPUs), or None
    when there is none or it cannot be read."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    limits = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":                       # cgroup v2 (unified)
            for mount in (root, root / "unified"):
                if (mount / "cgroup.controllers").exists():
                    limits.append(_smallest_along(mount, path, _v2_limit))
                    break
        elif "cpu" in controllers.split(","):       # cgroup v1, the cpu controller
            mount = root / controllers
            if not mount.is_dir():
                mount = root / "cpu"
            if mount.is_dir():
                limits.append(_smallest_along(mount, path, _v1_limit))
    return min((x for x in limits if x is not None), default=None)


def blas_threads_over_quota(threads: int | None, quota: float | None) -> str | None:
    """The warning to log when the BLAS runs more threads than the CPU quota gives cores
    (rounded up), else None."""
    if not threads or quota is None:
        return None
    cores = max(1, math.ceil(quota))
    if threads <= cores:
        return None
    return (f"the BLAS runs {threads} threads but this process's CPU quota is {quota:g} "
            f"cores: set OPENBLAS_NUM_THREADS={cores} (OpenBLAS counts the cores it may run "
            f"on, not the quota; its threads then wait out the throttling)")
