"""How many CPUs this process may really use: the affinity mask and the cgroup CPU quota.

``os.cpu_count()`` reports the node's cores. In a Kubernetes pod with a 2-CPU limit on a
64-core node, torch would start 64 intra-op threads that the kernel then throttles to 2 CPUs'
worth of time: they fight, and a 9 ms query forward took ~500 ms under that contention. The
quota is what a container may use, so ``EMBEDFLEET_THREADS=0`` means the smaller of the two.

:func:`cpu_class` says which fast kernels those CPUs have (bf16, int8 dot products), as torch
will use them: the forward paths a worker tries at start follow from it (workers/model/encoder.py).

loky (joblib) has a similar ``cpu_count``, but it reads fixed paths, which a unit test cannot
point at fake cgroup files, and it would be a dependency for twenty lines.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
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


# --- the CPU class: which fast kernels this process can use ---------------------------------

# ATen's dispatch levels that include AVX-512 (torch.backends.cpu.get_cpu_capability()).
_AVX512_CAPABILITIES = frozenset({"AVX512", "AVX512_BF16", "AVX512_VNNI", "AVX512_FP16", "AMX"})
# Flags torch's kernels use only at its AVX-512 level: capped off below it (ATEN_CPU_CAPABILITY)
_AVX512_ONLY_PREFIXES = ("avx512", "amx")
# ONEDNN_MAX_CPU_ISA values that leave out AVX-VNNI (a 256-bit extension an AVX2-only CPU lacks)
_ONEDNN_BELOW_AVX_VNNI = frozenset({"SSE41", "AVX", "AVX2"})


@dataclass(frozen=True)
class CpuClass:
    """What this process's CPU runs fast: the flags of ``/proc/cpuinfo``, capped at the ISA torch
    dispatches to (``ATEN_CPU_CAPABILITY=avx2`` on an AVX-512 CPU makes torch, and this class,
    see an AVX2-only CPU: how the tests emulate one; ``ONEDNN_MAX_CPU_ISA=AVX2`` caps oneDNN's
    kernels the same way)."""

    flags: frozenset[str]
    capability: str  # torch's dispatch level: "AVX512", "AVX2", "DEFAULT", ...

    @property
    def avx512(self) -> bool:
        return self.capability in _AVX512_CAPABILITIES

    @property
    def fast_bf16(self) -> bool:
        """bf16 matmuls run natively (AVX512-BF16 or AMX); elsewhere bf16 is emulated, slower
        than float32."""
        return bool({"avx512_bf16", "amx_bf16"} & self.flags)

    @property
    def fast_fp16(self) -> bool:
        """fp16 matmuls run natively (AVX512-FP16 or AMX-FP16)."""
        return bool({"avx512_fp16", "amx_fp16"} & self.flags)

    def runs_natively(self, dtype_name: str) -> bool:
        """Whether matmuls in ``dtype_name`` ("float32", "bfloat16", "float16") are native."""
        if dtype_name == "bfloat16":
            return self.fast_bf16
        if dtype_name == "float16":
            return self.fast_fp16
        return True

    @property
    def int8_dot(self) -> str:
        """The int8 dot-product instructions: ``amx``, ``vnni`` (AVX512-VNNI or AVX-VNNI) or
        ``avx2`` (vpmaddubsw: FBGEMM's and oneDNN's AVX2 int8 kernels)."""
        if "amx_int8" in self.flags:
            return "amx"
        if {"avx512_vnni", "avx_vnni"} & self.flags:
            return "vnni"
        return "avx2" if "avx2" in self.flags else "none"

    def describe(self) -> str:
        bf16 = "fast bf16" if self.fast_bf16 else "no fast bf16"
        return f"{self.capability} ({bf16}, int8 dot: {self.int8_dot})"


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The first ``flags`` line of ``/proc/cpuinfo`` (empty where there is none)."""
    try:
        with cpuinfo.open() as lines:
            for line in lines:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def cpu_class(flags: frozenset[str] | None = None, capability: str | None = None) -> CpuClass:
    """This CPU's class as torch will use it (arguments: for tests)."""
    if capability is None:
        import torch

        capability = str(torch.backends.cpu.get_cpu_capability())
    found = cpu_flags() if flags is None else flags
    if capability not in _AVX512_CAPABILITIES:
        found = frozenset(f for f in found if not f.startswith(_AVX512_ONLY_PREFIXES))
    if os.environ.get("ONEDNN_MAX_CPU_ISA", "").upper() in _ONEDNN_BELOW_AVX_VNNI:
        found = found - {"avx_vnni"}  # oneDNN's AVX2_VNNI level is above the cap
    return CpuClass(flags=found, capability=capability)
