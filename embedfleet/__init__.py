"""embedfleet: a Redis-Streams worker fleet for bulk text embedding.

``from embedfleet import Producer`` is the client. The design card's folders install under this
one import root: ``embedfleet.shared`` (settings, protocol, keys), ``embedfleet.producer`` (the
client) and ``embedfleet.workers`` (the worker, with ``pip install 'embedfleet[worker]'``); the
operator's verbs are ``embedfleet.ops``.

Each file has one path: the three folders sit at the repository's top level only. A wheel or an
editable install maps them (pyproject.toml's ``[tool.setuptools.package-dir]``); a checkout used
without installing it (``PYTHONPATH=<checkout>``, as on the device machine) gets the same names
from the small finder below, which reads the same table and maps those names and no other.
"""

from __future__ import annotations

import os
import sys
from importlib.machinery import ModuleSpec
from importlib.util import spec_from_file_location
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from embedfleet.producer.client import (
        EmbeddingOptions,
        JobTimeoutError,
        Producer,
        QueryTimeoutError,
    )
    from embedfleet.shared.jobs import JobProgress
    from embedfleet.shared.protocol import Chunk, QueryFailedError, Result
    from embedfleet.shared.retry import RedisUnavailableError
    from embedfleet.shared.settings import Settings


class CheckoutFinder:
    """Finds ``embedfleet.shared``/``.producer``/``.workers`` in a checkout's top-level folders.

    A meta-path finder (``importlib.abc.MetaPathFinder``'s protocol) for the names pyproject.toml's
    package-dir maps and no other, so ``embedfleet.loadtest`` or ``embedfleet.tests`` stay
    unimportable; the modules below those packages are found through their ``__path__``.
    """

    def __init__(self, folders: dict[str, str]) -> None:
        self.folders = folders

    def find_spec(
        self, fullname: str, path: object = None, target: object = None
    ) -> ModuleSpec | None:
        folder = self.folders.get(fullname)
        if folder is None:
            return None
        return spec_from_file_location(
            fullname, os.path.join(folder, "__init__.py"), submodule_search_locations=[folder]
        )


def _checkout_folders() -> dict[str, str]:
    """The folders to map: pyproject.toml's package-dir when this package sits in a checkout
    (pyproject.toml beside it, the folders not inside it), none when installed (a wheel puts the
    folders inside ``embedfleet/``, and setuptools' editable finder maps them itself)."""
    package = os.path.dirname(os.path.abspath(__file__))
    root = os.path.dirname(package)
    pyproject = os.path.join(root, "pyproject.toml")
    if not os.path.isfile(pyproject):
        return {}
    import tomllib  # only here: an installed package never reads it

    with open(pyproject, "rb") as file:
        package_dir = (
            tomllib.load(file).get("tool", {}).get("setuptools", {}).get("package-dir", {})
        )
    return {
        name: os.path.join(root, folder)
        for name, folder in package_dir.items()
        if name.startswith(f"{__name__}.")
        and not os.path.isdir(os.path.join(package, *name.split(".")[1:]))
        and os.path.isdir(os.path.join(root, folder))
    }


# First on the meta path, so the names resolve the same way whatever else is installed; once only
# (compared by class name: a reloaded module defines the class anew).
if (_folders := _checkout_folders()) and not any(
    type(finder).__name__ == CheckoutFinder.__name__ for finder in sys.meta_path
):
    sys.meta_path.insert(0, CheckoutFinder(_folders))

# The client's names, imported on first use so `import embedfleet.workers...` stays cheap.
_EXPORTS = {
    "Producer": "embedfleet.producer.client",
    "EmbeddingOptions": "embedfleet.producer.client",
    "JobProgress": "embedfleet.shared.jobs",
    "JobTimeoutError": "embedfleet.producer.client",
    "QueryTimeoutError": "embedfleet.producer.client",
    "QueryFailedError": "embedfleet.shared.protocol",
    "RedisUnavailableError": "embedfleet.shared.retry",
    "Chunk": "embedfleet.shared.protocol",
    "Result": "embedfleet.shared.protocol",
    "Settings": "embedfleet.shared.settings",
}

__all__ = [
    "Chunk",
    "EmbeddingOptions",
    "JobProgress",
    "JobTimeoutError",
    "Producer",
    "QueryFailedError",
    "QueryTimeoutError",
    "RedisUnavailableError",
    "Result",
    "Settings",
]


def __getattr__(name: str) -> Any:
    module_name = _EXPORTS.get(name)
    if module_name is None:
        raise AttributeError(f"module 'embedfleet' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module_name), name)
