"""The repository's own tools (issue 55: apart from the benchmarks in loadtest/): the package laid
out as the wheel lays it for mypy (import_root), the shape of the code in figures (shape), the
wheelhouse's requirements read from pyproject.toml (wheelhouse). Not installed; run from the
repository root as ``python -m tools.<name>``."""
