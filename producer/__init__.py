"""The client ingestion services use: ``from producer import Producer``."""

from producer.client import JobProgress, Producer

__all__ = ["JobProgress", "Producer"]
