"""What a worker reports as it runs; metrics, tests and the benchmark listen in.

The worker calls these hooks; it does not know who listens (taskiq's middleware shape). The
default does nothing, so the hot path pays for a method call and no more.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypedDict, Unpack

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
        was sized to. Only where queries wait on bulk work (not on the CUDA query lane)."""

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
        or on CUDA on the query lane's own thread."""

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
