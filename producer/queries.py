"""The priority streams: queries and texts for someone waiting, answered on a reply list.

The inputs of one request go to the query stream (``Keys.priority_streams.query``: few, short texts,
served between the transformer layers of bulk batches) or the interactive stream
(``.interactive``: bulk-sized batches, read before every ingest stream) under one request id;
the workers push each input's answer onto the request's reply list, which the call blocks on
(BLPOP: no polling, producer/replies.py). An unanswered request is withdrawn: nothing is left
behind.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np

from embedfleet.producer.chunks import EmbeddingOptions, as_chunk
from embedfleet.producer.lane import ProducerLane
from embedfleet.producer.replies import Answers, pop_answers
from embedfleet.producer.token_ids import TokenIdsUnavailableError
from embedfleet.shared.fault_kinds import is_transient
from embedfleet.shared.logging import get_logger
from embedfleet.shared.protocol import PAYLOAD_FIELD, Chunk, Result, SparseVector, encode_chunk
from embedfleet.shared.retry import RedisUnavailableError, describe

log = get_logger("embedfleet.producer")
# How late past a query's deadline a round trip may still answer (a BLPOP ends at the deadline
# by itself) before it counts as a hung Redis and is cancelled
REPLY_MARGIN_S = 0.25

# a request's stream, as the calls name it: the query stream or the interactive one ("texts")
RequestStream = Literal["query", "texts"]


class QueryTimeoutError(TimeoutError):
    """No worker answered a query in time; the query was withdrawn and nothing is left behind."""


class Queries:
    """Requests on one producer lane's query and interactive streams (the facade routes the
    model); the calls' contracts are ``Producer``'s."""

    def __init__(self, lane: ProducerLane) -> None:
        self.lane = lane

    def stream(self, request_stream: RequestStream) -> str:
        """The query stream (few, short texts) or the interactive one (``texts``)."""
        priority = self.lane.keys.priority_streams
        return priority.query if request_stream == "query" else priority.interactive

    async def embed(
        self,
        texts: Sequence[str | bytes],
        request_stream: RequestStream,
        timeout: float,
        options: EmbeddingOptions | None,
    ) -> np.ndarray:
        """Dense vectors of ``texts``, shape (len(texts), dim): the query stream's (few, short
        queries) or the interactive stream's (many texts, bulk-sized batches; an item of bytes
        is an image, which the query stream does not take)."""
        what = "queries" if request_stream == "query" else "texts"
        return (
            await self.answers(self.stream(request_stream), what, texts, timeout, options)
        ).array()

    async def embed_sparse(
        self,
        texts: Sequence[str],
        timeout: float,
        max_active_dims: int | None,
        request_stream: RequestStream,
    ) -> list[SparseVector]:
        extra = {"representations": ("sparse",), "max_active_dims": max_active_dims}
        answers = await self.answers(
            self.stream(request_stream), request_stream, texts, timeout, None, extra=extra
        )
        vectors = [answers.results[index].sparse for index in range(len(texts))]
        if any(vector is None for vector in vectors):
            raise ValueError("the workers answered without sparse weights")
        return [vector for vector in vectors if vector is not None]

    async def rerank(
        self,
        query: str,
        documents: Sequence[str],
        timeout: float,
        request_stream: RequestStream,
        raw_scores: bool = False,
    ) -> np.ndarray:
        answers = await self._pairs(
            [query] * len(documents), documents, timeout, request_stream, raw_scores
        )
        return np.array(
            [answers.results[index].score for index in range(len(documents))], dtype=np.float32
        )

    async def score_pairs(
        self,
        pairs: Sequence[tuple[str, str | None]],
        timeout: float,
        request_stream: RequestStream,
        raw_scores: bool = False,
    ) -> np.ndarray:
        firsts, seconds = [a for a, _ in pairs], [b for _, b in pairs]
        answers = await self._pairs(firsts, seconds, timeout, request_stream, raw_scores)
        return np.stack(
            [np.asarray(answers.results[i].vector, np.float32) for i in range(len(pairs))]
        )

    async def _pairs(
        self,
        firsts: Sequence[str],
        seconds: Sequence[str | None],
        timeout: float,
        request_stream: RequestStream,
        raw_scores: bool,
    ) -> Answers:
        """The cross-encoder's answers to (``firsts[i]``, ``seconds[i]``): rerank's and
        score_pairs' one request shape (a None second: the first text alone)."""
        return await self.answers(
            self.stream(request_stream),
            "pairs",
            firsts,
            timeout,
            None,
            pairs=seconds,
            extra=_raw(raw_scores),
        )

    async def embed_representations(
        self,
        texts: Sequence[str],
        representations: Sequence[str],
        timeout: float,
        request_stream: RequestStream,
        options: EmbeddingOptions | None,
        max_active_dims: int | None,
        multivector_dtype: str | None,
        token_states: bool = False,
    ) -> list[Result]:
        extra = {
            "representations": tuple(representations),
            "max_active_dims": max_active_dims,
            "multivector_dtype": multivector_dtype,
            "token_states": True if token_states else None,
        }
        answers = await self.answers(
            self.stream(request_stream), request_stream, texts, timeout, options, extra=extra
        )
        return [answers.results[index] for index in range(len(texts))]

    async def answers(
        self,
        stream: str,
        what: str,
        texts: Sequence[str | bytes],
        timeout: float,
        options: EmbeddingOptions | None,
        *,
        pairs: Sequence[str | None] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> Answers:
        """Send ``texts`` to ``stream`` under one request id and collect their answers from the
        request's reply list (producer/replies.py): each input's Result. ``pairs``: each text's
        document for a cross-encoder (None: the text scored alone); ``extra``: Chunk fields
        every input gets.

        The worker pushes each answer onto a reply list this call blocks on (BLPOP: no
        polling). On timeout the inputs are withdrawn from the stream and the reply key is
        deleted, so nothing is left behind; a late answer would expire with the key's TTL.

        Redis away (restart, failover, dropped connection) is waited out within ``timeout``;
        after a reconnection the unanswered inputs are sent again under the same request id
        (a server that lost them would never answer), so an input may be embedded twice: the
        answers are kept one per index and a spare one expires with the reply key.
        """
        _check_request(what, texts, timeout, pairs)
        give_up_at = time.monotonic() + timeout
        request = uuid.uuid4().hex
        reply_key = self.lane.keys.priority_streams.reply(request)
        deadline_ms = int((time.time() + timeout) * 1000)
        answers = Answers(len(texts))
        entry_ids: list[bytes] = []
        try:
            await self.lane.setup(deadline=give_up_at)
            payloads = await self._payloads(
                request, texts, deadline_ms, options, pairs, extra, give_up_at, stream
            )
            await self._collect(stream, what, payloads, reply_key, answers, entry_ids, give_up_at)
        except RedisUnavailableError as error:
            raise QueryTimeoutError(
                f"no answer within {timeout}s for {answers.missing} of {len(texts)} {what}: {error}"
            ) from error
        finally:
            if not answers.complete or answers.failures:
                await self._withdraw(stream, entry_ids, reply_key)
        if not answers.complete:
            raise QueryTimeoutError(
                f"no answer within {timeout}s for {answers.missing} of {len(texts)} "
                f"{what}. Are workers running? Check: redis-cli XINFO GROUPS {stream}"
            )
        return answers

    async def _payloads(
        self,
        request: str,
        texts: Sequence[str | bytes],
        deadline_ms: int,
        options: EmbeddingOptions | None,
        pairs: Sequence[str | None] | None,
        extra: dict[str, Any] | None,
        give_up_at: float,
        stream: str,
    ) -> list[bytes]:
        """Each input encoded, after the worker's own checks with the configured limits (and
        the model card's, where an option or a pair asks something of the model): nothing is
        sent of a request the worker would refuse. With EMBEDFLEET_PRODUCER_TOKEN_IDS each
        carries its token ids (producer/token_ids.py: the gateway, a pod of its own, tokenizes
        for the GPU hosts), made off the event loop."""
        lane = self.lane
        chunks: list[Chunk] = []
        for index, item in enumerate(texts):
            image = item if isinstance(item, bytes) else None  # an image chunk has no text
            chunk = as_chunk(
                Chunk(
                    id=f"{request}:{index}",
                    text=item if isinstance(item, str) else "",
                    image=image,
                    reply=request,
                    deadline_ms=deadline_ms,
                    pair=pairs[index] if pairs is not None else None,
                    # accounted to the producer's tenant (the priority streams have no shares)
                    tenant=None if lane.tenant is None else lane.tenants.wire(lane.tenant),
                    **(extra or {}),
                ),
                None,
                options,
                lane.settings.chunk_limits,
            )
            # an image is held against the card too: its modality is the model's or not
            if options is not None or pairs is not None or extra or image is not None:
                chunk = await lane.checked(chunk, deadline=give_up_at)
            chunks.append(chunk)
        if lane.settings.producer_token_ids:
            chunks = await self._with_token_ids(chunks, stream, give_up_at)
        return [encode_chunk(chunk) for chunk in chunks]

    async def _with_token_ids(
        self, chunks: list[Chunk], stream: str, give_up_at: float
    ) -> list[Chunk]:
        """``chunks`` with their token ids, for the prompt the worker joins on ``stream`` (the
        query stream's ``query`` lane, the interactive stream's ``document`` one); as they are
        where no ids can be made (no worker published its tokenizer yet): a request someone
        waits on is not refused for an optimisation."""
        try:
            maker = await self.lane.token_id_maker(deadline=give_up_at)
        except TokenIdsUnavailableError as error:
            log.debug("request sent without token ids", reason=str(error))
            return chunks
        # the prompt role the worker gives what it reads from this stream
        role = "query" if stream == self.lane.keys.priority_streams.query else "document"
        return await asyncio.to_thread(maker.attach, chunks, role)

    async def _collect(
        self,
        stream: str,
        what: str,
        payloads: list[bytes],
        reply_key: str,
        answers: Answers,
        entry_ids: list[bytes],
        give_up_at: float,
    ) -> None:
        """Send the inputs and take their answers off the reply list until every input has one
        or ``give_up_at``; after a fault, the unanswered inputs are sent again (the server may
        have lost them). ``entry_ids``: every entry sent, for the withdrawal."""
        lane = self.lane
        tries = lane.retry.attempts(f"embed {what}", deadline=give_up_at)
        send = True  # at first, and again after a fault: the server may have lost them
        while not answers.complete:
            remaining = give_up_at - time.monotonic()
            if remaining <= 0.01:  # BLPOP's timeout 0 would wait for ever
                break
            # one BLPOP waits at most EMBEDFLEET_BLOCK_MS (the connection's read timeout is
            # sized for it); the round trip as a whole is bounded by the deadline, so a hung
            # Redis is given up on there (a TimeoutError: transient, then past the deadline)
            blocking = min(remaining, lane.settings.block_ms / 1000)
            try:
                async with asyncio.timeout(remaining + REPLY_MARGIN_S):
                    if send:
                        unanswered = answers.unanswered()
                        sent, popped = await self._send_request(
                            stream, [payloads[i] for i in unanswered], reply_key, blocking
                        )
                        entry_ids += sent
                        send = False
                    else:
                        popped = await pop_answers(lane.client, reply_key, blocking)
            except Exception as error:
                send = True
                await tries.failed(error)
                continue
            tries.succeeded()
            for payload in popped:
                failure = answers.take(payload)
                if failure is not None:
                    raise failure  # the worker's reason for a bad input

    async def _send_request(
        self, stream: str, payloads: list[bytes], reply_key: str, timeout: float
    ) -> tuple[list[bytes], list[bytes]]:
        """The XADDs and the first BLPOP in one round trip: one round trip for a single query."""
        pipe = self.lane.client.pipeline(transaction=False)
        for payload in payloads:
            pipe.xadd(stream, {PAYLOAD_FIELD: payload})
        pipe.blpop([reply_key], timeout=timeout)
        *entry_ids, popped = await pipe.execute()
        return entry_ids, [] if popped is None else [popped[1]]

    async def _withdraw(self, stream: str, entry_ids: list[bytes], reply_key: str) -> None:
        """Take an unanswered request's entries back, once, within
        EMBEDFLEET_REDIS_CLEANUP_TIMEOUT_S: if Redis is away or hung, the workers skip them
        anyway (they are past their deadline) and the reply key expires. An entry a worker has
        already read is answered onto the deleted key, which then expires."""
        pipe = self.lane.client.pipeline(transaction=True)  # the priority streams share a slot
        if entry_ids:
            pipe.xdel(stream, *entry_ids)
        pipe.delete(reply_key)
        try:
            # bounded: the caller's timeout (or cancellation) must hold with Redis hung
            async with asyncio.timeout(self.lane.settings.redis_cleanup_timeout_s):
                await pipe.execute()
        except Exception as error:
            if not is_transient(error):
                raise
            log.info("could not withdraw queries: redis unavailable", error=describe(error))


def _check_request(
    what: str, texts: Sequence[str | bytes], timeout: float, pairs: Sequence[str | None] | None
) -> None:
    """A ``ValueError`` for a request no worker could answer, before anything is sent."""
    if pairs is not None and len(pairs) != len(texts):
        raise ValueError("one document per query: pairs and texts differ in length")
    if not texts:
        raise ValueError(f"embedding {what} needs at least one text")
    if any(not isinstance(t, str | bytes) for t in texts):
        raise ValueError(f"every one of the {what} must be a string (or an image's bytes)")
    if not timeout > 0:  # BLPOP with timeout 0 would wait forever
        raise ValueError(f"timeout must be a positive number of seconds, not {timeout}")


def _raw(raw_scores: bool) -> dict[str, Any] | None:
    """The chunk field that asks a cross-encoder for its logits (``raw_scores``), when asked."""
    return {"raw_scores": True} if raw_scores else None
