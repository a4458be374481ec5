"""The asyncio client: enqueue chunks in pipelined batches, follow a job, read results back.

Every call rides out Redis restarts, failovers and dropped connections through the client's one
``RedisRetry`` (``shared/retry.py``): capped, jittered backoff for at most
``EMBEDFLEET_REDIS_RETRY_S`` (a query: its timeout), then ``RedisUnavailableError``. What is sent
again after a fault is safe to send again (see each call).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import redis.asyncio as aioredis
from embedfleet.producer.enqueue import queue_enqueue
from embedfleet.shared.faults import is_transient
from embedfleet.shared.keys import Keys
from embedfleet.shared.logging import get_logger
from embedfleet.shared.protocol import (
    PAYLOAD_FIELD,
    Chunk,
    Result,
    check_embedding_options,
    decode_result,
    encode_chunk,
)
from embedfleet.shared.redis_conn import connect_client, ensure_groups, redact_url
from embedfleet.shared.retry import OutageListener, RedisRetry, RedisUnavailableError, describe
from embedfleet.shared.settings import Settings

log = get_logger("embedfleet.producer")
ChunkLike = Chunk | Mapping[str, Any]


@dataclass(frozen=True)
class JobProgress:
    job: str
    enqueued: int
    done: int
    dead: int

    @property
    def finished(self) -> bool:
        return self.enqueued > 0 and self.done + self.dead >= self.enqueued


class JobTimeoutError(TimeoutError):
    """wait_for_job gave up; the job is still running and its entries are still queued."""


class QueryTimeoutError(TimeoutError):
    """No worker answered a query in time; the query was withdrawn and nothing is left behind."""


OPTION_NAMES = ("prompt_name", "prompt", "dimensions", "dtype")


@dataclass(frozen=True)
class EmbeddingOptions:
    """Per-job (or per-query) embedding options; None leaves the chunk's own or the worker's."""

    prompt_name: str | None = None
    prompt: str | None = None
    dimensions: int | None = None
    dtype: str | None = None

    def apply(self, chunk: Chunk) -> Chunk:
        """The chunk with these options filled in where the chunk has none of its own."""
        changes = {
            name: getattr(self, name)
            for name in OPTION_NAMES
            if getattr(self, name) is not None and getattr(chunk, name) is None
        }
        return dataclasses.replace(chunk, **changes) if changes else chunk


@dataclass(frozen=True)
class ServedModel:
    """What the workers of a namespace serve, as the first of them published it (Keys.model)."""

    name: str
    dim: int
    prompts: dict[str, str]

    def check(self, chunk: Chunk) -> None:
        """Reject options this model cannot honour, before they reach a worker."""
        if chunk.dimensions is not None and chunk.dimensions > self.dim:
            raise ValueError(
                f"chunk {chunk.id!r}: dimensions={chunk.dimensions} is more than the model "
                f"{self.name!r} has ({self.dim}); use 1..{self.dim}"
            )
        name = chunk.prompt_name
        if chunk.prompt is None and name is not None and name not in self.prompts:
            known = ", ".join(sorted(self.prompts)) or "none"
            raise ValueError(
                f"chunk {chunk.id!r}: prompt_name={name!r} is not one of the "
                f"model's prompts ({known}); pass a literal 'prompt' instead"
            )


def as_chunk(item: ChunkLike, job: str | None, options: EmbeddingOptions | None = None) -> Chunk:
    """Accept a Chunk or a mapping like one JSONL line: {"id", "text", "meta"?, options?}."""
    if isinstance(item, Chunk):
        chunk = item if job is None or item.job == job else dataclasses.replace(item, job=job)
    else:
        chunk_id, text = item.get("id"), item.get("text")
        if not isinstance(chunk_id, str) or not chunk_id:
            raise ValueError(f"chunk needs a non-empty string 'id', got {chunk_id!r}")
        if not isinstance(text, str):
            raise ValueError(f"chunk {chunk_id!r} needs a string 'text'")
        meta = item.get("meta")
        if meta is not None and not isinstance(meta, dict):
            raise ValueError(f"chunk {chunk_id!r}: 'meta' must be an object")
        chunk = Chunk(
            id=chunk_id,
            text=text,
            job=job or item.get("job"),
            meta=meta,
            **{name: item.get(name) for name in OPTION_NAMES},
        )
    if options is not None:
        chunk = options.apply(chunk)
    try:
        check_embedding_options(**{name: getattr(chunk, name) for name in OPTION_NAMES})
    except ValueError as error:
        raise ValueError(f"chunk {chunk.id!r}: {error}") from None
    return chunk


class Producer:
    """Enqueue chunks and follow jobs. Built from the same settings as every other part.

    ``async with Producer() as producer: await producer.enqueue([...], job="docs-v1")``
    """

    def __init__(
        self,
        settings: Settings | None = None,
        client: aioredis.Redis | None = None,
        *,
        on_outage: OutageListener | None = None,
    ):
        """``on_outage`` is told once when Redis becomes unreachable and once when it is back
        (default: a log line each); every call waits for it, for at most
        ``EMBEDFLEET_REDIS_RETRY_S``, then raises ``RedisUnavailableError``."""
        self.settings = settings or Settings()
        self.keys: Keys = self.settings.keys
        self.client = client or connect_client(self.settings.effective_redis_url)
        self._owns_client = client is None
        self._ready = False
        self.retry = RedisRetry(
            redact_url(self.settings.effective_redis_url), self.settings.redis_retry_s, on_outage
        )
        self._served: ServedModel | None = None

    async def __aenter__(self) -> Producer:
        await self.setup()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def setup(self, *, deadline: float | None = None) -> None:
        """Create the consumer group if no worker has yet (at id 0: nothing is skipped)."""
        if not self._ready:
            await self.retry.call(
                "create the consumer groups",
                lambda: ensure_groups(self.client, self.keys),
                deadline=deadline,
            )
            self._ready = True

    async def close(self) -> None:
        if self._owns_client:
            await self.client.aclose()

    async def served_model(self, *, deadline: float | None = None) -> ServedModel | None:
        """The model the workers published (Keys.model), or None before any worker started."""
        if self._served is None:
            fields = await self.retry.call(
                "read the served model",
                lambda: self.client.hgetall(self.keys.model),
                deadline=deadline,
            )
            if fields:
                values = {key.decode(): value.decode() for key, value in fields.items()}
                self._served = ServedModel(
                    name=values["name"],
                    dim=int(values["dim"]),
                    prompts=json.loads(values.get("prompts", "{}")),
                )
        return self._served

    async def _checked(self, chunk: Chunk, *, deadline: float | None = None) -> Chunk:
        served = await self.served_model(deadline=deadline)
        if served is not None:
            served.check(chunk)
        return chunk

    async def enqueue(
        self,
        chunks: Iterable[ChunkLike],
        *,
        job: str | None = None,
        batch_size: int = 1000,
        on_batch: Callable[[int], None] | None = None,
        options: EmbeddingOptions | None = None,
    ) -> int:
        """XADD every chunk, ``batch_size`` per pipelined round trip; returns how many.

        ``options`` (prompt, dimensions, dtype) apply to every chunk that has none of its own.
        A malformed option, or one the served model cannot honour (when a worker has published
        it), raises ValueError before anything is sent for that chunk.

        Entries are never trimmed on add: an undelivered chunk must not be lost. Workers delete
        entries once they are acknowledged.
        """
        await self.setup()
        total = 0
        batch: list[Chunk] = []
        for item in chunks:
            batch.append(await self._checked(as_chunk(item, job, options)))
            if len(batch) >= batch_size:
                total += await self._send(batch, on_batch)
                batch = []
        if batch:
            total += await self._send(batch, on_batch)
        return total

    async def _wait_for_room(self) -> None:
        """Backpressure: hold enqueueing while the backlog is over the high-water mark."""
        mark = self.settings.backlog_high_water
        waited_since: float | None = None
        while (backlog := await self._backlog()) >= mark:
            if waited_since is None:
                waited_since = time.monotonic()
                log.warning(
                    "backlog over the high-water mark: waiting for workers",
                    backlog=backlog,
                    high_water=mark,
                    setting="EMBEDFLEET_BACKLOG_HIGH_WATER",
                )
            await asyncio.sleep(0.5)
        if waited_since is not None:
            log.info(
                "backlog below the mark again", waited_s=round(time.monotonic() - waited_since, 1)
            )

    async def _backlog(self) -> int:
        return await self.retry.call("read the backlog", lambda: self.client.xlen(self.keys.ingest))

    async def _send(self, batch: list[Chunk], on_batch: Callable[[int], None] | None) -> int:
        """Send one batch, again after a fault: whether or not the server applied the lost
        try, the enqueue script adds and counts each chunk of a job once."""
        await self._wait_for_room()
        jobless: list[bytes] = []
        by_job: dict[str, list[tuple[str, bytes]]] = {}
        for chunk in batch:
            payload = encode_chunk(chunk)
            if chunk.job is None:
                jobless.append(payload)
            else:
                by_job.setdefault(chunk.job, []).append((chunk.id, payload))
        replies = await self.retry.call(
            f"enqueue a batch of {len(batch)} chunks",
            lambda: self._send_once(jobless, by_job),
        )
        if by_job:
            added = sum(replies[-1 - len(by_job) : -1])
            repeated = sum(len(chunks) for chunks in by_job.values()) - added
            if repeated:
                log.info(
                    "chunks already enqueued in their job were not added again", repeated=repeated
                )
        if on_batch is not None:
            on_batch(len(batch))
        return len(batch)

    async def _send_once(
        self, jobless: list[bytes], by_job: dict[str, list[tuple[str, bytes]]]
    ) -> list[Any]:
        """One pipelined round trip: per job, the enqueue script; chunks without a job, a plain
        XADD each (nothing counts them: a re-sent one is at worst embedded twice)."""
        pipe = self.client.pipeline(transaction=False)
        for payload in jobless:
            pipe.xadd(self.keys.ingest, {PAYLOAD_FIELD: payload})
        for job, chunks in by_job.items():
            queue_enqueue(
                pipe,
                stream=self.keys.ingest,
                counters=self.keys.job(job),
                id_record=self.keys.job_ids(job),
                chunks=chunks,
                id_record_ttl_s=self.settings.job_ids_ttl_s,
            )
        if by_job:
            # Outside the script: the index of job names need not share the streams' slot.
            pipe.sadd(self.keys.jobs_index, *by_job)
        return await pipe.execute()

    # --- priority queries -------------------------------------------------------------
    async def embed_query(
        self, text: str, *, timeout: float = 10.0, options: EmbeddingOptions | None = None
    ) -> np.ndarray:
        """Embed one query through the priority lane: a float32 vector (the model's dimension,
        or ``options.dimensions``), or int8/uint8 codes / packed bits for those dtypes."""
        return (await self.embed_queries([text], timeout=timeout, options=options))[0]

    async def embed_queries(
        self,
        texts: Sequence[str],
        *,
        timeout: float = 10.0,
        options: EmbeddingOptions | None = None,
    ) -> np.ndarray:
        """Embed a few queries now, ahead of any bulk backlog; shape (len(texts), dim).

        The worker uses the model's ``query`` prompt unless ``options`` names another (as
        ``SentenceTransformer.encode_query`` does).

        The worker pushes each answer onto a reply list this call blocks on (BLPOP: no
        polling). On timeout the queries are withdrawn from the stream and the reply key is
        deleted, so nothing is left behind; a late answer would expire with the key's TTL.

        Redis away (restart, failover, dropped connection) is waited out within ``timeout``;
        after a reconnection the unanswered queries are sent again under the same request id
        (a server that lost them would never answer), so a query may be embedded twice: the
        answers are kept one per index and a spare one expires with the reply key.
        """
        if not texts:
            raise ValueError("embed_queries needs at least one text")
        if any(not isinstance(t, str) or not t.strip() for t in texts):
            raise ValueError("every query must be a non-empty string")
        if not timeout > 0:  # BLPOP with timeout 0 would wait forever
            raise ValueError(f"timeout must be a positive number of seconds, not {timeout}")
        give_up_at = time.monotonic() + timeout
        request = uuid.uuid4().hex
        reply_key = self.keys.reply(request)
        deadline_ms = int((time.time() + timeout) * 1000)
        vectors: dict[int, np.ndarray] = {}
        entry_ids: list[bytes] = []
        tries = self.retry.attempts("embed queries", deadline=give_up_at)
        send = True  # at first, and again after a fault: the server may have lost them
        try:
            await self.setup(deadline=give_up_at)
            payloads: list[bytes] = []
            for index, text in enumerate(texts):
                chunk = Chunk(
                    id=f"{request}:{index}", text=text, reply=request, deadline_ms=deadline_ms
                )
                if options is not None:
                    chunk = await self._checked(as_chunk(chunk, None, options), deadline=give_up_at)
                payloads.append(encode_chunk(chunk))
            while len(vectors) < len(texts):
                remaining = give_up_at - time.monotonic()
                if remaining <= 0:
                    break
                try:
                    if send:
                        unanswered = [i for i in range(len(texts)) if i not in vectors]
                        sent, popped = await self._send_queries(
                            [payloads[i] for i in unanswered], reply_key, remaining
                        )
                        entry_ids += sent
                        send = False
                    else:
                        popped = await self.client.blpop([reply_key], timeout=remaining)
                except Exception as error:
                    send = True
                    await tries.failed(error)
                    continue
                tries.succeeded()
                if popped is None:
                    break  # BLPOP timed out: no worker answered in time
                result = decode_result(popped[1])  # raises QueryFailedError for a bad query
                vector = result.vector
                if result.dtype in ("float16", "float32"):
                    vector = vector.astype(np.float32)
                # A query sent twice is answered twice: the index keeps one answer.
                vectors[int(result.id.rsplit(":", 1)[1])] = vector
        except RedisUnavailableError as error:
            raise QueryTimeoutError(
                f"no answer within {timeout}s for {len(texts) - len(vectors)} of {len(texts)} "
                f"queries: {error}"
            ) from error
        finally:
            if len(vectors) < len(texts):
                await self._withdraw(entry_ids, reply_key)
        if len(vectors) < len(texts):
            raise QueryTimeoutError(
                f"no answer within {timeout}s for {len(texts) - len(vectors)} of {len(texts)} "
                f"queries. Are workers running? Check: redis-cli XINFO GROUPS {self.keys.query}"
            )
        return np.stack([vectors[i] for i in range(len(texts))])

    async def _send_queries(
        self, payloads: list[bytes], reply_key: str, timeout: float
    ) -> tuple[list[bytes], Any]:
        """The XADDs and the first BLPOP in one round trip: one round trip for a single query."""
        pipe = self.client.pipeline(transaction=False)
        for payload in payloads:
            pipe.xadd(self.keys.query, {PAYLOAD_FIELD: payload})
        pipe.blpop([reply_key], timeout=timeout)
        *entry_ids, popped = await pipe.execute()
        return entry_ids, popped

    async def _withdraw(self, entry_ids: list[bytes], reply_key: str) -> None:
        """Take unanswered queries back, once: if Redis is away, the workers skip them anyway
        (they are past their deadline) and the reply key expires."""
        pipe = self.client.pipeline(transaction=True)
        if entry_ids:
            pipe.xdel(self.keys.query, *entry_ids)
        pipe.delete(reply_key)
        try:
            await pipe.execute()
        except Exception as error:
            if not is_transient(error):
                raise
            log.info("could not withdraw queries: redis unavailable", error=describe(error))

    # --- jobs ---------------------------------------------------------------------------
    async def progress(self, job: str, *, deadline: float | None = None) -> JobProgress:
        counters = await self.retry.call(
            f"read job {job!r}'s progress",
            lambda: self.client.hgetall(self.keys.job(job)),
            deadline=deadline,
        )
        values = {key.decode(): int(value) for key, value in counters.items()}
        return JobProgress(
            job=job,
            enqueued=values.get("enqueued", 0),
            done=values.get("done", 0),
            dead=values.get("dead", 0),
        )

    async def wait_for_job(
        self,
        job: str,
        *,
        timeout: float | None = None,
        interval: float = 0.25,
        on_progress: Callable[[JobProgress], None] | None = None,
    ) -> JobProgress:
        """Return once every enqueued chunk of ``job`` is embedded or dead-lettered."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            try:
                progress = await self.progress(job, deadline=deadline)
            except RedisUnavailableError as error:
                if deadline is None or time.monotonic() < deadline:
                    raise  # EMBEDFLEET_REDIS_RETRY_S passed first
                raise JobTimeoutError(
                    f"job {job!r} not finished after {timeout}s: {error}"
                ) from error
            if on_progress is not None:
                on_progress(progress)
            if progress.finished:
                return progress
            if deadline is not None and time.monotonic() > deadline:
                raise JobTimeoutError(
                    f"job {job!r} not finished after {timeout}s: {progress.done} done, "
                    f"{progress.dead} dead of {progress.enqueued}. Are workers running? "
                    f"Check with: redis-cli XINFO GROUPS {self.keys.ingest}"
                )
            await asyncio.sleep(interval)

    async def results(self, *, job: str | None = None, page: int = 1000) -> AsyncIterator[Result]:
        """Every result in the results stream (optionally one job's), oldest first.

        Redeliveries can write an id twice; callers that need one vector per id keep the last.
        """
        start = "-"
        while True:
            entries = await self.retry.call(
                "read results",
                # Paged by entry id, so a page read again after a fault is the same page.
                lambda start=start: self.client.xrange(self.keys.results, min=start, count=page),
            )
            if not entries:
                return
            for _, fields in entries:
                result = decode_result(fields[PAYLOAD_FIELD])
                if job is None or result.job == job:
                    yield result
            last_id = entries[-1][0].decode()
            start = "(" + last_id
            if len(entries) < page:
                return
