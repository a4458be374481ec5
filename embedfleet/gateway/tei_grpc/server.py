"""TEI's gRPC API (``tei.v1``, text-embeddings-inference's router/src/grpc/server.rs) over the
fleet, served by the gateway process beside HTTP when EMBEDFLEET_GATEWAY_GRPC_PORT is set (one
server with the fleet's own embedfleet.v1: gateway/grpc_server.py).

Every call is a door onto the HTTP route that answers the same question: the message becomes
that route's request body, the route's own function answers it (its checks, limits, prompts,
truncation and lanes: gateway/tei_api.py and gateway/rerank_api.py), and its answer becomes
TEI's message. Nothing is checked twice or differently: where the HTTP route refuses, the call
ends with the gRPC code TEI gives that refusal (``grpc_code``).

- ``Info``, ``Embed`` (+ ``EmbedStream``), ``EmbedSparse`` (+ stream), ``EmbedAll`` (+
  stream), ``Predict``, ``PredictPair`` (+ streams), ``Rerank``, ``RerankStream``, ``Tokenize``
  (+ stream), ``Decode`` (+ stream). A bidirectional stream answers each message in order,
  up to STREAM_IN_FLIGHT of them at once; a refusal ends it with its code, as TEI's does.
- Fields as TEI reads them: proto3's ``truncate`` is a plain bool (false: an input over the
  model's maximum is refused, TEI's gRPC has no auto-truncate), ``normalize`` absent is true,
  ``skip_special_tokens`` and ``add_special_tokens`` are what the message says.
- API keys: metadata ``authorization: Bearer KEY`` (the gateway's keys, as its HTTP routes
  check them); UNAUTHENTICATED without one of them.
- Each answer's ``Metadata``: the characters and tokens sent and the gateway's clock
  (gateway/timing_headers.py), in nanoseconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, NoReturn, TypeVar

import grpc
from google.protobuf import json_format
from pydantic import ValidationError

from embedfleet.gateway import rerank_api, tei_api
from embedfleet.gateway.errors import APIError, ErrorDialect, as_api_error, invalid_request
from embedfleet.gateway.grpc_services import add_service
from embedfleet.gateway.inputs import TruncationDirection
from embedfleet.gateway.metrics import call_refused
from embedfleet.gateway.state import Gateway
from embedfleet.gateway.tei_grpc import tei_pb2 as pb
from embedfleet.gateway.tei_metrics import stream_messages_context
from embedfleet.gateway.timing_headers import RequestClock, request_clock
from embedfleet.shared.logging import get_logger

log = get_logger("embedfleet.gateway.grpc")

Request = TypeVar("Request")
Answer = TypeVar("Answer")
Output = TypeVar("Output")
Servicer = TypeVar("Servicer", bound="GatewayServicer")

# TEI's gRPC code for each of its error types (server.rs, ``impl From<ErrorResponse> for
# Status``); an APIError's type is the one TEI's HTTP dialect gives it (errors.py)
TEI_CODES = {
    "Unhealthy": grpc.StatusCode.UNAVAILABLE,
    "Backend": grpc.StatusCode.FAILED_PRECONDITION,
    "Overloaded": grpc.StatusCode.RESOURCE_EXHAUSTED,
    "Validation": grpc.StatusCode.INVALID_ARGUMENT,
    "Tokenizer": grpc.StatusCode.FAILED_PRECONDITION,
    "Empty": grpc.StatusCode.INVALID_ARGUMENT,
}
# Answers TEI never gives (it has no keys list, no deadline, no crash it reports), in gRPC's own
# words rather than as a ``Backend`` error
OWN_CODES = {
    401: grpc.StatusCode.UNAUTHENTICATED,
    500: grpc.StatusCode.INTERNAL,
    504: grpc.StatusCode.DEADLINE_EXCEEDED,
}
# A stream's messages answered at once (TEI's GRPC_MAX_PARALLEL_STREAM_REQUESTS is 1,024): each
# is one request on the query stream, whose workers batch them; more would only wait in Redis
STREAM_IN_FLIGHT = 64
_DIRECTIONS: dict[int, TruncationDirection] = {
    pb.TRUNCATION_DIRECTION_RIGHT: "Right",
    pb.TRUNCATION_DIRECTION_LEFT: "Left",
}
_MODEL_TYPES = {
    "embedding": pb.MODEL_TYPE_EMBEDDING,
    "classifier": pb.MODEL_TYPE_CLASSIFIER,
    "reranker": pb.MODEL_TYPE_RERANKER,
}


def grpc_code(error: APIError) -> grpc.StatusCode:
    """The code TEI's gRPC server ends a call with for the refusal ``error`` stands for."""
    own = OWN_CODES.get(error.status)
    if own is not None:
        return own
    error_type = ErrorDialect.tei.body(error)["error_type"]
    return TEI_CODES.get(error_type, grpc.StatusCode.FAILED_PRECONDITION)


class Refusal(Exception):
    """A call's end with a code and a message (what ``context.abort`` sends), and the HTTP
    status the same refusal has over HTTP (the request series' ``status``)."""

    def __init__(self, code: grpc.StatusCode, message: str, status: int) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.status = status


def refusal(error: Exception, retry_after_s: int) -> Refusal:
    """The gRPC end of a call whose route raised ``error``."""
    if isinstance(error, ValidationError):  # a message the route's request model refuses
        error = invalid_request(error.errors())
    api_error = as_api_error(error, retry_after_s)
    if api_error.status >= 500 and api_error.code == "internal_error":
        log.exception("gRPC call failed", error=repr(error))
    return Refusal(grpc_code(api_error), api_error.message, api_error.status)


def _direction(value: int) -> TruncationDirection:
    """TEI's enum's direction; a number no direction has (proto3 enums are open: any int32
    arrives) is the caller's error, TEI's Validation, not Right in silence."""
    direction = _DIRECTIONS.get(value)
    if direction is None:
        named = ", ".join(pb.TruncationDirection.keys())
        raise APIError(
            422,
            f"truncation_direction {value} is none of {named}",
            param="truncation_direction",
            code="validation",
        )
    return direction


def optional_field(message: Any, field: str) -> Any:
    """A proto3 ``optional`` field's value, None where the message leaves it out."""
    return getattr(message, field) if message.HasField(field) else None


def _nanoseconds(seconds: float) -> int:
    return int(max(0.0, seconds) * 1e9)


def _metadata(clock: RequestClock) -> pb.Metadata:
    """TEI's Metadata of an answer: what was sent to the fleet and the gateway's clock."""
    now = time.perf_counter()
    first_call = clock.first_call if clock.first_call is not None else now
    return pb.Metadata(
        compute_chars=clock.characters,
        compute_tokens=clock.tokens(),
        total_time_ns=_nanoseconds(now - clock.started),
        tokenization_time_ns=_nanoseconds(first_call - clock.started),
        queue_time_ns=_nanoseconds(clock.queue_s),
        inference_time_ns=_nanoseconds(clock.inference_s),
    )


class GatewayServicer:
    """The frame of every gRPC call the gateway serves (tei.v1's and the fleet's own
    embedfleet.v1, fleet_grpc/server.py): the key, the clock, refusals with their codes,
    streams answered in order."""

    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway

    def _authorize(self, context: grpc.aio.ServicerContext) -> None:
        """The call's API key, as the HTTP front door checks it (401 -> UNAUTHENTICATED)."""
        keys = self.gateway.keys
        if keys.enabled:
            sent = dict(context.invocation_metadata() or ())
            authorization = sent.get("authorization")
            keys.check(authorization if isinstance(authorization, str) else None)

    async def _unary(
        self,
        context: grpc.aio.ServicerContext,
        answer: Callable[[RequestClock], Awaitable[Answer]],
    ) -> Answer:
        """One unary call: the key checked, then ``answer`` on a clock of its own; a refusal
        ends the call with its code."""
        try:
            self._authorize(context)
            return await self._timed(answer)
        except Refusal as refused:
            await self._abort(context, refused)
        except Exception as error:
            await self._abort(context, refusal(error, self.gateway.settings.gateway_retry_after_s))

    async def _timed(self, answer: Callable[[RequestClock], Awaitable[Answer]]) -> Answer:
        with request_clock() as clock:
            return await answer(clock)

    async def _abort(self, context: grpc.aio.ServicerContext, refused: Refusal) -> NoReturn:
        call_refused(refused.status)
        await context.abort(refused.code, refused.message)
        raise AssertionError("context.abort returns only by raising")  # for the type checker

    async def _stream(
        self,
        requests: AsyncIterator[Request],
        context: grpc.aio.ServicerContext,
        answer: Callable[[Request, RequestClock], Awaitable[Answer]],
    ) -> AsyncIterator[Answer]:
        """A bidirectional stream: each message answered as its own call, in order, up to
        STREAM_IN_FLIGHT at once; the first refusal ends the stream with its code (TEI's)."""
        try:
            self._authorize(context)
        except Exception as error:
            await self._abort(context, refusal(error, self.gateway.settings.gateway_retry_after_s))
        in_flight: asyncio.Queue[asyncio.Task[Answer] | None] = asyncio.Queue(STREAM_IN_FLIGHT)

        async def read() -> None:
            try:
                async for request in requests:
                    await in_flight.put(
                        asyncio.ensure_future(self._timed(bind_request(answer, request)))
                    )
            finally:
                await in_flight.put(None)  # the end of the messages (or of the client)

        # its messages count as TEI counts a stream's: inputs and timings, no request each
        reader = asyncio.create_task(read(), context=stream_messages_context())
        try:
            while (task := await in_flight.get()) is not None:
                try:
                    yield await task
                except Exception as error:
                    await self._abort(
                        context, refusal(error, self.gateway.settings.gateway_retry_after_s)
                    )
        finally:
            reader.cancel()
            while not in_flight.empty():
                left = in_flight.get_nowait()
                if left is not None:
                    left.cancel()
            # the reader's own end (the client gone, a malformed message) ends the stream: the
            # call is over either way
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await reader


def bind_request(
    answer: Callable[[Request, RequestClock], Awaitable[Answer]], request: Request
) -> Callable[[RequestClock], Awaitable[Answer]]:
    return lambda clock: answer(request, clock)


def one_call(
    answer: Callable[[Servicer, Request, RequestClock], Awaitable[Answer]],
) -> Callable[[Servicer, Request, grpc.aio.ServicerContext], Awaitable[Answer]]:
    """A unary method of the servicer: its message answered by ``answer`` in the frame
    (GatewayServicer._unary). Most methods are one of these or ``each_call`` of the same
    ``answer``: TEI's ``Embed`` and ``EmbedStream`` differ only in how many messages come."""

    async def method(self: Servicer, request: Request, context: grpc.aio.ServicerContext) -> Answer:
        return await self._unary(context, bind_request(functools.partial(answer, self), request))

    return method


def each_call(
    answer: Callable[[Servicer, Request, RequestClock], Awaitable[Answer]],
) -> Callable[[Servicer, AsyncIterator[Request], grpc.aio.ServicerContext], AsyncIterator[Answer]]:
    """A bidirectional stream method of the servicer: each message answered by ``answer`` as
    its own call, in order (GatewayServicer._stream)."""

    async def method(
        self: Servicer, requests: AsyncIterator[Request], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Answer]:
        async for reply in self._stream(requests, context, functools.partial(answer, self)):
            yield reply

    return method


def _one_input(
    embed: Callable[[rerank_api.EmbedSparseRequest, Gateway], Awaitable[list[Output]]],
    respond: Callable[[Output, pb.Metadata], Answer],
) -> Callable[
    [GatewayServicer, pb.EmbedSparseRequest | pb.EmbedAllRequest, RequestClock], Awaitable[Answer]
]:
    """EmbedSparse's or EmbedAll's answer: ``embed`` (/embed_sparse's or /embed_all's function)
    of the message's one input, as ``respond`` puts it with the call's metadata."""

    async def answer(
        self: GatewayServicer,
        request: pb.EmbedSparseRequest | pb.EmbedAllRequest,
        clock: RequestClock,
    ) -> Answer:
        (output,) = await embed(_sparse_body(request), self.gateway)
        return respond(output, await _measured(clock))

    return answer


def _sparse_response(
    weights: list[dict[str, Any]], metadata: pb.Metadata
) -> pb.EmbedSparseResponse:
    return pb.EmbedSparseResponse(
        sparse_embeddings=[pb.SparseValue(index=w["index"], value=w["value"]) for w in weights],
        metadata=metadata,
    )


def _token_response(matrix: list[list[float]], metadata: pb.Metadata) -> pb.EmbedAllResponse:
    return pb.EmbedAllResponse(
        token_embeddings=[pb.TokenEmbedding(embeddings=row) for row in matrix], metadata=metadata
    )


class TEIServicer(GatewayServicer):
    """Every tei.v1 service on one gateway: a coroutine for each method of each of them."""

    # --- Info ----------------------------------------------------------------------------
    async def Info(self, request: pb.InfoRequest, context: grpc.aio.ServicerContext) -> Any:
        async def answer(clock: RequestClock) -> pb.InfoResponse:
            facts = dict(await tei_api.info(self.gateway))
            # /info's model_type ({"embedding": {...}}, {"reranker": {...}}) as TEI's enum
            kinds = facts["model_type"]
            assert isinstance(kinds, dict) and len(kinds) == 1, kinds
            facts["model_type"] = pb.ModelType.Name(_MODEL_TYPES[next(iter(kinds))])
            # the proto's fields of /info's answer (the rest is TEI's HTTP only); a null leaves
            # an optional field out
            return json_format.ParseDict(facts, pb.InfoResponse(), ignore_unknown_fields=True)

        return await self._unary(context, answer)

    # --- Embed ---------------------------------------------------------------------------
    async def _embed(self, request: pb.EmbedRequest, clock: RequestClock) -> pb.EmbedResponse:
        body = tei_api.EmbedRequest(
            inputs=request.inputs,
            truncate=request.truncate,
            truncation_direction=_direction(request.truncation_direction),
            normalize=True if optional_field(request, "normalize") is None else request.normalize,
            prompt_name=optional_field(request, "prompt_name"),
            dimensions=optional_field(request, "dimensions"),
        )
        (vector,) = await tei_api.embed(body, self.gateway)
        return pb.EmbedResponse(embeddings=vector, metadata=await _measured(clock))

    Embed = one_call(_embed)
    EmbedStream = each_call(_embed)

    _embed_sparse = _one_input(rerank_api.embed_sparse, _sparse_response)
    EmbedSparse = one_call(_embed_sparse)
    EmbedSparseStream = each_call(_embed_sparse)

    _embed_all = _one_input(rerank_api.embed_all, _token_response)
    EmbedAll = one_call(_embed_all)
    EmbedAllStream = each_call(_embed_all)

    # --- Predict -------------------------------------------------------------------------
    async def _predict(
        self, request: pb.PredictRequest | pb.PredictPairRequest, clock: RequestClock
    ) -> pb.PredictResponse:
        # Predict's one text, or PredictPair's [text] or [text, text]: /predict's one input
        inputs = request.inputs if isinstance(request.inputs, str) else list(request.inputs)
        body = rerank_api.PredictRequest(
            inputs=inputs,
            truncate=request.truncate,
            truncation_direction=_direction(request.truncation_direction),
            raw_scores=request.raw_scores,
        )
        labels = await rerank_api.predict(body, self.gateway)
        return pb.PredictResponse(
            predictions=[pb.Prediction(score=p["score"], label=p["label"]) for p in labels],
            metadata=await _measured(clock),
        )

    Predict = one_call(_predict)
    PredictPair = one_call(_predict)
    PredictStream = each_call(_predict)
    PredictPairStream = each_call(_predict)

    # --- Rerank --------------------------------------------------------------------------
    async def _rerank(
        self, queries: Sequence[str], texts: Sequence[str], first: Any, clock: RequestClock
    ) -> pb.RerankResponse:
        """TEI's ranks of ``texts[i]`` for ``queries[i]``: /rerank once per distinct query
        (a RerankStream may pair each text with a query of its own), ``first``'s options."""
        if not texts:  # /rerank's refusal of no texts (after its model check, as over HTTP)
            await rerank_api.rerank(rerank_api.RerankRequest(query="", texts=[]), self.gateway)
        by_query: dict[str, list[int]] = {}
        for index, query in enumerate(queries):
            by_query.setdefault(query, []).append(index)
        ranks = []
        for query, positions in by_query.items():
            body = rerank_api.RerankRequest(
                query=query,
                texts=[texts[i] for i in positions],
                truncate=first.truncate,
                truncation_direction=_direction(first.truncation_direction),
                raw_scores=first.raw_scores,
            )
            for rank in await rerank_api.rerank(body, self.gateway):
                index = positions[rank["index"]]
                text = texts[index] if first.return_text else None
                ranks.append(pb.Rank(index=index, text=text, score=rank["score"]))
        ranks.sort(key=lambda rank: (-rank.score, rank.index))
        return pb.RerankResponse(ranks=ranks, metadata=await _measured(clock))

    async def Rerank(self, request: pb.RerankRequest, context: grpc.aio.ServicerContext) -> Any:
        queries = [request.query] * len(request.texts)
        return await self._unary(
            context, lambda clock: self._rerank(queries, list(request.texts), request, clock)
        )

    async def RerankStream(
        self,
        request_iterator: AsyncIterator[pb.RerankStreamRequest],
        context: grpc.aio.ServicerContext,
    ) -> Any:
        """TEI's client stream of (query, text) pairs: one answer once the stream ends, the
        first message's ``raw_scores`` and ``return_text`` for all (as TEI reads them)."""

        async def answer(clock: RequestClock) -> pb.RerankResponse:
            # read once the key is checked (_unary): a caller without one sends nothing in
            pairs = [message async for message in request_iterator]
            first = pairs[0] if pairs else pb.RerankStreamRequest()
            queries = [pair.query for pair in pairs]
            return await self._rerank(queries, [pair.text for pair in pairs], first, clock)

        return await self._unary(context, answer)

    # --- Tokenize ------------------------------------------------------------------------
    async def _tokenize(self, request: pb.EncodeRequest, clock: RequestClock) -> pb.EncodeResponse:
        body = tei_api.TokenizeRequest(
            inputs=request.inputs,
            add_special_tokens=request.add_special_tokens,
            prompt_name=optional_field(request, "prompt_name"),
        )
        # /tokenize's own answer (its checks, the prompt in front), read back: one input's tokens
        answer = await tei_api.tokenize(body, self.gateway)
        written = b"".join(
            [
                part if isinstance(part, bytes) else str(part).encode()
                async for part in answer.body_iterator
            ]
        )
        (tokens,) = json.loads(written)
        return pb.EncodeResponse(tokens=[pb.SimpleToken(**token) for token in tokens])

    Tokenize = one_call(_tokenize)
    TokenizeStream = each_call(_tokenize)

    async def _decode(self, request: pb.DecodeRequest, clock: RequestClock) -> pb.DecodeResponse:
        body = tei_api.DecodeRequest(
            ids=list(request.ids), skip_special_tokens=request.skip_special_tokens
        )
        (text,) = await tei_api.decode(body, self.gateway)
        return pb.DecodeResponse(text=text)

    Decode = one_call(_decode)
    DecodeStream = each_call(_decode)


def _sparse_body(
    request: pb.EmbedSparseRequest | pb.EmbedAllRequest,
) -> rerank_api.EmbedSparseRequest:
    """/embed_sparse's and /embed_all's body (one type) of TEI's message for either."""
    return rerank_api.EmbedSparseRequest(
        inputs=request.inputs,
        truncate=request.truncate,
        truncation_direction=_direction(request.truncation_direction),
        prompt_name=optional_field(request, "prompt_name"),
    )


async def _measured(clock: RequestClock) -> pb.Metadata:
    # the tokens sent are counted by tokenizing them again: off the event loop
    return await asyncio.to_thread(_metadata, clock)


def add_tei_services(gateway: Gateway, server: grpc.aio.Server) -> None:
    """Every tei.v1 service, answered for ``gateway``, on ``server``."""
    servicer = TEIServicer(gateway)
    for service in pb.DESCRIPTOR.services_by_name.values():
        add_service(server, service, servicer)
