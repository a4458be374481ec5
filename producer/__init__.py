"""The client ingestion services use: ``from producer import Producer``."""

from producer.client import JobProgress, JobTimeoutError, Producer, QueryTimeoutError
from shared.protocol import QueryFailedError

__all__ = [
    "JobProgress",
    "JobTimeoutError",
    "Producer",
    "QueryFailedError",
    "QueryTimeoutError",
]
