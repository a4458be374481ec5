"""EMBEDFLEET_REPLICAS: `auto` sized from the device and the host's usable cores, an integer
as given (workers/replicas.py). Pure logic: the processes are tests/end_to_end/test_replicas.py."""

from __future__ import annotations

import pytest

from embedfleet.shared.settings import Settings, SettingsError, load_settings
from embedfleet.workers import replicas as replicas_module
from embedfleet.workers.replicas import (
    CORES_PER_GPU_REPLICA,
    MAX_AUTO_REPLICAS,
    replicas_for,
    resolve_replicas,
)


def test_auto_is_the_default() -> None:
    assert Settings().replicas == "auto"


@pytest.mark.parametrize("cpus", [1, 2, 16, 96])
def test_auto_on_a_cpu_is_one(cpus: int) -> None:
    assert replicas_for("auto", on_cuda=False, cpus=cpus) == 1


def test_auto_on_cuda_is_one_per_one_and_a_half_cores() -> None:
    # stop 50's host: 16 cores, one process's host step 1.21 cores -> 10 replicas
    assert CORES_PER_GPU_REPLICA == 1.5
    assert replicas_for("auto", on_cuda=True, cpus=16) == 10
    assert replicas_for("auto", on_cuda=True, cpus=8) == 5
    assert replicas_for("auto", on_cuda=True, cpus=3) == 2


@pytest.mark.parametrize(("cpus", "expected"), [(1, 1), (2, 1), (24, 16), (128, MAX_AUTO_REPLICAS)])
def test_auto_on_cuda_stays_within_its_bounds(cpus: int, expected: int) -> None:
    assert replicas_for("auto", on_cuda=True, cpus=cpus) == expected
    assert MAX_AUTO_REPLICAS <= 64, "never past the setting's own bound"


@pytest.mark.parametrize("on_cuda", [False, True])
@pytest.mark.parametrize("count", [1, 3, 64])
def test_an_explicit_count_is_used_as_given(count: int, on_cuda: bool) -> None:
    assert replicas_for(count, on_cuda=on_cuda, cpus=16) == count


def test_resolve_reads_the_device_and_the_usable_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(replicas_module, "usable_cpus", lambda: 16)
    assert resolve_replicas(Settings(device="cuda")) == 10
    assert resolve_replicas(Settings(device="cpu")) == 1
    assert resolve_replicas(Settings(device="cuda", replicas=2)) == 2
    # device auto asks torch whether it sees a GPU (stubbed: no torch import in a unit test)
    monkeypatch.setattr(replicas_module, "_cuda_available", lambda: True)
    assert resolve_replicas(Settings(device="auto")) == 10
    monkeypatch.setattr(replicas_module, "_cuda_available", lambda: False)
    assert resolve_replicas(Settings(device="auto")) == 1


def test_an_explicit_count_never_asks_for_the_device(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_torch() -> bool:
        raise AssertionError("an explicit count needs no CUDA check")

    monkeypatch.setattr(replicas_module, "_cuda_available", no_torch)
    assert resolve_replicas(Settings(device="auto", replicas=4)) == 4


@pytest.mark.parametrize(("given", "expected"), [("auto", "auto"), ("AUTO", "auto"), ("4", 4)])
def test_the_variable_reads_auto_or_a_count(
    monkeypatch: pytest.MonkeyPatch, given: str, expected: object
) -> None:
    monkeypatch.setenv("EMBEDFLEET_REPLICAS", given)
    assert load_settings().replicas == expected


@pytest.mark.parametrize("given", ["0", "65", "many", "1.5", "-2"])
def test_a_bad_count_is_refused_in_one_message(monkeypatch: pytest.MonkeyPatch, given: str) -> None:
    monkeypatch.setenv("EMBEDFLEET_REPLICAS", given)
    with pytest.raises(SettingsError) as refused:
        load_settings()
    message = str(refused.value)
    assert "EMBEDFLEET_REPLICAS: " in message and "auto or a whole number" in message
    assert message.count("EMBEDFLEET_REPLICAS") == 1
