"""OpenAI's Batch API over the ingest stream: a batch is a job whose chunks answer on a list.

State lives in Redis (``{ns}:batch:<id>``: the Batch object and the enqueue cursor) and files in
EMBEDFLEET_FILES_DIR, so any gateway replica can serve any batch and a restart loses none. The
``BatchRunner`` of every replica moves active batches along under a lease (only one works on a
batch at a time):

    validating → in_progress   enqueue the input file's inputs in slices, through the client's
                               one enqueue path (partitions, backpressure, job counters); the
                               cursor is saved after each slice, and a slice sent again after
                               a restart adds nothing (each input id of a job is added once)
    in_progress → finalizing   once the job's counters say every input is done or dead
    finalizing → completed     output and error files written from the reply lists (one per
                               partition; the client's collector, producer/replies.py)
    cancelling → cancelled     enqueueing stops; what was sent is finished and written out
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np
from pydantic import ValidationError

from embedfleet.gateway.errors import APIError
from embedfleet.gateway.files import FileStore
from embedfleet.gateway.inputs import (
    as_texts,
    check_dimensions,
    check_limits,
    shape_vectors,
)
from embedfleet.gateway.openai_api import EmbeddingRequest, embeddings_response
from embedfleet.gateway.state import Gateway, wire_options
from embedfleet.producer.client import Producer
from embedfleet.producer.replies import Answers, ingest_reply_keys, read_answers
from embedfleet.shared.logging import get_logger
from embedfleet.shared.protocol import Chunk

log = get_logger("embedfleet.gateway.batches")

ENDPOINT = "/v1/embeddings"
LINES_PER_SLICE = 500  # input lines enqueued per MULTI
REPLY_PAGE = 1000
LEASE_MS = 120_000
TICK_S = 0.25
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
# Release the lease only if it is still ours (it may have expired and been taken).
RELEASE_SCRIPT = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


@dataclass(frozen=True)
class BatchLine:
    custom_id: str
    texts: list[str]
    encoding_format: str
    dimensions: int | None


def parse_line(raw: bytes, gateway: Gateway) -> BatchLine:
    """One JSONL request line, validated as the online endpoint would; APIError says why not."""
    try:
        line = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise APIError(400, f"not JSON: {error}") from None
    if not isinstance(line, dict):
        raise APIError(400, "each line must be a JSON object")
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise APIError(400, "'custom_id' must be a non-empty string", param="custom_id")
    if line.get("method") != "POST":
        raise APIError(400, "'method' must be \"POST\"", param="method")
    if line.get("url") != ENDPOINT:
        raise APIError(400, f"'url' must be {ENDPOINT!r} (the only batch endpoint)", param="url")
    try:
        body = EmbeddingRequest.model_validate(line.get("body"))
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise APIError(400, f"body.{where}: {first.get('msg')}", param="body") from None
    gateway.check_model(body.model, "body.model")
    check_dimensions(body.dimensions, gateway.model.dim)
    texts = as_texts(body.input, gateway.tokenizer, "body.input")
    check_limits(texts, gateway.settings, "body.input")
    return BatchLine(custom_id, texts, body.encoding_format, body.dimensions)


def new_batch(input_file_id: str, completion_window: str, metadata: dict | None) -> dict:
    now = int(time.time())
    return {
        "id": f"batch_{uuid.uuid4().hex}",
        "object": "batch",
        "endpoint": ENDPOINT,
        "errors": None,
        "input_file_id": input_file_id,
        "completion_window": completion_window,
        "status": "validating",
        "output_file_id": None,
        "error_file_id": None,
        "created_at": now,
        "in_progress_at": None,
        "expires_at": now + 24 * 3600,
        "finalizing_at": None,
        "completed_at": None,
        "failed_at": None,
        "expired_at": None,
        "cancelling_at": None,
        "cancelled_at": None,
        "request_counts": {"total": 0, "completed": 0, "failed": 0},
        "metadata": metadata,
    }


class BatchStore:
    """Batch records in Redis: the Batch object (JSON) plus the runner's cursor fields."""

    def __init__(self, producer: Producer) -> None:
        self.producer = producer  # job counters are the client's to read (summed over partitions)
        self.client = producer.client
        self.keys = producer.keys

    async def create(self, batch: dict, lines: int) -> None:
        batch["request_counts"]["total"] = lines
        pipe = self.client.pipeline(transaction=True)
        pipe.hset(
            self.keys.batch(batch["id"]),
            mapping={
                "object": json.dumps(batch),
                "lines": lines,
                "cursor": 0,
                "offset": 0,
                "inputs": 0,
            },
        )
        pipe.zadd(self.keys.batches, {batch["id"]: time.time()})
        pipe.sadd(self.keys.batches_active, batch["id"])
        await pipe.execute()

    async def fields(self, batch_id: str) -> dict[str, Any]:
        raw = await self.client.hgetall(self.keys.batch(batch_id))
        if not raw:
            raise APIError(
                404, f"no batch with id {batch_id!r}", param="batch_id", code="batch_not_found"
            )
        fields: dict[str, Any] = {key.decode(): value for key, value in raw.items()}
        fields["object"] = json.loads(fields["object"])
        for name in ("lines", "cursor", "offset", "inputs"):
            fields[name] = int(fields.get(name, 0))
        return fields

    async def get(self, batch_id: str) -> dict:
        """The Batch object, with live request_counts from the job counters while it runs."""
        fields = await self.fields(batch_id)
        batch = fields["object"]
        if batch["status"] in ACTIVE and fields["inputs"]:
            progress = await self.producer.progress(batch_id)
            done, dead = progress.done, progress.dead
            # exact when every line has one input (the usual batch); otherwise inputs are
            # scaled to lines until the output is written and the exact counts are known
            scale = fields["cursor"] / fields["inputs"]
            batch["request_counts"] = {
                "total": fields["lines"],
                "completed": int(done * scale),
                "failed": min(int(np.ceil(dead * scale)), fields["lines"]),
            }
        return batch

    async def save(self, batch: dict, **cursor: int) -> None:
        await self.client.hset(
            self.keys.batch(batch["id"]), mapping={"object": json.dumps(batch), **cursor}
        )

    async def request_cancel(self, batch_id: str) -> dict:
        batch = await self.get(batch_id)
        if batch["status"] in ("validating", "in_progress"):
            await self.client.hset(self.keys.batch(batch_id), "cancel", int(time.time()))
        return batch

    async def page(self, after: str | None, limit: int) -> tuple[list[dict], bool]:
        ids = [i.decode() for i in await self.client.zrevrange(self.keys.batches, 0, -1)]
        if after is not None and after in ids:
            ids = ids[ids.index(after) + 1 :]
        batches = [await self.get(batch_id) for batch_id in ids[:limit]]
        return batches, len(ids) > limit


class BatchRunner:
    """Moves every active batch along; one per gateway replica, leases keep them apart."""

    def __init__(self, gateway: Gateway, files: FileStore, store: BatchStore) -> None:
        self.gateway = gateway
        self.files = files
        self.store = store
        self.client = gateway.client
        self.keys = gateway.settings.keys
        self.instance = uuid.uuid4().hex
        self._stopping = asyncio.Event()
        self.wake = asyncio.Event()

    def stop(self) -> None:
        self._stopping.set()
        self.wake.set()

    async def run(self) -> None:
        while not self._stopping.is_set():
            try:
                for batch_id in await self.client.smembers(self.keys.batches_active):
                    if self._stopping.is_set():
                        break
                    await self._with_lease(batch_id.decode())
            except Exception as error:  # Redis down, disk full: say so, keep trying
                log.warning("batch runner error; retrying", error=repr(error))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wake.wait(), TICK_S)
            self.wake.clear()

    async def _with_lease(self, batch_id: str) -> None:
        lease = self.keys.batch_lease(batch_id)
        if not await self.client.set(lease, self.instance, nx=True, px=LEASE_MS):
            return
        try:
            await self.step(batch_id)
        finally:
            await self.client.eval(RELEASE_SCRIPT, 1, lease, self.instance)

    async def step(self, batch_id: str) -> None:
        fields = await self.store.fields(batch_id)
        batch = fields["object"]
        status = batch["status"]
        now = int(time.time())
        if fields.get("cancel") and status in ("validating", "in_progress"):
            batch.update(status="cancelling", cancelling_at=now)
            await self.store.save(batch)
            status = "cancelling"
        if status == "validating":
            batch.update(status="in_progress", in_progress_at=now)
            await self.store.save(batch)
            status = "in_progress"
        if status == "in_progress" and fields["cursor"] < fields["lines"]:
            await self._enqueue_slice(batch, fields)
            return
        if status in ("in_progress", "cancelling"):
            progress = await self.store.producer.progress(batch_id)
            finished = progress.done + progress.dead
            if finished < fields["inputs"]:
                return
            batch.update(status="finalizing", finalizing_at=now)
            await self.store.save(batch)
            status = "finalizing"
        if status == "finalizing":
            await self._finalize(batch, fields)

    async def _enqueue_slice(self, batch: dict, fields: dict[str, Any]) -> None:
        """The next slice of input lines as chunks of the batch's job, through the client's
        enqueue path; then the cursor. A slice sent again (a restart before the cursor was
        saved) is added and counted once: its ids and payloads are the same."""
        settings = self.gateway.settings
        producer = self.store.producer
        if await producer.backlog() >= settings.backlog_high_water:
            return  # backpressure: wait, as Producers do (without holding the runner)
        batch_id = batch["id"]
        cursor, offset, inputs = fields["cursor"], fields["offset"], fields["inputs"]
        chunks: list[Chunk] = []
        sent_lines = 0
        for end_of_line, raw in self.files.lines(batch["input_file_id"], offset):
            offset = end_of_line
            line = parse_line(raw, self.gateway)  # validated at upload: cannot fail here
            options = wire_options(self.gateway, "", line.dimensions)
            for text in line.texts:
                chunks.append(
                    options.apply(Chunk(id=str(inputs), text=text, job=batch_id, reply=batch_id))
                )
                inputs += 1
            sent_lines += 1
            if sent_lines >= LINES_PER_SLICE:
                break
        await producer.enqueue(chunks, job=batch_id)
        await self.client.hset(
            self.keys.batch(batch_id),
            mapping={"cursor": cursor + sent_lines, "offset": offset, "inputs": inputs},
        )
        self.wake.set()  # more to send: come back without waiting a tick

    async def _finalize(self, batch: dict, fields: dict[str, Any]) -> None:
        """Output and error files from the reply list; idempotent, so a restart redoes it."""
        batch_id = batch["id"]
        total_inputs = fields["inputs"]
        scratch = self.files.temp_path("vectors")
        reply_keys = ingest_reply_keys(self.keys, batch_id)
        answers = Answers(
            total_inputs,
            # on disk, not in memory: a batch can be large; a line that asked for fewer
            # dimensions got that many from the worker and fills the start of its row
            lambda count, width, dtype: np.lib.format.open_memmap(
                scratch, mode="w+", dtype="<f2", shape=(count, self.gateway.model.dim)
            ),
        )
        try:
            unreadable = await read_answers(self.client, reply_keys, answers, REPLY_PAGE)
            if unreadable:
                log.warning("bad replies in a batch", batch=batch_id, count=unreadable)
            failures = {index: str(error.reason) for index, error in answers.failures.items()}
            counts, output, errors = await asyncio.to_thread(
                self._write_files, batch, fields, answers.vectors, answers.succeeded, failures
            )
        finally:
            answers.vectors = None
            scratch.unlink(missing_ok=True)
        cancelled = bool(fields.get("cancel"))
        now = int(time.time())
        batch.update(
            status="cancelled" if cancelled else "completed",
            output_file_id=output,
            error_file_id=errors,
            request_counts=counts,
            **({"cancelled_at": now} if cancelled else {"completed_at": now}),
        )
        pipe = self.client.pipeline(transaction=True)
        pipe.hset(self.keys.batch(batch_id), "object", json.dumps(batch))
        pipe.srem(self.keys.batches_active, batch_id)
        await pipe.execute()
        # the reply lists are in their partitions' slots, not the batch records': apart (they
        # expire by themselves should this not happen)
        pipe = self.client.pipeline(transaction=False)
        for reply_key in reply_keys:
            pipe.delete(reply_key)
        await pipe.execute()
        log.info("batch finished", batch=batch_id, status=batch["status"], **counts)

    def _write_files(
        self,
        batch: dict,
        fields: dict[str, Any],
        vectors: np.ndarray | None,
        seen: np.ndarray,
        failures: dict[int, str],
    ) -> tuple[dict[str, int], str | None, str | None]:
        gateway = self.gateway
        output_path = self.files.temp_path("output")
        error_path = self.files.temp_path("errors")
        completed = failed = 0
        first = 0
        with output_path.open("w") as output, error_path.open("w") as errors:
            for number, (_, raw) in enumerate(self.files.lines(batch["input_file_id"])):
                line = parse_line(raw, gateway)
                request_id = f"req_{uuid.uuid4().hex}"
                record: dict[str, Any] = {
                    "id": f"batch_req_{uuid.uuid4().hex}",
                    "custom_id": line.custom_id,
                }
                if number >= fields["cursor"]:  # cancelled before it was sent
                    record.update(
                        response=None,
                        error={
                            "code": "batch_cancelled",
                            "message": "the batch was cancelled before this request was sent",
                        },
                    )
                    errors.write(json.dumps(record) + "\n")
                    failed += 1
                    continue
                span = range(first, first + len(line.texts))
                first += len(line.texts)
                if vectors is None or not all(seen[i] for i in span):
                    reasons = [
                        failures.get(i, "no result (see the dead-letter stream)")
                        for i in span
                        if not seen[i]
                    ]
                    record.update(
                        response={
                            "status_code": 500,
                            "request_id": request_id,
                            "body": {
                                "error": {
                                    "message": f"input could not be embedded: {reasons[0]}",
                                    "type": "server_error",
                                    "param": None,
                                    "code": "dead_lettered",
                                }
                            },
                        },
                        error=None,
                    )
                    errors.write(json.dumps(record) + "\n")
                    failed += 1
                    continue
                block = np.asarray(vectors[span.start : span.stop], dtype=np.float32)
                block = shape_vectors(block, line.dimensions, gateway.model.normalize)
                tokens = gateway.tokenizer.usage(line.texts)
                body = embeddings_response(gateway.served_name, block, line.encoding_format, tokens)
                record.update(
                    response={"status_code": 200, "request_id": request_id, "body": body},
                    error=None,
                )
                output.write(json.dumps(record) + "\n")
                completed += 1
        name = batch["id"]
        output_file = self.files.publish(output_path, f"{name}_output.jsonl", "batch_output")
        if failed:
            error_file = self.files.publish(error_path, f"{name}_error.jsonl", "batch_output")
        else:
            error_path.unlink()
            error_file = None
        counts = {"total": fields["lines"], "completed": completed, "failed": failed}
        return counts, output_file.id, error_file.id if error_file else None
