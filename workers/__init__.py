"""The embedding worker: consumer → batcher → encoder → sink → ack."""

# One module, one name: this folder is the package ``embedfleet.workers``. From a checkout the
# folder is also reachable as a top-level ``workers`` (a name other PyPI packages own); loading it
# so would load every module a second time under another name.
if __name__ != "embedfleet.workers":
    raise ImportError(
        f"import embedfleet.workers, not {__name__}: install the checkout "
        "(pip install -e .) or put an import root on PYTHONPATH (python loadtest/import_root.py)"
    )
