"""The worker loop: read → decode → tokenize → sort and batch → encode → write + ack.

Three tasks joined by bounded queues (Infinity's shape), so Redis I/O, tokenization and the
forward pass overlap while memory stays bounded:

    reader   XREADGROUP, decode, dead-letter bad input, tokenize on a thread  → windows
    compute  plan batches by token budget, forward pass on the model thread   → encoded
    writer   fp16 results to the sink, XACK in the same round trip

Shutdown (arq's two modes): ``drain`` stops reading and lets in-flight work finish and be
acknowledged; ``abort`` cancels at once and leaves entries pending for other workers to claim.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
import redis.asyncio as aioredis

from shared.keys import Keys
from shared.logging import get_logger
from shared.protocol import Chunk, ProtocolError, Result, dead_letter_fields, decode_chunk
from shared.settings import Settings
from workers.batcher import plan_batches
from workers.consumer import StreamConsumer, StreamEntry
from workers.encoder import Encoder, Tokenized
from workers.sinks import Delivery, Sink, queue_acknowledgements

log = get_logger("embedfleet.worker")
_END = None  # queue sentinel: the stage before has finished


@dataclass
class Window:
    """Valid chunks read together, tokenized, with the entries they came from."""

    chunks: list[Chunk]
    deliveries: list[Delivery]
    tokens: list[Tokenized]


@dataclass
class Encoded:
    chunks: list[Chunk]
    deliveries: list[Delivery]
    tokens: list[Tokenized]
    vectors: np.ndarray


@dataclass
class WorkerStats:
    """Counters a run reports; the benchmark and the metrics read them."""

    texts: int = 0
    real_tokens: int = 0
    padded_tokens: int = 0
    batches: int = 0
    dead_letters: int = 0
    model_seconds: float = 0.0
    started_at: float = field(default_factory=time.perf_counter)

    @property
    def padding_waste(self) -> float:
        return 0.0 if not self.padded_tokens else 1 - self.real_tokens / self.padded_tokens

    @property
    def model_busy_fraction(self) -> float:
        elapsed = time.perf_counter() - self.started_at
        return 0.0 if elapsed <= 0 else min(1.0, self.model_seconds / elapsed)


class Worker:
    def __init__(
        self,
        settings: Settings,
        encoder: Encoder,
        client: aioredis.Redis,
        sink: Sink,
    ) -> None:
        self.settings = settings
        self.keys: Keys = settings.keys
        self.encoder = encoder
        self.client = client
        self.sink = sink
        self.consumer = StreamConsumer(client, self.keys, settings.consumer)
        self.stats = WorkerStats()
        self._model_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="model")
        self._tokenizer_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
        self._stopping = asyncio.Event()

    def drain(self) -> None:
        """Stop reading; what was read is finished and acknowledged, then run() returns."""
        self._stopping.set()

    async def run(self) -> None:
        await self.consumer.setup()
        windows: asyncio.Queue[Window | None] = asyncio.Queue(maxsize=1)
        encoded: asyncio.Queue[Encoded | None] = asyncio.Queue(maxsize=4)
        log.info(
            "worker started",
            consumer=self.settings.consumer,
            model=self.encoder.name,
            device=str(self.encoder.device),
            dtype=str(self.encoder.dtype).removeprefix("torch."),
        )
        self.stats = WorkerStats()
        try:
            await asyncio.gather(
                self._read_loop(windows),
                self._compute_loop(windows, encoded),
                self._write_loop(encoded),
            )
        finally:
            self._model_thread.shutdown(wait=False, cancel_futures=True)
            self._tokenizer_thread.shutdown(wait=False, cancel_futures=True)
        log.info("worker stopped", texts=self.stats.texts, dead_letters=self.stats.dead_letters)

    # --- reader -----------------------------------------------------------------------
    async def _read_loop(self, windows: asyncio.Queue[Window | None]) -> None:
        loop = asyncio.get_running_loop()
        try:
            while not self._stopping.is_set():
                entries = await self.consumer.read(self.settings.read_count, self.settings.block_ms)
                if not entries:
                    continue
                chunks, deliveries = await self._decode(entries)
                if not chunks:
                    continue
                texts = [chunk.text for chunk in chunks]
                tokens = await loop.run_in_executor(
                    self._tokenizer_thread, self.encoder.tokenize, texts
                )
                chunks, deliveries, tokens = await self._reject_overlong(chunks, deliveries, tokens)
                if chunks:
                    await windows.put(Window(chunks, deliveries, tokens))
        finally:
            await windows.put(_END)

    async def _decode(self, entries: list[StreamEntry]) -> tuple[list[Chunk], list[Delivery]]:
        """Valid chunks go on; anything else is dead-lettered with a reason, never dropped."""
        chunks: list[Chunk] = []
        deliveries: list[Delivery] = []
        rejected: list[tuple[StreamEntry, str, Chunk | None]] = []
        for entry in entries:
            if entry.payload is None:
                rejected.append(
                    (entry, "entry has no 'm' field (expected msgpack in field m)", None)
                )
                continue
            try:
                chunk = decode_chunk(
                    entry.payload,
                    max_bytes=self.settings.max_message_bytes,
                    max_text_chars=self.settings.max_text_chars,
                    max_meta_bytes=self.settings.max_meta_bytes,
                )
            except ProtocolError as error:
                rejected.append((entry, str(error), None))
                continue
            chunks.append(chunk)
            deliveries.append(Delivery(entry.stream, entry.entry_id, chunk.job))
        if rejected:
            await self._dead_letter(rejected)
        return chunks, deliveries

    async def _reject_overlong(
        self, chunks: list[Chunk], deliveries: list[Delivery], tokens: list[Tokenized]
    ) -> tuple[list[Chunk], list[Delivery], list[Tokenized]]:
        if self.settings.truncate or not any(t.truncated for t in tokens):
            return chunks, deliveries, tokens
        keep = [i for i, t in enumerate(tokens) if not t.truncated]
        reason = (
            f"text is longer than the model's {self.encoder.max_length} tokens "
            "(EMBEDFLEET_TRUNCATE=false)"
        )
        rejected = [
            (StreamEntry(d.stream, d.entry_id, None, {}), reason, c)
            for c, d, t in zip(chunks, deliveries, tokens, strict=True)
            if t.truncated
        ]
        await self._dead_letter(rejected)
        return [chunks[i] for i in keep], [deliveries[i] for i in keep], [tokens[i] for i in keep]

    async def _dead_letter(self, rejected: list[tuple[StreamEntry, str, Chunk | None]]) -> None:
        pipe = self.client.pipeline(transaction=True)
        deliveries = []
        for entry, reason, chunk in rejected:
            fields = dead_letter_fields(
                reason=reason,
                stream=entry.stream,
                entry_id=entry.entry_id,
                payload=entry.payload,
                chunk_id=chunk.id if chunk else None,
                job=chunk.job if chunk else None,
            )
            pipe.xadd(self.keys.dead, fields)
            deliveries.append(Delivery(entry.stream, entry.entry_id, chunk.job if chunk else None))
            log.warning(
                "dead-lettered", entry_id=entry.entry_id, stream=entry.stream, reason=reason
            )
        queue_acknowledgements(pipe, self.keys, deliveries, counter="dead")
        await pipe.execute()
        self.stats.dead_letters += len(rejected)

    # --- compute ----------------------------------------------------------------------
    async def _compute_loop(
        self, windows: asyncio.Queue[Window | None], encoded: asyncio.Queue[Encoded | None]
    ) -> None:
        loop = asyncio.get_running_loop()
        try:
            while (window := await windows.get()) is not _END:
                lengths = [t.length for t in window.tokens]
                for planned in plan_batches(
                    lengths, self.settings.token_budget, self.settings.max_batch
                ):
                    tokens = [window.tokens[p] for p in planned.positions]
                    batch = self.encoder.collate(tokens)
                    started = time.perf_counter()
                    vectors = await loop.run_in_executor(
                        self._model_thread, self.encoder.embed, batch
                    )
                    self.stats.model_seconds += time.perf_counter() - started
                    self.stats.batches += 1
                    self.stats.real_tokens += planned.real_tokens
                    self.stats.padded_tokens += planned.padded_tokens
                    await encoded.put(
                        Encoded(
                            chunks=[window.chunks[p] for p in planned.positions],
                            deliveries=[window.deliveries[p] for p in planned.positions],
                            tokens=tokens,
                            vectors=vectors,
                        )
                    )
        finally:
            await encoded.put(_END)

    # --- writer -----------------------------------------------------------------------
    async def _write_loop(self, encoded: asyncio.Queue[Encoded | None]) -> None:
        while (item := await encoded.get()) is not _END:
            vectors16 = item.vectors.astype("<f2")
            results = [
                Result(
                    id=chunk.id,
                    job=chunk.job,
                    model=self.encoder.name,
                    vector=vectors16[row],
                    truncated=item.tokens[row].truncated,
                    meta=chunk.meta,
                )
                for row, chunk in enumerate(item.chunks)
            ]
            await self.sink.write(results, item.deliveries)
            self.stats.texts += len(results)
