"""The CPU engines' telemetry, turned off before either engine can be imported.

Both engines the worker may load (workers/model/backends.py) report their use unless told not to:

- OpenVINO's ``openvino-telemetry`` (a dependency of the ``openvino`` package): importing
  ``openvino`` alone writes a client id and stats under ``~/intel`` and forks the process to send
  an event to Google Analytics (``www.google-analytics.com``), and each model conversion sends
  another. A fork of a threaded process can hang for ever, as one did here, holding the worker's
  port.
- ONNX Runtime (1.32, on Linux too): its native library, once loaded, writes a device id and an
  event queue (``onnxruntime.db``) under ``~/.cache/Microsoft/DeveloperTools`` for upload to
  Microsoft's collector, unless ``ORT_DISABLE_TELEMETRY`` is set when it loads.

A worker sends its users' texts and vectors nowhere but its own stores and listeners, from any
start path: :func:`without_telemetry` runs when ``embedfleet.workers`` is imported (before any
engine can be: the CLI, the demo and the tests all import the package first) and again in
:func:`~embedfleet.workers.model.backends.require`, the one place the worker imports an engine.
It imports neither engine itself.
"""

from __future__ import annotations

import importlib
import os
import sys

# ONNX Runtime's switch, read by its native library when it loads (an environment variable, so a
# process the worker starts inherits it too)
ORT_SWITCH = "ORT_DISABLE_TELEMETRY"

# OpenVINO's modules that bind the telemetry package (or, where it cannot be imported, their stub)
TELEMETRY_USERS = (
    "openvino.tools.ovc.convert_impl",
    "openvino.tools.ovc.main",
    "openvino.tools.ovc.telemetry_utils",
    "openvino.tools.ovc.utils",
)


def without_openvino_telemetry() -> None:
    """Hide ``openvino_telemetry`` from OpenVINO, which imports its own no-op stub where the
    package is missing; where it was imported already (another library imported OpenVINO first),
    rebind the stub in every OpenVINO module that holds the package."""
    if sys.modules.get("openvino_telemetry") is None:  # not imported yet, or hidden already
        # None in sys.modules is how an import is refused (it raises ImportError); typeshed's
        # dict[str, ModuleType] does not say so
        sys.modules["openvino_telemetry"] = None  # type: ignore[assignment]
        return
    stub = importlib.import_module("openvino.tools.ovc.telemetry_stub")
    for name in TELEMETRY_USERS:
        module = sys.modules.get(name)
        if module is not None and "tm" in vars(module):
            vars(module)["tm"] = stub


def without_onnxruntime_telemetry() -> None:
    """Set ONNX Runtime's off switch, whatever it was (a worker never sends telemetry: an
    operator's ``0`` is overridden, not honoured)."""
    os.environ[ORT_SWITCH] = "1"


def without_telemetry() -> None:
    """Every engine's telemetry off, in this process and the processes it starts; cheap and
    idempotent (nothing is imported but, where OpenVINO's converter was imported already, its
    stub)."""
    without_openvino_telemetry()
    without_onnxruntime_telemetry()
