"""How many CPUs this process may really use: the affinity mask and the cgroup CPU quota.

``os.cpu_count()`` reports the node's cores. In a Kubernetes pod with a 2-CPU limit on a
64-core node, torch would start 64 intra-op threads that the kernel then throttles to 2 CPUs'
worth of time: they fight, and a 9 ms query forward took ~500 ms under that contention. The
quota is what a container may use, so ``EMBEDFLEET_THREADS=0`` means the smaller of the two.

loky (joblib) has a similar ``cpu_count``, but it reads fixed paths, which a unit test cannot
point at fake cgroup files, and it would be a dependency for twenty lines.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def affinity_cpus() -> int:
    """CPUs in this process's affinity mask (taskset, cpusets), or the core count elsewhere."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def cgroup_cpu_limit(root: Path = CGROUP_ROOT) -> float | None:
    """The CPU quota of this cgroup in CPUs (``1.5`` = 150 ms per 100 ms), or None if unlimited.

    cgroup v2 writes ``"<quota> <period>"`` or ``"max <period>"`` to ``cpu.max``; cgroup v1
    splits it over ``cpu.cfs_quota_us`` (``-1`` = unlimited) and ``cpu.cfs_period_us``. Inside a
    container the cgroup namespace puts the pod's own cgroup at the root of ``/sys/fs/cgroup``.
    """
    v2 = root / "cpu.max"
    if v2.is_file():
        quota, _, period = v2.read_text().strip().partition(" ")
        if quota == "max":
            return None
        return _ratio(quota, period or "100000")
    for v1 in (root / "cpu", root / "cpu,cpuacct", root):
        quota_file, period_file = v1 / "cpu.cfs_quota_us", v1 / "cpu.cfs_period_us"
        if quota_file.is_file() and period_file.is_file():
            quota = quota_file.read_text().strip()
            if int(quota) < 0:
                return None
            return _ratio(quota, period_file.read_text().strip())
    return None


def _ratio(quota: str, period: str) -> float | None:
    quota_us, period_us = int(quota), int(period)
    if quota_us <= 0 or period_us <= 0:
        return None
    return quota_us / period_us


def usable_cpus(root: Path = CGROUP_ROOT) -> int:
    """Threads worth starting: the affinity mask, capped by the cgroup quota rounded up."""
    cpus = affinity_cpus()
    try:
        limit = cgroup_cpu_limit(root)
    except (OSError, ValueError):  # an unreadable or odd cgroup file: trust the affinity mask
        limit = None
    if limit is not None:
        cpus = min(cpus, max(1, math.ceil(limit)))
    return max(1, cpus)
