"""OpenAI's Batch API over the ingest stream: a batch is a job whose chunks answer on a list.

State lives in Redis (``{ns}:batch:<id>``: the Batch object and the enqueue cursor) and files in
EMBEDFLEET_FILES_DIR, so any gateway replica can serve any batch and a restart loses none. The
``BatchRunner`` of every replica moves active batches along under a lease (only one works on a
batch at a time):

    validating → in_progress   every line checked as the online endpoint would, the caps too
    validating → failed        a bad line, too many requests or inputs: ``errors`` names them
    in_progress                the input file's inputs enqueued in slices, through the client's
                               one enqueue path (partitions, backpressure, job counters); the
                               cursor is saved after each slice, and a slice sent again after
                               a restart adds nothing (each input id of a job is added once)
    in_progress → finalizing   once the job's counters say every input is done or dead
    finalizing → completed     output and error files written from the reply lists (one per
                               partition; the client's collector, producer/replies.py)
    in_progress → expired      the completion window passed: what finished is in the output
                               file, the rest in the error file (``batch_expired``)
    cancelling → cancelled     enqueueing stops; what was sent is finished and written out
    any → failed               the input file went away, or the batch keeps raising

One batch's fault never holds up another: each batch's step runs on its own, and a batch that
raises is retried later with its reason counted (``faults``, ``last_fault`` in its hash) or
failed when retrying cannot help.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
from pydantic import ValidationError
from redis.exceptions import RedisError

from embedfleet.gateway.errors import APIError
from embedfleet.gateway.files import FileStore
from embedfleet.gateway.inputs import (
    check_dimensions,
    prepare,
    unit_vectors,
)
from embedfleet.gateway.openai_api import EmbeddingRequest, embeddings_response
from embedfleet.gateway.state import Gateway, wire_options
from embedfleet.producer.client import Producer
from embedfleet.producer.replies import Answers, ingest_reply_keys, read_answers
from embedfleet.shared import scripts
from embedfleet.shared.logging import get_logger
from embedfleet.shared.protocol import Chunk

log = get_logger("embedfleet.gateway.batches")

ENDPOINT = "/v1/embeddings"
LINES_PER_SLICE = 500  # input lines enqueued per MULTI
REPLY_PAGE = 1000
LEASE_MS = 120_000
TICK_S = 0.25
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
SHOWN_LINE_ERRORS = 100  # errors.data entries a failed batch keeps (its object is in Redis)
RETRY_MAX_S = 30.0  # a faulting batch is retried after TICK_S, doubling up to this
MAX_UNEXPECTED_FAULTS = 5  # consecutive unexplained errors before a batch is failed
SWEEP_EVERY_S = 10.0  # expired files and stale temporaries removed this often
RELEASE_SCRIPT = scripts.load("release_lease")  # only if it is still ours


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
        raise APIError(400, f"not JSON: {error}", code="invalid_json_line") from None
    if not isinstance(line, dict):
        raise APIError(400, "each line must be a JSON object", code="invalid_json_line")
    custom_id = line.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        raise APIError(
            400,
            "'custom_id' must be a non-empty string",
            param="custom_id",
            code="invalid_request",
        )
    if line.get("method") != "POST":
        raise APIError(400, "'method' must be \"POST\"", param="method", code="invalid_request")
    if line.get("url") != ENDPOINT:
        raise APIError(
            400,
            f"'url' must be {ENDPOINT!r} (the only batch endpoint)",
            param="url",
            code="url_mismatch",
        )
    try:
        body = EmbeddingRequest.model_validate(line.get("body"))
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(p) for p in first.get("loc", ()))
        raise APIError(
            400, f"body.{where}: {first.get('msg')}", param="body", code="invalid_request"
        ) from None
    gateway.check_model(body.model, "body.model")
    card = gateway.known_card  # None before any worker published: the worker checks
    check_dimensions(body.dimensions, card.dim if card is not None else None)
    texts = prepare(body.input, gateway.tokenizer, gateway.settings, "body.input")
    return BatchLine(custom_id, texts, body.encoding_format, body.dimensions)


def line_error(
    code: str, message: str, line: int | None = None, param: str | None = None
) -> dict[str, Any]:
    """One entry of a failed batch's ``errors.data`` (OpenAI's BatchError)."""
    return {"code": code, "message": message, "param": param, "line": line}


@dataclass
class Validation:
    """What the validating step found in an input file."""

    lines: int = 0
    inputs: int = 0
    errors: list[dict[str, Any]] | None = None


def validate_file(path: Path, gateway: Gateway) -> Validation:
    """Every request line of a batch input file checked, and the batch caps; blocking (run it
    in a thread). Line numbers count from 1 over the file as written, blank lines included."""
    settings = gateway.settings
    found = Validation()
    errors: list[dict[str, Any]] = []
    bad_lines = 0
    seen_ids: set[str] = set()
    with path.open("rb") as handle:
        for number, raw in enumerate(handle, start=1):
            if not raw.strip():
                continue
            found.lines += 1
            try:
                line = parse_line(raw, gateway)
            except APIError as error:
                bad_lines += 1
                if len(errors) < SHOWN_LINE_ERRORS:
                    errors.append(
                        line_error(
                            error.code or "invalid_request", error.message, number, error.param
                        )
                    )
                continue
            found.inputs += len(line.texts)
            if line.custom_id in seen_ids:
                bad_lines += 1
                if len(errors) < SHOWN_LINE_ERRORS:
                    errors.append(
                        line_error(
                            "duplicate_custom_id",
                            f"custom_id {line.custom_id!r} is used twice; each request needs "
                            "its own",
                            number,
                            "custom_id",
                        )
                    )
            seen_ids.add(line.custom_id)
    caps: list[dict[str, Any]] = []
    if not found.lines:
        caps.append(line_error("empty_file", "the input file has no request lines"))
    if found.lines > settings.batch_max_lines:
        caps.append(
            line_error(
                "too_many_tasks",
                f"the batch has {found.lines:,} requests, over the {settings.batch_max_lines:,} "
                "one batch may hold (EMBEDFLEET_BATCH_MAX_LINES); split the file into several "
                "batches",
            )
        )
    if found.inputs > settings.batch_max_inputs:
        caps.append(
            line_error(
                "too_many_tasks",
                f"the batch has {found.inputs:,} embedding inputs, over the "
                f"{settings.batch_max_inputs:,} one batch may hold "
                "(EMBEDFLEET_BATCH_MAX_INPUTS); split the file into several batches",
            )
        )
    if bad_lines > len(errors):
        errors.append(
            line_error(
                "invalid_request",
                f"{bad_lines - len(errors):,} more invalid lines are not listed; fix those above "
                "and validate again",
            )
        )
    if caps or errors:
        found.errors = caps + errors
    return found


def new_batch(
    input_file_id: str, completion_window: str, metadata: dict | None, window_s: int
) -> dict:
    """A Batch object in ``validating``; it expires ``window_s`` after now."""
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
        "expires_at": now + window_s,
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

    async def create(self, batch: dict, lines: int, output_expiry_s: int | None = None) -> None:
        """Record a new batch; ``output_expiry_s``: its output files' expiry (OpenAI's
        ``output_expires_after``), unset for the default."""
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
                **({"output_expiry_s": output_expiry_s} if output_expiry_s else {}),
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


Outcome = Literal["completed", "cancelled", "expired"]


class InputFileGone(Exception):
    """The batch's input file was deleted or expired: nothing more can be read or written."""


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
        # per batch: consecutive faults and when to try it again (this replica's view; the
        # counted reasons are in the batch's hash for operators)
        self._faults: dict[str, int] = {}
        self._retry_at: dict[str, float] = {}
        self._next_sweep = 0.0

    def stop(self) -> None:
        self._stopping.set()
        self.wake.set()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._stopping.is_set():
            try:
                active = sorted(
                    m.decode() for m in await self.client.smembers(self.keys.batches_active)
                )
            except Exception as error:  # Redis down: say so, keep trying
                log.warning("batch runner cannot list batches; retrying", error=repr(error))
                active = []
            for batch_id in active:
                if self._stopping.is_set():
                    break
                if self._retry_at.get(batch_id, 0.0) > loop.time():
                    continue
                try:
                    await self._with_lease(batch_id)
                except Exception as error:  # even recording the fault failed (Redis down)
                    self._back_off(batch_id)
                    log.warning("batch step failed", batch=batch_id, error=repr(error))
            for gone in set(self._faults) - set(active):
                self._faults.pop(gone, None)
                self._retry_at.pop(gone, None)
            if loop.time() >= self._next_sweep:
                self._next_sweep = loop.time() + SWEEP_EVERY_S
                await self._sweep()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.wake.wait(), TICK_S)
            self.wake.clear()

    async def _sweep(self) -> None:
        try:
            expired, stale = await asyncio.to_thread(self.files.sweep)
        except OSError as error:
            log.warning("file sweep failed; retrying later", error=repr(error))
            return
        if expired or stale:
            log.info("files swept", expired_files=expired, stale_temporaries=stale)

    def _back_off(self, batch_id: str) -> int:
        """Count one more fault of this batch; it waits a doubling delay before its next try."""
        faults = self._faults.get(batch_id, 0) + 1
        self._faults[batch_id] = faults
        delay = min(RETRY_MAX_S, TICK_S * 2 ** (faults - 1))
        self._retry_at[batch_id] = asyncio.get_running_loop().time() + delay
        return faults

    async def _with_lease(self, batch_id: str) -> None:
        lease = self.keys.batch_lease(batch_id)
        if not await self.client.set(lease, self.instance, nx=True, px=LEASE_MS):
            return
        try:
            try:
                await self.step(batch_id)
            except Exception as error:
                await self._on_fault(batch_id, error)
            else:
                self._faults.pop(batch_id, None)
                self._retry_at.pop(batch_id, None)
        finally:
            await self.client.eval(RELEASE_SCRIPT, 1, lease, self.instance)

    async def _on_fault(self, batch_id: str, error: Exception) -> None:
        """One batch's step raised: fail the batch when retrying cannot help, else count the
        reason and retry it later. Other batches are not held up either way."""
        faults = self._back_off(batch_id)
        transient = isinstance(error, RedisError | OSError)
        reason = "redis" if isinstance(error, RedisError) else "disk" if transient else "error"
        log.warning(
            "batch step failed; retrying it",
            batch=batch_id,
            reason=reason,
            faults=faults,
            error=repr(error),
        )
        try:
            fields = await self.store.fields(batch_id)
        except APIError:  # its record is gone: there is nothing left to run
            await self.client.srem(self.keys.batches_active, batch_id)
            return
        except (KeyError, TypeError, ValueError):  # its record is unreadable
            fields = None
        pipe = self.client.pipeline(transaction=True)
        pipe.hincrby(self.keys.batch(batch_id), "faults", 1)
        pipe.hset(self.keys.batch(batch_id), "last_fault", f"{reason}: {error!r}")
        await pipe.execute()
        if fields is None:
            if faults >= MAX_UNEXPECTED_FAULTS:
                await self.client.srem(self.keys.batches_active, batch_id)
                log.error(
                    "batch record unreadable; no longer run (HGETALL its key to inspect it)",
                    batch=batch_id,
                    key=self.keys.batch(batch_id),
                )
            return
        batch = fields["object"]
        if isinstance(error, InputFileGone) or not self.files.exists(batch["input_file_id"]):
            await self._fail(
                batch,
                [
                    line_error(
                        "input_file_missing",
                        f"the input file {batch['input_file_id']} was deleted or expired while "
                        "the batch ran; upload it again and create a new batch",
                        param="input_file_id",
                    )
                ],
            )
            return
        # Redis and disk faults (disk full) pass, or the completion window ends the batch;
        # an unexplained error that keeps coming is a bug that retrying will not fix
        if not transient and faults >= MAX_UNEXPECTED_FAULTS:
            await self._fail(
                batch,
                [
                    line_error(
                        "batch_failed",
                        f"the gateway could not run this batch ({error!r}, {faults} times); "
                        "create it again, and report the error if it repeats",
                    )
                ],
            )

    async def step(self, batch_id: str) -> None:
        fields = await self.store.fields(batch_id)
        batch = fields["object"]
        status = batch["status"]
        now = int(time.time())
        running = status in ("validating", "in_progress")
        if (
            running
            and not fields.get("expire")
            and now >= batch["expires_at"]
            and not await self._all_finished(batch_id, fields)  # done just in time: completed
        ):
            await self.client.hset(self.keys.batch(batch_id), "expire", now)
            fields["expire"] = now
        if fields.get("expire") and running:
            if status == "validating":  # nothing was sent: there is nothing to write out
                await self._end(batch, "expired", counts=batch["request_counts"])
            else:
                await self._finalize(batch, fields, "expired")
            return
        if fields.get("cancel") and status in ("validating", "in_progress"):
            batch.update(status="cancelling", cancelling_at=now)
            await self.store.save(batch)
            status = "cancelling"
        if status == "validating":
            path = self._input_path(batch)
            found = await asyncio.to_thread(validate_file, path, self.gateway)
            if found.errors:
                counts = {"total": found.lines, "completed": 0, "failed": 0}
                await self._fail(batch, found.errors, counts)
                return
            batch.update(status="in_progress", in_progress_at=now)
            batch["request_counts"]["total"] = found.lines
            await self.store.save(batch, lines=found.lines)
            fields["lines"] = found.lines
            status = "in_progress"
        if status == "in_progress" and fields["cursor"] < fields["lines"]:
            await self._enqueue_slice(batch, fields)
            return
        if status in ("in_progress", "cancelling"):
            if not await self._all_finished(batch_id, fields):
                return
            batch.update(status="finalizing", finalizing_at=now)
            await self.store.save(batch)
            status = "finalizing"
        if status == "finalizing":
            await self._finalize(
                batch, fields, "cancelled" if fields.get("cancel") else "completed"
            )

    async def _all_finished(self, batch_id: str, fields: dict[str, Any]) -> bool:
        """Whether every input sent is done or dead, by the job's counters (all lines sent,
        unless the batch is being cancelled)."""
        if fields["object"]["status"] != "cancelling" and fields["cursor"] < fields["lines"]:
            return False
        progress = await self.store.producer.progress(batch_id)  # summed over the partitions
        return progress.done + progress.dead >= fields["inputs"]

    def _input_path(self, batch: dict) -> Path:
        """The input file's data; InputFileGone once it was deleted or has expired."""
        if not self.files.exists(batch["input_file_id"]):
            raise InputFileGone(batch["input_file_id"])
        return self.files.data_path(batch["input_file_id"])

    async def _fail(
        self, batch: dict, errors: list[dict[str, Any]], counts: dict[str, int] | None = None
    ) -> None:
        """The batch ends ``failed`` with ``errors``; what it had sent is abandoned.
        ``counts``: its request_counts (default: those it had reached)."""
        if counts is None:
            counts = (await self.store.get(batch["id"]))["request_counts"]
        batch["errors"] = {"object": "list", "data": errors}
        await self._end(batch, "failed", counts=counts)

    async def _end(
        self,
        batch: dict,
        status: str,
        counts: dict[str, int],
        output: str | None = None,
        errors: str | None = None,
    ) -> None:
        """Record the final state, take the batch off the active set, drop its reply list."""
        batch.update(
            status=status,
            output_file_id=output,
            error_file_id=errors,
            request_counts=counts,
            **{f"{status}_at": int(time.time())},
        )
        pipe = self.client.pipeline(transaction=True)
        pipe.hset(self.keys.batch(batch["id"]), "object", json.dumps(batch))
        pipe.srem(self.keys.batches_active, batch["id"])
        await pipe.execute()
        # the reply lists are in their partitions' slots, not the batch records': apart (they
        # expire by themselves should this not happen)
        pipe = self.client.pipeline(transaction=False)
        for reply_key in ingest_reply_keys(self.keys, batch["id"]):
            pipe.delete(reply_key)
        await pipe.execute()
        log.info("batch finished", batch=batch["id"], status=status, **counts)

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
            line = parse_line(raw, self.gateway)  # passed the validating step
            options = wire_options(None, line.dimensions)
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

    async def _finalize(self, batch: dict, fields: dict[str, Any], outcome: Outcome) -> None:
        """Output and error files from the reply list; idempotent, so a restart redoes it.
        ``expired``: whatever has no result yet goes to the error file as ``batch_expired``."""
        batch_id = batch["id"]
        input_path = self._input_path(batch)
        total_inputs = fields["inputs"]
        # a worker answered if there are vectors: its card gives the rows' width (a line that
        # asked for fewer dimensions fills the start of its row)
        card = await self.gateway.model_card()
        with self.files.scratch("vectors") as scratch:
            answers = Answers(
                total_inputs,
                # on disk, not in memory: a batch can be large
                lambda count, width, dtype: np.lib.format.open_memmap(
                    scratch, mode="w+", dtype="<f2", shape=(count, card.dim if card else width)
                ),
            )
            unreadable = await read_answers(
                self.client, ingest_reply_keys(self.keys, batch_id), answers, REPLY_PAGE
            )
            if unreadable:
                log.warning("bad replies in a batch", batch=batch_id, count=unreadable)
            failures = {index: str(error.reason) for index, error in answers.failures.items()}
            try:
                with (
                    self.files.scratch("output") as output_path,
                    self.files.scratch("errors") as error_path,
                ):
                    counts, output, errors = await asyncio.to_thread(
                        self._write_files,
                        batch,
                        fields,
                        input_path,
                        answers.vectors,
                        answers.succeeded,
                        failures,
                        outcome,
                        output_path,
                        error_path,
                    )
            finally:
                answers.vectors = None  # the memmap's file is open until then
        await self._end(batch, outcome, counts, output, errors)

    def _write_files(
        self,
        batch: dict,
        fields: dict[str, Any],
        input_path: Path,
        vectors: np.ndarray | None,
        seen: np.ndarray,
        failures: dict[int, str],
        outcome: Outcome,
        output_path: Path,
        error_path: Path,
    ) -> tuple[dict[str, int], str | None, str | None]:
        gateway = self.gateway
        completed = failed = 0
        first = 0
        ended = "cancelled" if outcome == "cancelled" else "expired"
        with (
            output_path.open("w") as output,
            error_path.open("w") as errors,
            input_path.open("rb") as source,
        ):
            requests = (raw for raw in source if raw.strip())
            for number, raw in enumerate(requests):
                line = parse_line(raw, gateway)
                request_id = f"req_{uuid.uuid4().hex}"
                record: dict[str, Any] = {
                    "id": f"batch_req_{uuid.uuid4().hex}",
                    "custom_id": line.custom_id,
                }
                if number >= fields["cursor"]:  # cancelled or expired before it was sent
                    record.update(
                        response=None,
                        error={
                            "code": f"batch_{ended}",
                            "message": f"the batch was {ended} before this request was sent",
                        },
                    )
                    errors.write(json.dumps(record) + "\n")
                    failed += 1
                    continue
                span = range(first, first + len(line.texts))
                first += len(line.texts)
                missing = [i for i in span if vectors is None or not seen[i]]
                if outcome == "expired" and missing and not any(i in failures for i in missing):
                    record.update(
                        response=None,
                        error={
                            "code": "batch_expired",
                            "message": "the batch's completion window ended before this "
                            "request finished; send it again in a new batch",
                        },
                    )
                    errors.write(json.dumps(record) + "\n")
                    failed += 1
                    continue
                if missing:
                    reasons = [
                        failures.get(i, "no result (see the dead-letter stream)") for i in missing
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
                card = gateway.known_card  # read in _finalize, before the first vector
                assert card is not None
                block = vectors[span.start : span.stop, : line.dimensions or card.dim]
                block = unit_vectors(block, card.normalize)
                tokens = gateway.tokenizer.usage(line.texts, card.max_length)
                body = embeddings_response(gateway.served_name, block, line.encoding_format, tokens)
                record.update(
                    response={"status_code": 200, "request_id": request_id, "body": body},
                    error=None,
                )
                output.write(json.dumps(record) + "\n")
                completed += 1
        name = batch["id"]
        expiry = fields.get("output_expiry_s")
        expires_after_s = int(expiry) if expiry else self.gateway.settings.files_default_expiry_s
        keep = expires_after_s or None  # 0: kept until deleted
        output_file = self.files.publish(output_path, f"{name}_output.jsonl", "batch_output", keep)
        error_file = (
            self.files.publish(error_path, f"{name}_error.jsonl", "batch_output", keep)
            if failed
            else None
        )
        counts = {"total": fields["lines"], "completed": completed, "failed": failed}
        return counts, output_file.id, error_file.id if error_file else None
