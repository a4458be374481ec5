"""The query stage's inbox: the query stream read on the event loop, each query decoded,
checked, tokenized and queued for the serving thread.

A dedicated task blocks on the query stream (no polling). Queries are tokenized on the event
loop (a short text takes microseconds) and put in the inbox (``QueryInbox.pending``); the query
stage (workers/queries.py) serves it on the model thread at the next transformer-layer
boundary of a bulk batch, or at once when idle, or on CUDA from a thread of its own. A query
whose caller's deadline has passed is acknowledged unanswered (workers/deadlines.py); a long
input with ``window_overlap`` is split into its token windows (workers/long_inputs.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from embedfleet.shared.dead_letters import DeadReason
from embedfleet.shared.fault_kinds import System
from embedfleet.shared.keys import Keys
from embedfleet.workers.consumer import StreamConsumer, StreamEntry
from embedfleet.workers.dead_letter_writer import Rejected
from embedfleet.workers.deadlines import acknowledge_expired, split_expired
from embedfleet.workers.decode import Accepted, decode_entries
from embedfleet.workers.long_inputs import token_windows, whole
from embedfleet.workers.model.encoder import Tokenized
from embedfleet.workers.outages import RideOut, transient_or_raise
from embedfleet.workers.parts import StageParts
from embedfleet.workers.token_ids import tokenize_chunks


@dataclass(frozen=True)
class PendingQuery(Accepted):
    """An accepted query, tokenized, waiting in the inbox to be served."""

    tokens: Tokenized
    # wall clock (time.time) when the event loop got the entry and when it entered the inbox:
    # the stages of a query's wait (WorkerEvents.query_stages)
    read_at: float
    queued_at: float
    # a long input embedded whole (``window_overlap``, issue 42): its token windows, one
    # forward row each, pooled back into its one answer (workers/output.py); None: ``tokens``
    windows: list[Tokenized] | None = None

    @property
    def rows(self) -> list[Tokenized]:
        """What the query puts through the model: its windows, or its one row."""
        return self.windows if self.windows is not None else [self.tokens]

    @property
    def reply(self) -> str:
        return self.chunk.reply or ""  # accept() dead-letters a query without one

    @property
    def enqueued_at(self) -> float:
        """Unix seconds, from the stream entry id."""
        return _entry_time(self.delivery.entry_id)


class QueryInbox:
    """The event loop's side of the query stage: reads the query stream and queues each query
    accepted, tokenized, in ``pending`` for the serving thread (the model thread, or on CUDA
    the stage's own thread), which ``queued`` tells."""

    def __init__(self, parts: StageParts, queued: Callable[[], None]) -> None:
        self.settings = parts.settings
        # the priority streams' key set: query stream, replies, dead letters in one slot
        self.keys: Keys = parts.settings.keys.priority_streams
        self.encoder = parts.encoder
        self.client = parts.client
        self.dead_letters = parts.dead_letters
        self.events = parts.events
        self.outputs = parts.outputs
        self.on_model_thread = parts.on_model_thread
        self.outages = parts.outages
        self._queued = queued
        self._consumer = StreamConsumer(parts.client, self.keys, parts.settings.consumer)
        # the queries accepted, for the serving thread to take (deque: thread-safe appends
        # and pops)
        self.pending: deque[PendingQuery] = deque()

    async def read(self, stopping: asyncio.Event) -> None:
        """The query stream's reader, until ``stopping``: blocks on the stream (no polling)."""
        ride = RideOut("reading the query stream", self.outages, self.events)
        while not stopping.is_set():
            try:
                entries = await self._consumer.read_stream(
                    self.keys.query, count=64, block_ms=self.settings.block_ms
                )
                await self.accept(entries)
                ride.succeeded()
            except Exception as error:
                await ride.wait(transient_or_raise(error, System.REDIS))

    async def accept(self, entries: list[StreamEntry]) -> None:
        """Decode, skip queries whose caller has gone, tokenize, queue in ``pending`` and
        have the serving thread told."""
        if not entries:
            return
        read_at = time.time()
        fresh, prompts = await self._answerable(entries, read_at)
        if not fresh:
            return
        await self.outputs.prepare([item.chunk for item in fresh], self.on_model_thread)
        # the producer's (the gateway's) token ids where a query brought them, else its text
        # tokenized (workers/token_ids.py); ids of another tokenizer are dead-lettered
        made = tokenize_chunks([item.chunk for item in fresh], prompts, self.encoder)
        if made.refused:
            await self.dead_letters.send(
                [
                    Rejected.chunk(fresh[i].delivery, fresh[i].chunk, DeadReason.TOKENIZER, reason)
                    for i, reason in made.refused
                ]
            )
            fresh = [fresh[i] for i in made.kept]
            prompts = [prompts[i] for i in made.kept]
            if not fresh:
                return
        tokens = made.tokens
        windows, refused = token_windows(
            self.encoder.text.windows,
            [item.chunk for item in fresh],
            [item.delivery for item in fresh],
            tokens,
            prompts,
        )
        await self.dead_letters.send(list(refused.values()))
        queued_at = time.time()
        for position, (item, tokenized) in enumerate(zip(fresh, tokens, strict=True)):
            if position in refused:
                continue
            rows = windows.get(position)
            if rows is not None:
                tokenized = whole(rows)
            # accounted with the query's tokens (its model time is the bulk batches' gaps)
            delivery = dataclasses.replace(
                item.delivery, model=self.encoder.name, tokens=tokenized.length
            )
            self.pending.append(
                PendingQuery(item.chunk, delivery, tokenized, read_at, queued_at, windows=rows)
            )
        self._queued()

    async def _answerable(
        self, entries: list[StreamEntry], read_at: float
    ) -> tuple[list[Accepted], list[str]]:
        """The queries to answer and their prompts: decoded and checked; those without a
        reply key or whose options the model cannot honour dead-lettered, those whose caller
        has gone acknowledged unanswered."""
        accepted, rejected = decode_entries(entries, self.settings)
        answerable = []
        for item in accepted:
            if item.chunk.reply is None:
                reason = "query has no 'reply' (use Producer.embed_query)"
                rejected.append(
                    Rejected.chunk(item.delivery, item.chunk, DeadReason.INVALID, reason)
                )
            elif item.chunk.image is not None:  # (the query stage embeds texts: issue 56)
                reason = "images go to the ingest or interactive stream, not the query stream"
                rejected.append(
                    Rejected.chunk(item.delivery, item.chunk, DeadReason.OPTIONS, reason)
                )
            else:
                answerable.append(item)
        # a caller past its deadline has gone: answering would only leave garbage
        answerable, expired = split_expired(answerable, read_at * 1000)
        fresh = []
        prompts: list[str] = []
        for item in answerable:
            try:  # the model's query prompt unless the query names one (encode_query)
                prompts.append(self.outputs.prompt_for(item.chunk, "query"))
            except ValueError as error:
                rejected.append(
                    Rejected.chunk(item.delivery, item.chunk, DeadReason.OPTIONS, str(error))
                )
                continue
            fresh.append(item)
        await self.dead_letters.send(rejected)
        await acknowledge_expired(self.client.pipeline(transaction=True), self.keys, expired)
        return fresh, prompts


def _entry_time(entry_id: str) -> float:
    """Stream ids start with the server's unix milliseconds at XADD."""
    return int(entry_id.split("-", 1)[0]) / 1000
