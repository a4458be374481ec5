"""What a worker reports as it runs; metrics, tests and the benchmark listen in.

The worker calls these hooks; it does not know who listens (taskiq's middleware shape). The
default does nothing, so the hot path pays for a method call and no more. ``StatsEvents`` keeps
a run's counters (``WorkerStats``) on the way and passes every event on to the listener.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypedDict, Unpack

from embedfleet.shared.vector_cache import CacheCounts

# The stages of an answered query's time, in order (query_stages; the metric's ``stage`` label)
QUERY_STAGES = ("read", "tokenize", "wait", "forward", "reply")


class BulkSlice(TypedDict):
    """What :meth:`WorkerEvents.bulk_slice` is told, as keywords."""

    path: str  # a workers.cost_model.BulkPath
    seconds: float
    predicted_seconds: float  # 0 before anything was measured
    target_seconds: float  # EMBEDFLEET_SLICE_MS
    texts: int
    longest: int  # the batch's longest text, in tokens


class WorkerEvents:
    """Subclass and override what you need; every hook is called on the event loop."""

    def forward_path_chosen(self, *, path: str) -> None:
        """The encoder settled the path bulk batches and queries run through (an int8 copy, the
        frozen graph, eager), once at start; e.g. "int8-w8a8 (float32 around it)"."""

    def entries_read(self, *, stream: str, count: int) -> None:
        """``count`` entries of ``stream`` were read (new or reclaimed) and are now held."""

    def batch_started(self, *, texts: int, padded_tokens: int) -> None:
        """A bulk micro-batch was handed to the model thread; ``batch_encoded`` follows."""

    def bulk_slice(self, **slice_: Unpack[BulkSlice]) -> None:
        """A bulk micro-batch's longest slice, the stretch a query could not get into: one
        transformer layer (eager, varlen) or the whole batch (the frozen and int8 copies,
        ``path``: a workers.cost_model.BulkPath), against the cost model's prediction for it
        (0 before anything was measured) and the slice target (EMBEDFLEET_SLICE_MS) the batch
        was sized to. Only where queries wait on bulk work (not on the CUDA query path)."""

    def leases_renewed(self, *, count: int) -> None:
        """The reclaimer renewed this worker's lease on ``count`` entries it still holds."""

    def batch_encoded(
        self, *, texts: int, real_tokens: int, padded_tokens: int, seconds: float
    ) -> None:
        """One micro-batch went through the model in ``seconds``."""

    def results_written(self, *, texts: int, seconds: float) -> None:
        """A batch of results was written to the sink and its entries acknowledged."""

    def query_answered(self, *, latency_seconds: float) -> None:
        """A priority query was answered; latency from enqueue (entry id time) to reply.
        Called on the model thread (between transformer layers when a bulk batch is running),
        or on CUDA on the CUDA query thread."""

    def query_stages(
        self, *, read: float, tokenize: float, wait: float, forward: float, reply: float
    ) -> None:
        """Where one answered query's time went, in seconds (same thread as
        ``query_answered``): ``read`` from enqueue (the entry id's time) until the event loop had
        it, ``tokenize`` decoding and tokenizing it there, ``wait`` in the inbox until the model
        thread took it (the rest of a bulk slice), ``forward`` its batch's forward pass,
        ``reply`` writing the answer. What a query under bulk load waits beyond the slice it
        landed in shows up here, stage by stage."""

    def queries_served(self, *, count: int, path: str) -> None:
        """``count`` queries went through the model in one batch, by ``path`` (a
        workers.model.cuda_queries.QueryPath: graph, stream, frozen or eager). Same thread as
        ``query_answered``."""

    def dead_lettered(self, *, count: int, reason: str) -> None:
        """Entries went to the dead-letter stream; ``reason`` is a DeadReason value."""

    def vector_cache_checked(self, *, hits: int, misses: int, tokens_saved: int) -> None:
        """A window's chunks were looked up in the vector cache (shared/vector_cache.py):
        ``hits`` are written from stored vectors without the model (their ``tokens_saved`` not
        computed), ``misses`` go on to the model (a chunk sent with ``reembed`` counts here)."""

    def reclaimed(self, *, count: int) -> None:
        """Entries of a dead or stuck consumer were claimed by this worker."""

    def sink_error(self, *, error: BaseException, kind: str) -> None:
        """A sink write failed; ``kind`` is its FaultKind (shared/fault_kinds.py) and says what
        happens next: waited out, the row isolated and dead-lettered, or the worker exits."""

    def transient_fault(self, *, system: str, doing: str) -> None:
        """``system`` (a shared.fault_kinds.System value) failed in a passing way while ``doing``;
        the worker waits (capped backoff) and tries again."""

    def outage(self, *, system: str, active: bool) -> None:
        """The worker started (``active``) or stopped waiting for ``system``."""

    def row_isolated(self, *, rows: int) -> None:
        """A sink write refused a row: the batch of ``rows`` is being split to find it."""

    def model_busy(self, *, fraction: float) -> None:
        """Share of wall time the model spent computing, since the worker started."""


class ForwardingEvents(WorkerEvents):
    """Passes every hook on to ``listener``. To watch some of them on the way, subclass,
    override those hooks and call ``super()`` in them to pass them on."""

    def __init__(self, listener: WorkerEvents) -> None:
        self.listener = listener


def _forwarding(hook: str) -> Callable[..., None]:
    def forward(self: ForwardingEvents, **arguments: Any) -> None:
        getattr(self.listener, hook)(**arguments)

    forward.__name__ = hook
    forward.__qualname__ = f"{ForwardingEvents.__name__}.{hook}"
    forward.__doc__ = getattr(WorkerEvents, hook).__doc__
    return forward


# Made from WorkerEvents' own list rather than written out, so that a hook added there is
# forwarded too instead of silently stopping here. Every hook takes keyword arguments only.
for _hook in [name for name in vars(WorkerEvents) if not name.startswith("_")]:
    setattr(ForwardingEvents, _hook, _forwarding(_hook))


@dataclass
class WorkerStats:
    """Counters a run reports; the benchmark and the metrics read them."""

    texts: int = 0  # results written (embedded or answered by the vector cache)
    embedded: int = 0  # texts that went through the model in bulk batches
    real_tokens: int = 0
    padded_tokens: int = 0
    batches: int = 0
    dead_letters: int = 0
    # the vector cache: chunks answered from it, chunks embedded, the hits' tokens not computed
    # (frozen: each look-up's counts are added as a new record, so a copy of the stats keeps
    # its own)
    cache: CacheCounts = field(default_factory=CacheCounts)
    model_seconds: float = 0.0
    started_at: float = field(default_factory=time.perf_counter)

    @property
    def padding_waste(self) -> float:
        return 0.0 if not self.padded_tokens else 1 - self.real_tokens / self.padded_tokens

    @property
    def model_busy_fraction(self) -> float:
        elapsed = time.perf_counter() - self.started_at
        return 0.0 if elapsed <= 0 else min(1.0, self.model_seconds / elapsed)


class StatsEvents(ForwardingEvents):
    """Keeps WorkerStats current and forwards every event to the user's listener."""

    def __init__(self, stats: WorkerStats, listener: WorkerEvents) -> None:
        super().__init__(listener)
        self.stats = stats

    def batch_encoded(
        self, *, texts: int, real_tokens: int, padded_tokens: int, seconds: float
    ) -> None:
        self.stats.batches += 1
        self.stats.embedded += texts
        self.stats.real_tokens += real_tokens
        self.stats.padded_tokens += padded_tokens
        self.stats.model_seconds += seconds
        super().batch_encoded(
            texts=texts, real_tokens=real_tokens, padded_tokens=padded_tokens, seconds=seconds
        )
        self.listener.model_busy(fraction=self.stats.model_busy_fraction)

    def results_written(self, *, texts: int, seconds: float) -> None:
        self.stats.texts += texts
        super().results_written(texts=texts, seconds=seconds)

    def dead_lettered(self, *, count: int, reason: str) -> None:
        self.stats.dead_letters += count
        super().dead_lettered(count=count, reason=reason)

    def vector_cache_checked(self, *, hits: int, misses: int, tokens_saved: int) -> None:
        self.stats.cache += CacheCounts(hits, misses, tokens_saved)
        super().vector_cache_checked(hits=hits, misses=misses, tokens_saved=tokens_saved)
