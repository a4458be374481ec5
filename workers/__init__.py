"""The embedding worker: consumer → batcher → encoder → sink → ack."""

# One module, one name: this folder is the package ``embedfleet.workers``. From a checkout the
# folder is also reachable as a top-level ``workers`` (a name other PyPI packages own); loading it
# so would load every module a second time under another name. The checkout itself on PYTHONPATH
# is enough: embedfleet/__init__.py maps this folder to its name.
if __name__ != "embedfleet.workers":
    raise ImportError(
        f"import embedfleet.workers, not {__name__}: install the checkout "
        "(pip install -e .) or put the checkout on PYTHONPATH"
    )

# No library the worker loads phones home, from any start path (`embedfleet worker`, `serve`, the
# demo, a test or a benchmark importing a module of this package): the CPU engines' telemetry is
# off before any of them can be imported, here, where every path into the worker's code begins.
# Importing OpenVINO alone sends an event to Google Analytics (workers/model/telemetry.py).
from embedfleet.workers.model.telemetry import without_telemetry

without_telemetry()
