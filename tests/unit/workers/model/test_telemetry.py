"""workers/model/telemetry.py: OpenVINO's telemetry package is kept from importing and ONNX
Runtime's switch is set off, whatever an operator set."""

from __future__ import annotations

import importlib
import os
import sys

import pytest

from embedfleet.workers.model.telemetry import ORT_SWITCH, without_telemetry


def test_every_engines_telemetry_is_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "openvino_telemetry", raising=False)
    monkeypatch.setenv(ORT_SWITCH, "0")
    without_telemetry()
    assert sys.modules["openvino_telemetry"] is None
    with pytest.raises(ImportError):
        importlib.import_module("openvino_telemetry")
    assert os.environ[ORT_SWITCH] == "1", "an operator's 0 is overridden"
    without_telemetry()  # idempotent
    assert sys.modules["openvino_telemetry"] is None
