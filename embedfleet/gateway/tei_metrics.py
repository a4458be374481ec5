"""TEI's Prometheus series for one request of a TEI route (``tei_request``): counted when it
arrives, its failure by TEI's error kind, or its success with its inputs and the figures of its
clock (gateway/metrics.py ``TEIMetrics`` owns the series and what each means)."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
from collections.abc import AsyncIterator, Sequence

from embedfleet.gateway.metrics import Family, Method, tei_failure
from embedfleet.gateway.state import UNCAPPED_TOKENS, Gateway
from embedfleet.gateway.timing_headers import current_clock

# TEI's router counts a request (te_request_count, te_request_success) per HTTP request and per
# unary gRPC call, not per message of a gRPC stream, whose messages record their inputs, timings
# and failures only (router/src/grpc/server.rs): set in a stream's messages' context
_stream_message: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "embedfleet_tei_stream_message", default=False
)


def stream_messages_context() -> contextvars.Context:
    """A copy of the current context in which TEI requests are a gRPC stream's messages (run
    the stream's message tasks in it: ``asyncio.create_task(..., context=...)``)."""
    context = contextvars.copy_context()
    context.run(_stream_message.set, True)
    return context


def tei_shape(inputs: object) -> tuple[Method, int]:
    """TEI's ``method`` label of an embedding route's ``inputs`` and how many inputs it holds:
    ``single`` for one (a string, or one sequence of token ids), ``batch`` for a list."""
    if isinstance(inputs, str):
        return "single", 1
    if isinstance(inputs, list) and inputs and all(isinstance(v, int) for v in inputs):
        return "single", 1
    return "batch", len(inputs) if isinstance(inputs, list) else 1


@contextlib.asynccontextmanager
async def tei_request(
    gateway: Gateway, family: Family, method: Method, inputs: int
) -> AsyncIterator[None]:
    """``async with tei_request(gateway, "embed", "batch", 3):`` around a TEI route's work.
    Counts the request and its ``inputs``; an exception out of the block is its failure, by
    ``tei_failure``'s kind; a clean exit its success, recorded off the event loop (its inputs'
    token lengths are counted with the model's tokenizer). A gRPC stream's message counts as
    no request of its own, as in TEI (``stream_messages_context``)."""
    tei = gateway.metrics.tei
    counted = not _stream_message.get()
    if counted:
        tei.request_count.labels(method).inc()
    tei.inputs_count[family].inc(inputs)
    try:
        yield
    except Exception as error:
        tei.request_failure.labels(tei_failure(error)).inc()
        raise
    card = gateway.known_card
    cap = card.max_length if card is not None else UNCAPPED_TOKENS

    def lengths(texts: Sequence[str]) -> list[int]:
        return gateway.tokenizer.lengths(texts, cap)

    await asyncio.to_thread(
        tei.record_success, family, method, inputs, current_clock(), lengths, cap, counted
    )
