"""embedfleet: a Redis-Streams worker fleet for bulk text embedding.

``from embedfleet import Producer`` is the client. The design card's folders install under this
one import root: ``embedfleet.shared`` (settings, protocol, keys), ``embedfleet.producer`` (the
client) and ``embedfleet.workers`` (the worker, with ``pip install 'embedfleet[worker]'``); the
operator's verbs are ``embedfleet.ops``.
"""

from __future__ import annotations

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
