"""TEI's timing headers on every answer of a TEI route that reached the fleet
(text-embeddings-inference's ``ResponseMetadata``): ``x-compute-type``, ``x-compute-time``,
``x-compute-characters``, ``x-compute-tokens``, ``x-total-time``, ``x-tokenization-time``,
``x-queue-time`` and ``x-inference-time``, times in whole milliseconds as TEI writes them.

The workers time their stages (read, tokenize, wait, forward, reply: the query stage's metrics)
but do not send them back with an answer, so every figure here is the gateway's own clock:

- ``x-total-time`` and ``x-compute-time``: the request, from its arrival at the gateway to its
  answer (TEI gives both the same value);
- ``x-tokenization-time``: from its arrival to its first call on the fleet: the gateway's
  parsing, validation and tokenization (its length checks and truncation);
- ``x-queue-time``: the gateway's wait before its inputs were sent (the lane's length read, the
  admission check);
- ``x-inference-time``: from sending the inputs to having every answer back: the fleet's queue
  wait, the forward pass and the reply (the gateway cannot split these);
- ``x-compute-characters``: the characters of the inputs sent; ``x-compute-tokens``: their
  tokens as the model reads them (the gateway's tokenizer, each capped at the model's maximum);
- ``x-compute-type``: ``cpu`` or ``gpu``, the device the workers' settings name
  (EMBEDFLEET_DEVICE; ``auto`` reads as ``cpu``, the gateway cannot see the workers' device).

A request that never reached the fleet (an error before it, /info, /tokenize) has none of them,
nor does an answer in OpenAI's dialect (/v1/*, /embeddings): OpenAI sends none, and its
``usage`` already counts the tokens (a second count would tokenize every input again).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from embedfleet.gateway.errors import ErrorDialect, declared_dialect

TokenCounter = Callable[[Sequence[str]], int]

HEADERS = (
    "x-compute-type",
    "x-compute-time",
    "x-compute-characters",
    "x-compute-tokens",
    "x-total-time",
    "x-tokenization-time",
    "x-queue-time",
    "x-inference-time",
)


@dataclass
class RequestClock:
    """One request's marks on the gateway's clock (``time.perf_counter`` seconds) and what it
    sent to the fleet. A request may call the fleet several times (/similarity, /vertex's
    instances): the first call ends its tokenization, the calls' waits and round trips add up."""

    started: float
    first_call: float | None = None
    queue_s: float = 0.0
    inference_s: float = 0.0
    characters: int = 0
    # (the texts, how the model counts them): counted only when the headers are written
    sent: list[tuple[Sequence[str], TokenCounter | None]] = field(default_factory=list)

    def tokens(self) -> int:
        return sum(count(texts) for texts, count in self.sent if count is not None)


_clock: contextvars.ContextVar[RequestClock | None] = contextvars.ContextVar(
    "embedfleet_request_clock", default=None
)


class FleetCall:
    """The marks of one call on the fleet: ``sending()`` once the gateway's own checks are done,
    ``answered()`` (on leaving the ``with`` block) once the answers are back."""

    def __init__(self, texts: Sequence[str], count: TokenCounter | None) -> None:
        self.clock = _clock.get()
        self.texts = texts
        self.count = count
        self._entered = 0.0
        self._sent: float | None = None

    def __enter__(self) -> FleetCall:
        self._entered = time.perf_counter()
        if self.clock is not None and self.clock.first_call is None:
            self.clock.first_call = self._entered
        return self

    def sending(self) -> None:
        self._sent = time.perf_counter()

    def __exit__(self, kind: object, error: object, traceback: object) -> None:
        clock = self.clock
        if clock is None or self._sent is None or kind is not None:
            return
        clock.queue_s += self._sent - self._entered
        clock.inference_s += time.perf_counter() - self._sent
        clock.characters += sum(len(text) for text in self.texts)
        clock.sent.append((self.texts, self.count))


@contextlib.contextmanager
def request_clock() -> Iterator[RequestClock]:
    """A clock for one request, from now: the fleet calls made inside the block (in this task,
    or in the tasks and threads it starts) record on it. The HTTP middleware below opens one
    per request; TEI's gRPC server one per call (its answers' ``Metadata``)."""
    clock = RequestClock(started=time.perf_counter())
    token = _clock.set(clock)
    try:
        yield clock
    finally:
        _clock.reset(token)


def fleet_call(texts: Sequence[str], count: TokenCounter | None = None) -> FleetCall:
    """``with fleet_call(texts, count) as call: ...; call.sending(); await ...``: the request's
    clock (if a TimingHeaders middleware set one) records this call on the fleet."""
    return FleetCall(texts, count)


def current_clock() -> RequestClock | None:
    """The clock of the request being answered (None outside one): TEI's metrics read its
    figures when the request ends (gateway/tei_metrics.py)."""
    return _clock.get()


def _ms(seconds: float) -> str:
    return str(int(max(0.0, seconds) * 1000))


def timing_headers(clock: RequestClock, compute_type: str, now: float) -> dict[str, str]:
    """TEI's headers for a request that reached the fleet (see the module's docstring)."""
    total = now - clock.started
    first = clock.first_call if clock.first_call is not None else now
    return {
        "x-compute-type": compute_type,
        "x-compute-time": _ms(total),
        "x-compute-characters": str(clock.characters),
        "x-compute-tokens": str(clock.tokens()),
        "x-total-time": _ms(total),
        "x-tokenization-time": _ms(first - clock.started),
        "x-queue-time": _ms(clock.queue_s),
        "x-inference-time": _ms(clock.inference_s),
    }


class TimingHeaders:
    """Pure ASGI middleware: a clock per HTTP request, and TEI's timing headers on a successful
    answer of a TEI route (the route the request matched, in the scope) that reached the
    fleet."""

    def __init__(self, app: ASGIApp, compute_type: str) -> None:
        self.app = app
        self.compute_type = compute_type

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        with request_clock() as clock:
            await self.app(scope, receive, self._timed(scope, send, clock))

    def _timed(self, scope: Scope, send: Send, clock: RequestClock) -> Send:
        """``send``, with TEI's headers added to a successful answer that reached the fleet."""

        async def send_timed(message: Message) -> None:
            if (
                message["type"] == "http.response.start"
                and message["status"] < 400
                and clock.sent
                and declared_dialect(scope.get("route")) is ErrorDialect.tei
            ):
                headers = MutableHeaders(scope=message)
                # x-compute-tokens tokenizes every input sent: off the event loop
                values = await asyncio.to_thread(
                    timing_headers, clock, self.compute_type, time.perf_counter()
                )
                for name, value in values.items():
                    headers[name] = value
            await send(message)

        return send_timed


def compute_type(device: str) -> str:
    """TEI's ``x-compute-type`` for EMBEDFLEET_DEVICE."""
    return "gpu" if device.startswith("cuda") else "cpu"
