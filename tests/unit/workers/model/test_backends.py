"""EMBEDFLEET_CPU_BACKEND: the values the setting takes, the engines each builds, and the error
that names the extra to install where the engine asked for is missing (workers/model/backends.py).
"""

from __future__ import annotations

import importlib.util
from typing import get_args

import pytest
from pydantic import ValidationError

from embedfleet.shared.settings import Settings
from embedfleet.shared.settings.query_stage import CpuBackend
from embedfleet.workers.cpus import CpuClass, cpu_class
from embedfleet.workers.model import backends
from embedfleet.workers.model.backends import (
    ENGINES,
    MODULES,
    MissingBackend,
    require,
    wanted_engines,
)


def test_the_setting_takes_each_backend_and_defaults_to_the_class_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("EMBEDFLEET_CPU_BACKEND", raising=False)  # the suite pins torch
    assert Settings().cpu_backend == "default"
    assert Settings().openvino_precision == "default"
    for value in get_args(CpuBackend):
        monkeypatch.setenv("EMBEDFLEET_CPU_BACKEND", value)
        assert Settings().cpu_backend == value
    monkeypatch.setenv("EMBEDFLEET_CPU_BACKEND", "tensorrt")
    with pytest.raises(ValidationError, match="cpu_backend"):
        Settings()


def test_every_engine_names_the_modules_its_extra_installs() -> None:
    assert ENGINES == ("onnxruntime", "openvino")
    assert set(MODULES) == set(ENGINES)


def _without(monkeypatch: pytest.MonkeyPatch, *absent: str) -> None:
    """Make ``absent`` modules look uninstalled to the backends module."""
    real = importlib.util.find_spec

    def find_spec(name: str, *args: object) -> object:
        return None if name in absent else real(name)

    monkeypatch.setattr(backends.importlib.util, "find_spec", find_spec)


@pytest.mark.parametrize("engine", ENGINES)
def test_a_missing_extra_is_an_error_that_names_it(
    monkeypatch: pytest.MonkeyPatch, engine: str
) -> None:
    _without(monkeypatch, MODULES[engine][-1])
    with pytest.raises(MissingBackend) as raised:
        wanted_engines(engine, "bfloat16")  # type: ignore[arg-type]
    message = str(raised.value)
    assert f"EMBEDFLEET_CPU_BACKEND={engine}" in message
    assert f"pip install 'embedfleet[worker,{engine}]'" in message
    assert MODULES[engine][-1] in message  # what is missing
    with pytest.raises(MissingBackend):
        require(engine)


def test_auto_builds_the_installed_engines_and_torch_none(monkeypatch: pytest.MonkeyPatch) -> None:
    assert wanted_engines("torch", "bfloat16") == []
    _without(monkeypatch, "openvino")
    assert wanted_engines("auto", "bfloat16") == [
        e for e in ENGINES if e != "openvino" and backends.installed(e)
    ]
    _without(monkeypatch, *(module for modules in MODULES.values() for module in modules))
    assert wanted_engines("auto", "bfloat16") == []  # nothing installed: torch's path, no error
    assert wanted_engines("torch", "bfloat16") == []


AMX = CpuClass(frozenset({"avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_int8"}), "AVX512")
ZEN4 = CpuClass(frozenset({"avx2", "avx512f", "avx512_bf16", "avx512_vnni"}), "AVX512")
AVX2_ONLY = CpuClass(frozenset({"avx2", "fma"}), "AVX2")


def test_default_takes_openvino_where_bf16_is_native_and_torch_elsewhere(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(backends, "installed", lambda engine: True)
    assert wanted_engines("default", "bfloat16", AMX) == ["openvino"]
    assert wanted_engines("default", "bfloat16", ZEN4) == ["openvino"]
    # a model in float32 (EMBEDFLEET_DTYPE=float32): OpenVINO would compute in bf16 there
    assert wanted_engines("default", "float32", ZEN4) == []
    assert wanted_engines("default", "bfloat16", AVX2_ONLY) == []
    # an AVX-512 CPU capped to AVX2 (ATEN_CPU_CAPABILITY=avx2) is that class: no bf16 there
    assert wanted_engines("default", "bfloat16", cpu_class(ZEN4.flags, "AVX2")) == []
    monkeypatch.setattr(backends, "installed", lambda engine: engine != "openvino")
    # the extra not installed (a worker without it): torch's path, no error (unlike naming it)
    assert wanted_engines("default", "bfloat16", AMX) == []


def test_require_refuses_a_name_that_is_no_engine() -> None:
    with pytest.raises(ValueError, match="not a CPU backend"):
        require("torch")
