"""The client ingestion services use (``from embedfleet import Producer`` re-exports it)."""

from embedfleet.producer.client import (
    EmbeddingOptions,
    JobProgress,
    JobTimeoutError,
    Producer,
    QueryTimeoutError,
)
from embedfleet.shared.protocol import QueryFailedError
from embedfleet.shared.retry import RedisUnavailableError

__all__ = [
    "EmbeddingOptions",
    "JobProgress",
    "JobTimeoutError",
    "Producer",
    "QueryFailedError",
    "QueryTimeoutError",
    "RedisUnavailableError",
]
