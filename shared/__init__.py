"""Pieces every side of embedfleet agrees on: settings, wire protocol, Redis key names, logging.

This package imports nothing else of the project, so producers in other services can depend on it
alone.
"""

# One module, one name: this folder is the package ``embedfleet.shared``. From a checkout the
# folder is also reachable as a top-level ``shared`` (a name other PyPI packages own); loading it
# so would load every module a second time under another name. The checkout itself on PYTHONPATH
# is enough: embedfleet/__init__.py maps this folder to its name.
if __name__ != "embedfleet.shared":
    raise ImportError(
        f"import embedfleet.shared, not {__name__}: install the checkout "
        "(pip install -e .) or put the checkout on PYTHONPATH"
    )
