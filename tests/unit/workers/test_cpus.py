"""EMBEDFLEET_THREADS=0: the CPUs a container may use, read from fake cgroup files."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from embedfleet.workers import cpus
from embedfleet.workers.cpus import cgroup_cpu_limit, usable_cpus


def _write(root: Path, name: str, text: str) -> None:
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


@pytest.mark.parametrize(
    ("cpu_max", "limit"),
    [("200000 100000", 2.0), ("150000 100000", 1.5), ("50000 100000", 0.5), ("max 100000", None)],
)
def test_cgroup_v2_quota(tmp_path: Path, cpu_max: str, limit: float | None) -> None:
    _write(tmp_path, "cpu.max", cpu_max)
    assert cgroup_cpu_limit(tmp_path) == limit


@pytest.mark.parametrize("directory", ["cpu", "cpu,cpuacct"])
def test_cgroup_v1_quota(tmp_path: Path, directory: str) -> None:
    _write(tmp_path, f"{directory}/cpu.cfs_quota_us", "300000")
    _write(tmp_path, f"{directory}/cpu.cfs_period_us", "100000")
    assert cgroup_cpu_limit(tmp_path) == 3.0


def test_cgroup_v1_unlimited(tmp_path: Path) -> None:
    _write(tmp_path, "cpu/cpu.cfs_quota_us", "-1")
    _write(tmp_path, "cpu/cpu.cfs_period_us", "100000")
    assert cgroup_cpu_limit(tmp_path) is None


def test_no_cgroup_files_means_no_limit(tmp_path: Path) -> None:
    assert cgroup_cpu_limit(tmp_path) is None


@pytest.mark.parametrize(
    ("affinity", "cpu_max", "expected"),
    [
        (64, "200000 100000", 2),  # a 2-CPU pod limit on a 64-core node
        (64, "150000 100000", 2),  # 1.5 CPUs: two threads, each busy part of the time
        (64, "50000 100000", 1),  # under one CPU still runs one thread
        (4, "800000 100000", 4),  # the affinity mask is the smaller
        (8, "max 100000", 8),  # no quota
        (8, "garbage", 8),  # an odd file is ignored, not fatal
    ],
)
def test_usable_cpus_is_the_smaller_of_mask_and_quota(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, affinity: int, cpu_max: str, expected: int
) -> None:
    monkeypatch.setattr(cpus, "affinity_cpus", lambda: affinity)
    _write(tmp_path, "cpu.max", cpu_max)
    assert usable_cpus(tmp_path) == expected


def test_usable_cpus_on_this_machine_is_within_the_affinity_mask() -> None:
    import os

    assert 1 <= usable_cpus() <= len(os.sched_getaffinity(0))


@pytest.mark.parametrize(
    ("device", "preset", "parallel"),
    [("cpu", None, False), ("cuda", None, True), ("cuda", "false", False), ("cpu", "true", True)],
)
def test_tokenizer_threads_follow_the_device_unless_set(
    monkeypatch: pytest.MonkeyPatch, device: str, preset: str | None, parallel: bool
) -> None:
    """On a CPU the model's threads own the cores; on CUDA the tokenizer gets them all; an
    operator's TOKENIZERS_PARALLELISM wins either way."""
    import torch

    from embedfleet.workers.model.tokenizer import configure_tokenizer_threads

    if preset is None:
        monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    else:
        monkeypatch.setenv("TOKENIZERS_PARALLELISM", preset)
    assert configure_tokenizer_threads(torch.device(device)) is parallel
    assert os.environ["TOKENIZERS_PARALLELISM"] == (preset or str(parallel).lower())


# --- the CPU class ---------------------------------------------------------------------------

ZEN5 = frozenset({"avx", "avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "avx_vnni"})
ZEN3 = frozenset({"avx", "avx2", "fma"})  # AMD EPYC family 25 model 1: the machine
SAPPHIRE_RAPIDS = frozenset({"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_int8"})


@pytest.mark.parametrize(
    ("flags", "capability", "fast_bf16", "int8_dot"),
    [
        (ZEN5, "AVX512", True, "vnni"),
        (ZEN3, "AVX2", False, "avx2"),
        (SAPPHIRE_RAPIDS, "AMX", True, "amx"),
        # ATEN_CPU_CAPABILITY=avx2 on Zen 5: torch dispatches AVX2 kernels, bf16 is emulated
        (ZEN5, "AVX2", False, "vnni"),
        (frozenset(), "DEFAULT", False, "none"),
    ],
)
def test_cpu_class_caps_the_flags_at_torchs_dispatch_level(
    flags: frozenset[str], capability: str, fast_bf16: bool, int8_dot: str
) -> None:
    found = cpus.cpu_class(flags, capability)
    assert found.fast_bf16 is fast_bf16
    assert found.int8_dot == int8_dot
    if capability not in ("AVX512", "AMX"):  # what torch will not dispatch to is not claimed
        assert not found.avx512 and not any(f.startswith("avx512") for f in found.flags)


def test_onednn_isa_cap_hides_avx_vnni(monkeypatch: pytest.MonkeyPatch) -> None:
    """ONEDNN_MAX_CPU_ISA=AVX2 (the emulation of an AVX2-only CPU) leaves out AVX-VNNI too."""
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    assert cpus.cpu_class(ZEN5, "AVX2").int8_dot == "avx2"


def test_cpu_flags_reads_the_first_flags_line(tmp_path: Path) -> None:
    _write(tmp_path, "cpuinfo", "processor\t: 0\nflags\t\t: fpu avx2 fma\nflags\t: other")
    assert cpus.cpu_flags(tmp_path / "cpuinfo") == {"fpu", "avx2", "fma"}
    assert cpus.cpu_flags(tmp_path / "missing") == frozenset()


def test_cpu_paths_per_class() -> None:
    """Every class gets float32 and an int8 path; bf16 only where it is native."""
    from embedfleet.workers.model.choose import cpu_paths

    assert cpu_paths(cpus.cpu_class(ZEN3, "AVX2"), compiler=False) == ["float32", "int8-dynamic"]
    # W8A8's int8 matmul has no fast kernel without VNNI/AMX: not tried there, compiler or not
    assert cpu_paths(cpus.cpu_class(ZEN3, "AVX2"), compiler=True) == ["float32", "int8-dynamic"]
    assert cpu_paths(cpus.cpu_class(ZEN5, "AVX512"), compiler=True) == [
        "float32",
        "bfloat16",
        "int8-dynamic",
        "int8-w8a8",
    ]


def test_the_linear_kernel_benchmark_times_every_shape_through_each_kernel(tmp_path: Path) -> None:
    """loadtest.linear_kernels (docs/BENCHMARKS.md, stop 38) runs as documented: every layer
    shape through aten's linear and each other kernel this torch has, and the kernels compute
    the same product (a kernel timed on a wrong result would prove nothing)."""
    import json
    import subprocess
    import sys

    import torch

    from loadtest.linear_kernels import SHAPES, kernels

    out = tmp_path / "kernels.json"
    command = ["loadtest.linear_kernels", "--tokens", "32", "--repeats", "1", "--json", str(out)]
    subprocess.run(
        [sys.executable, "-m", *command],
        check=True,
        capture_output=True,
        timeout=120,
    )
    rows = json.loads(out.read_text())
    assert {tuple(row["shape"]) for row in rows} == set(SHAPES)
    assert {"aten linear"} <= {row["kernel"] for row in rows}
    assert all(row["ms"] > 0 for row in rows)
    x, weight, bias = torch.randn(16, 384), torch.randn(1536, 384), torch.randn(1536)
    with torch.inference_mode():
        found = {name: call() for name, call in kernels(x, weight, bias).items()}
    for name, product in found.items():
        torch.testing.assert_close(product, found["aten linear"], rtol=1e-4, atol=1e-3, msg=name)
