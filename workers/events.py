"""What a worker reports as it runs; metrics, tests and the benchmark listen in.

The worker calls these hooks; it does not know who listens (taskiq's middleware shape). The
default does nothing, so the hot path pays for a method call and no more.
"""

from __future__ import annotations


class WorkerEvents:
    """Subclass and override what you need; every hook is called on the event loop."""

    def batch_encoded(
        self, *, texts: int, real_tokens: int, padded_tokens: int, seconds: float
    ) -> None:
        """One micro-batch went through the model in ``seconds``."""

    def results_written(self, *, texts: int, seconds: float) -> None:
        """A batch of results was written to the sink and its entries acknowledged."""

    def query_answered(self, *, latency_seconds: float) -> None:
        """A priority query was answered; latency from enqueue (entry id time) to reply."""

    def dead_lettered(self, *, count: int, reason: str) -> None:
        """Entries went to the dead-letter stream."""

    def reclaimed(self, *, count: int) -> None:
        """Entries of a dead or stuck consumer were claimed by this worker."""

    def sink_error(self, *, error: BaseException) -> None:
        """A sink write failed (it will be retried, then dead-lettered)."""

    def model_busy(self, *, fraction: float) -> None:
        """Share of wall time the model spent computing, since the worker started."""
