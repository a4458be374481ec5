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

    from embedfleet.workers.encoder import configure_tokenizer_threads

    if preset is None:
        monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    else:
        monkeypatch.setenv("TOKENIZERS_PARALLELISM", preset)
    assert configure_tokenizer_threads(torch.device(device)) is parallel
    assert os.environ["TOKENIZERS_PARALLELISM"] == (preset or str(parallel).lower())
