"""The gateway's /metrics: requests by route and status, and their latency, for Prometheus;
and TEI's own series (``TEIMetrics``), under TEI's names, beside them."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.utils import floatToGoString

if TYPE_CHECKING:
    from embedfleet.gateway.timing_headers import RequestClock

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
# A gRPC call in the request series: its ``route`` is the call's full method name
# (/tei.v1.Embed/Embed), its ``method`` this, its ``status`` the HTTP status the same answer has
# over HTTP (200, a refusal's 4xx or 5xx), so one alert on 5xx covers both doors
GRPC_METHOD = "gRPC"
# a call whose client went away before its answer (nginx's "client closed request")
CLIENT_CLOSED = 499


@dataclass
class Call:
    """One gRPC call being answered: the HTTP status of its answer once known (a call that ends
    on an exception no refusal accounts for is the gateway's own fault, 500)."""

    status: int | None = None


_call: contextvars.ContextVar[Call | None] = contextvars.ContextVar(
    "embedfleet_grpc_call", default=None
)


def call_refused(status: int) -> None:
    """The gRPC call being answered (in this context) ends with the refusal whose HTTP status
    is ``status`` (the servicers' frame, tei_grpc/server.py, says so as it aborts the call)."""
    call = _call.get()
    if call is not None:
        call.status = status


class GatewayMetrics:
    """One registry per app, so tests can run several gateways in one process."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "embedfleet_gateway_requests",
            "Requests answered, by route template (a gRPC call's full method name), method "
            "(gRPC for a call) and status (a call's HTTP equivalent)",
            ["route", "method", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "embedfleet_gateway_request_seconds",
            "Time to answer a request, by route template and status",
            ["route", "status"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.inputs = Counter(
            "embedfleet_gateway_inputs",
            "Texts embedded for HTTP requests, by lane (query or interactive) and model",
            ["lane", "model"],
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "embedfleet_gateway_requests_in_flight",
            "Requests being answered now",
            registry=self.registry,
        )
        # TEI's own series, under TEI's names and meanings, for its dashboards (``tei``)
        self.tei = TEIMetrics()

    def answered(self, route: str, method: str, status: int, seconds: float) -> None:
        """One request or call answered, in the request series and its latency."""
        self.requests.labels(route, method, str(status)).inc()
        self.latency.labels(route, str(status)).observe(seconds)

    @contextlib.contextmanager
    def grpc_call(self, route: str) -> Iterator[Call]:
        """``with metrics.grpc_call("/tei.v1.Embed/Embed"):`` around a gRPC call's handler: in
        flight while it runs, then answered with its status (200 unless ``call_refused``
        said otherwise). Each call runs in a task of its own (grpc.aio's), so the call set
        here is that task's alone."""
        call = Call()
        _call.set(call)
        started = time.perf_counter()
        self.in_flight.inc()
        try:
            yield call
            if call.status is None:
                call.status = 200
        except asyncio.CancelledError:
            call.status = call.status or CLIENT_CLOSED
            raise
        finally:
            self.in_flight.dec()
            self.answered(route, GRPC_METHOD, call.status or 500, time.perf_counter() - started)

    def exposition(self) -> bytes:
        """/metrics' body: the fleet's series, then TEI's."""
        return generate_latest(self.registry) + self.tei.exposition()


# TEI's buckets (router/src/prometheus.rs): every ``*_duration`` a geometric series of 35 from
# 15 µs by 1.5 (to ~22 min); input lengths powers of two up to the model's maximum; batch sizes
# powers of two to 4,096, batch tokens to 1,048,576
TEI_DURATION_BUCKETS = tuple(0.00001 * 1.5**step for step in range(1, 36))
TEI_BATCH_SIZE_BUCKETS = tuple(2.0**power for power in range(13))
TEI_BATCH_TOKENS_BUCKETS = tuple(2.0**power for power in range(21))
TEI_INPUT_LENGTH_POWERS = 20

# a TEI route's family of per-input series: ``te_embed_*`` (the embedding routes) or
# ``te_predict_*`` (/predict, /rerank); ``single`` or ``batch``: TEI's ``method`` label
Family = Literal["embed", "predict"]
Method = Literal["single", "batch"]
# the four timings of TEI's ResponseMetadata, under the name each series takes
TIMINGS = ("duration", "tokenization_duration", "queue_duration", "inference_duration")


def tei_failure(error: BaseException) -> str:
    """TEI's ``err`` label of ``te_request_failure`` for a request the gateway refused or could
    not answer: ``batch_size`` (too many inputs), ``overloaded`` (429), ``model_type`` (the
    model lacks the representation: 424), ``validation`` (another 4xx), ``inference`` (the
    fleet's failure: a timeout, Redis, a worker's error)."""
    status = getattr(error, "status", 500)
    code = getattr(error, "code", None)
    if code == "too_many_inputs":
        return "batch_size"
    if status == 429:
        return "overloaded"
    if status == 424 or code == "representation_not_served":
        return "model_type"
    return "validation" if 400 <= status < 500 else "inference"


class TEIMetrics:
    """TEI's Prometheus series (text-embeddings-inference's router and core), so that its
    dashboards read a gateway as they read TEI: the names, types, labels and buckets TEI exports,
    and its exposition (a counter's sample is its name, without prometheus_client's ``_total``:
    ``rate(te_request_count[1m])`` is what a TEI dashboard runs).

    What each means here (docs/GATEWAY.md): ``te_request_*`` per request of a TEI route that
    reaches the fleet's routes (/embed, /embed_sparse, /embed_all, /predict, /rerank, and those
    that go through them); ``te_embed_*`` and ``te_predict_*`` per input; the timings are the
    gateway's clock (gateway/timing_headers.py, TEI's headers' figures); ``te_batch_next_*`` the
    inputs and tokens of each call the gateway hands the fleet (the workers' own batches are
    ``embedfleet_batch_*`` on their /metrics); ``te_queue_size`` the lane's entries as last read
    at admission."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        registry = self.registry
        self.request_count = Counter(
            "te_request_count", "Requests received, by method", ["method"], registry=registry
        )
        self.request_success = Counter(
            "te_request_success", "Requests answered, by method", ["method"], registry=registry
        )
        self.request_failure = Counter(
            "te_request_failure", "Requests failed, by error kind", ["err"], registry=registry
        )
        self.timings: dict[str, Histogram] = {}
        for family in ("request", "embed", "predict"):
            for timing in TIMINGS:
                name = f"te_{family}_{timing}"
                self.timings[name] = Histogram(
                    name,
                    f"{family} {timing.replace('_', ' ')} in seconds",
                    buckets=TEI_DURATION_BUCKETS,
                    registry=registry,
                )
        self.inputs_count = {
            family: Counter(f"te_{family}_count", f"{family} inputs received", registry=registry)
            for family in ("embed", "predict")
        }
        self.inputs_success = {
            family: Counter(f"te_{family}_success", f"{family} inputs answered", registry=registry)
            for family in ("embed", "predict")
        }
        self.batch_size = Histogram(
            "te_batch_next_size",
            "Inputs per call on the fleet",
            buckets=TEI_BATCH_SIZE_BUCKETS,
            registry=registry,
        )
        self.batch_tokens = Histogram(
            "te_batch_next_tokens",
            "Tokens per call on the fleet",
            buckets=TEI_BATCH_TOKENS_BUCKETS,
            registry=registry,
        )
        self.queue_size = Gauge(
            "te_queue_size", "Entries waiting on the lane, as last read", registry=registry
        )
        # its buckets stop at the model's maximum length, known once a card is: made then
        self._input_length: Histogram | None = None
        self._lock = threading.Lock()

    def input_length(self, max_input_length: int) -> Histogram:
        """``te_request_input_length``, bucketed as TEI buckets it for ``max_input_length``."""
        with self._lock:
            if self._input_length is None:
                buckets = [
                    2.0**power
                    for power in range(TEI_INPUT_LENGTH_POWERS)
                    if 2**power <= max_input_length
                ]
                self._input_length = Histogram(
                    "te_request_input_length",
                    "Input length in tokens",
                    buckets=buckets,
                    registry=self.registry,
                )
            return self._input_length

    def record_success(
        self,
        family: Family,
        method: Method,
        inputs: int,
        clock: RequestClock | None,
        lengths: Callable[[Sequence[str]], list[int]],
        max_input_length: int,
        request: bool = True,
    ) -> None:
        """A request answered: its method, its inputs, its timings and (from what it sent, per
        fleet call) its inputs' token lengths and calls' sizes; ``request`` false for a gRPC
        stream's message, which TEI counts in all but ``te_request_success``. Tokenizes: call
        it off the event loop."""
        if request:
            self.request_success.labels(method).inc()
        self.inputs_success[family].inc(inputs)
        if clock is None:
            return
        now = time.perf_counter()
        first = clock.first_call if clock.first_call is not None else now
        figures = dict(
            zip(
                TIMINGS,
                (now - clock.started, first - clock.started, clock.queue_s, clock.inference_s),
                strict=True,
            )
        )
        for timing, seconds in figures.items():
            self.timings[f"te_request_{timing}"].observe(seconds)
            per_input = self.timings[f"te_{family}_{timing}"]
            for _ in range(inputs):  # TEI times each input; here they share the round trip
                per_input.observe(seconds)
        histogram = self.input_length(max_input_length)
        for texts, _ in clock.sent:
            counted = [min(length, max_input_length) for length in lengths(texts)]
            for length in counted:
                histogram.observe(length)
            self.batch_size.observe(len(texts))
            self.batch_tokens.observe(sum(counted))

    def exposition(self) -> bytes:
        """TEI's series in Prometheus' text format as TEI's exporter writes them: a counter's
        sample under its own name (no ``_total``), no ``_created`` samples."""
        lines: list[str] = []
        for family in self.registry.collect():
            if not family.samples:
                continue
            lines.append(f"# HELP {family.name} {family.documentation}")
            lines.append(f"# TYPE {family.name} {family.type}")
            for sample in family.samples:
                if sample.name.endswith("_created"):
                    continue
                name = family.name if family.type == "counter" else sample.name
                labels = ",".join(
                    f'{key}="{_escaped(value)}"' for key, value in sorted(sample.labels.items())
                )
                selector = f"{name}{{{labels}}}" if labels else name
                lines.append(f"{selector} {floatToGoString(sample.value)}")
        return ("\n".join(lines) + "\n").encode() if lines else b""


def _escaped(value: str) -> str:
    return value.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")
