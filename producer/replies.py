"""The reply contract's one collector: the answers to a request, taken off its reply lists.

The workers are the one writer (embedfleet/sinks/reply.py for what the bulk reader embeds, the
query stage for queries, workers/deadletter.py for an input they refuse): one encoded ``Result``
or query error per input, RPUSHed to ``keys.reply(request)`` of the key set of the stream the
input was read from (the priority streams' for queries and interactive requests, a partition's for a
Batch API job). Every caller that waits for answers (``Producer.embed_queries``,
``Producer.embed_texts``, the gateway's Batch API) gathers them here, into one array indexed by
the input's position, which its chunk id carries: ``<request>:<index>``, or ``<index>`` alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

import numpy as np
import redis.asyncio as aioredis

from embedfleet.shared.keys import Keys
from embedfleet.shared.protocol import ProtocolError, QueryFailedError, Result, decode_result

# Answers taken off a reply list per round trip
PAGE = 512

# (inputs, values per vector, dtype) -> the array the answers are written into
Allocate = Callable[[int, int, np.dtype], np.ndarray]


def answer_index(chunk_id: object) -> int:
    """The input position an answer's chunk id names (``<request>:<index>`` or ``<index>``)."""
    return int(str(chunk_id).rsplit(":", 1)[-1])


def _in_memory(count: int, width: int, dtype: np.dtype) -> np.ndarray:
    return np.empty((count, width), dtype=dtype)


def ingest_reply_keys(keys: Keys, request: str) -> list[str]:
    """The reply lists of a request whose inputs went to the ingest streams (a Batch API job):
    one per partition, in the partition's slot, since each answer is written in the same script
    as its acknowledgement."""
    return [partition.reply(request) for partition in keys.partitions_keys]


class Answers:
    """One answer per input of a request, as they come off its reply lists, in any order.

    Vectors go into one array allocated on the first answer (``allocate``: in memory by
    default; the Batch API passes a file on disk), float32 for float answers (the wire's fp16
    widened) and the codes' own dtype for int8 / uint8 / binary. An input answered twice (a
    query sent again after a reconnection, a redelivered entry) keeps one answer. A refused
    input is kept in ``failures``, by position, with the worker's reason.
    """

    def __init__(self, count: int, allocate: Allocate = _in_memory) -> None:
        self.count = count
        self.allocate = allocate
        self.vectors: np.ndarray | None = None
        self.answered = np.zeros(count, dtype=bool)
        self.failures: dict[int, QueryFailedError] = {}
        # each answered input's whole result (sparse weights, scores), by position
        self.results: dict[int, Result] = {}

    @property
    def complete(self) -> bool:
        return bool(self.answered.all())

    @property
    def missing(self) -> int:
        return int(self.count - self.answered.sum())

    @property
    def succeeded(self) -> np.ndarray:
        """Which inputs have a vector (answered, and not refused)."""
        mask = self.answered.copy()
        mask[list(self.failures)] = False
        return mask

    def unanswered(self) -> list[int]:
        return [int(index) for index in np.flatnonzero(~self.answered)]

    def take(self, payload: bytes) -> QueryFailedError | None:
        """Record one answer; returns the worker's refusal when it is one. Raises
        ``ProtocolError`` for a payload that is no answer at all."""
        try:
            result = decode_result(payload)
        except QueryFailedError as failure:
            index = answer_index(failure.chunk_id)
            self.failures[index] = failure
            self.answered[index] = True
            return failure
        self._store(answer_index(result.id), result)
        return None

    def _store(self, index: int, result: Result) -> None:
        self.results[index] = result
        vector = result.vector
        if result.dtype in ("float16", "float32"):
            vector = vector.astype(np.float32)
        if self.vectors is None:
            self.vectors = self.allocate(self.count, vector.shape[0], vector.dtype)
        # a Batch API line that asked for fewer dimensions fills the start of its row
        self.vectors[index, : vector.shape[0]] = vector
        self.answered[index] = True

    def array(self) -> np.ndarray:
        """Every input's vector, in input order (only once ``complete`` without failures)."""
        if self.vectors is None or not self.complete:
            raise ValueError(f"{self.missing} of {self.count} inputs have no answer yet")
        return self.vectors


async def pop_answers(client: aioredis.Redis, reply_key: str, timeout_s: float) -> list[bytes]:
    """Answers taken off ``reply_key``: what is there (up to a page, one round trip), else the
    first to arrive within ``timeout_s`` (BLPOP: no polling); [] when none came in time."""
    # the client is made without decode_responses: replies are bytes (redis-py types them
    # as bytes | str whatever the client)
    page = cast("list[bytes] | None", await client.lpop(reply_key, PAGE))
    if page:
        return list(page)
    popped = cast("tuple[bytes, bytes] | None", await client.blpop([reply_key], timeout=timeout_s))
    return [] if popped is None else [popped[1]]


async def read_answers(
    client: aioredis.Redis, reply_keys: Sequence[str], answers: Answers, page: int = 1000
) -> int:
    """Every answer on ``reply_keys`` into ``answers``, read without taking them off (LRANGE
    pages), so a reader stopped half-way (a gateway restart) reads them all again. Returns how
    many payloads were no answer at all (left out)."""
    unreadable = 0
    for reply_key in reply_keys:
        start = 0
        while True:
            payloads = cast("list[bytes]", await client.lrange(reply_key, start, start + page - 1))
            for payload in payloads:
                try:
                    answers.take(payload)
                except (ProtocolError, ValueError, IndexError):  # not an answer of these inputs
                    unreadable += 1
            if len(payloads) < page:
                break
            start += page
    return unreadable
