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
                               a restart adds nothing (each input id of a job is added once);
                               a tenant at its EMBEDFLEET_TENANT_MAX_BACKLOG gets what fits,
                               the rest on a later tick (the runner never waits for room)
    in_progress → finalizing   once the job's counters say every input is done or dead
    finalizing → completed     output and error files written from the reply lists (one per
                               partition; the client's collector, producer/replies.py)
    in_progress → expired      the completion window passed: its inputs no worker finished are
                               withdrawn; what finished is in the output file, the rest in the
                               error file (``batch_expired``)
    cancelling → cancelled     enqueueing stops, its inputs no worker finished are withdrawn;
                               what finished is written out, the rest is ``batch_cancelled``
    any → failed               the input file went away, or the batch keeps raising; its inputs
                               no worker finished are withdrawn

Withdrawn, as the gateway withdraws a request that timed out (producer/client.py, ``_withdraw``):
the entries are deleted from the ingest streams and the reply lists dropped, so nothing embeds
them for a caller who has gone, and nothing writes a reply list (EMBEDFLEET_JOB_REPLY_TTL_S,
7 days) nobody will read. They are acknowledged too, in the same step (``withdraw_job``): a worker
that had already read one then finds it acknowledged, and its acknowledgement script answers
nothing (shared/scripts/acknowledge.lua answers only what it acknowledged). A batch's chunks
also carry its expiry as their deadline, so a worker drops them once the window has passed
even while no gateway runs.

One batch's fault never holds up another: each batch's step runs on its own, and a batch that
raises is retried later with its reason counted (``faults``, ``last_fault`` in its hash) or
failed when retrying cannot help.

Every batch has an owner (gateway/auth.py), kept in its hash (``owner``) and its owner's index;
its output and error files are that owner's, and another owner's batch is a 404. An owner has
at most EMBEDFLEET_BATCH_MAX_ACTIVE_PER_OWNER batches running (``create_batch.lua`` counts and
records in one step).

The lease (EMBEDFLEET_BATCH_LEASE_MS) is renewed every third of its length while a step runs
(``renew_lease.lua``, only if still ours), and it is a fencing token: the batch is ended by
``end_batch.lua`` only if the lease still holds this step's token, its state and cursor are
saved by ``save_batch.lua`` on the same condition, and the output is published only after the
same check. The output and error files' ids are reserved in the batch's hash
before they are written, so a finalize run twice (a replica that lost its lease and one that
took it over) publishes one file under one id, whichever writes last.

Memory: a batch's vectors wait on its reply lists in Redis (EMBEDFLEET_BATCH_MAX_INPUTS bounds
them: about 1 KB each); finalize reads them REPLY_PAGE answers at a time into a file on disk
(a memory map), then writes the output one request line at a time. What the gateway holds is
one page of answers, one line's vectors (EMBEDFLEET_GATEWAY_MAX_INPUTS) and one line's text
(EMBEDFLEET_BATCH_MAX_LINE_BYTES), plus a flag per input.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, cast

import numpy as np
import redis.asyncio as aioredis
from pydantic import ValidationError
from redis.exceptions import RedisError

from embedfleet.gateway.auth import ANONYMOUS
from embedfleet.gateway.errors import APIError
from embedfleet.gateway.files import FileStore, bounded_lines, new_file_id
from embedfleet.gateway.inputs import (
    check_context,
    check_dimensions,
    prepare,
    unit_vectors,
)
from embedfleet.gateway.openai_api import EmbeddingRequest, embeddings_response
from embedfleet.gateway.state import Gateway, wire_options
from embedfleet.producer.client import Producer, TenantBacklogFullError
from embedfleet.producer.replies import Answers, ingest_reply_keys, read_answers
from embedfleet.shared import scripts
from embedfleet.shared.backlog import tenant_backlog
from embedfleet.shared.keys import Keys
from embedfleet.shared.logging import get_logger
from embedfleet.shared.protocol import (
    PAYLOAD_FIELD,
    Chunk,
    ChunkLimits,
    ProtocolError,
    decode_chunk,
)
from embedfleet.shared.redis_conn import as_str
from embedfleet.shared.settings import Settings

log = get_logger("embedfleet.gateway.batches")

ENDPOINT = "/v1/embeddings"
LINES_PER_SLICE = 500  # input lines enqueued per MULTI
REPLY_PAGE = 1000
TICK_S = 0.25
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
SHOWN_LINE_ERRORS = 100  # errors.data entries a failed batch keeps (its object is in Redis)
RETRY_MAX_S = 30.0  # a faulting batch is retried after TICK_S, doubling up to this
MAX_UNEXPECTED_FAULTS = 5  # consecutive unexplained errors before a batch is failed
SWEEP_EVERY_S = 10.0  # expired files and stale temporaries removed this often
WITHDRAW_PAGE = 1000  # ingest entries read per step when withdrawing a batch's inputs
RELEASE_SCRIPT = scripts.load("release_lease")  # only if it is still ours
RENEW_SCRIPT = scripts.load("renew_lease")  # only if it is still ours
CREATE_SCRIPT = scripts.load("create_batch")  # within the owner's limit of active batches
END_SCRIPT = scripts.load("end_batch")  # only with the lease's token: the fence
SAVE_SCRIPT = scripts.load("save_batch")  # the runner's writes, fenced the same way


@dataclass(frozen=True)
class BatchLine:
    custom_id: str
    texts: list[str]
    encoding_format: str
    dimensions: int | None


def parse_line(raw: bytes, gateway: Gateway, *, validating: bool = False) -> BatchLine:
    """One JSONL request line, validated as the online endpoint would; APIError says why not.
    The context check runs in the validating step only (``validating``): a line that passed it
    is never refused later, when the card may have become known."""
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
    check_dimensions(body.dimensions, card)
    texts = prepare(body.input, gateway.tokenizer, gateway.settings, "body.input")
    if validating and card is not None and not body.truncate:  # as online: refused, not cut
        check_context(texts, gateway.tokenizer, card.max_length, "body.input")
    return BatchLine(custom_id, texts, body.encoding_format, body.dimensions)


def batch_tenant(settings: Settings, owner: str, batch_id: str) -> str:
    """The tenant a batch is accounted to: its owner's (EMBEDFLEET_TENANT_MAP), else its job's
    (the batch id), else the default (shared/tenants.py)."""
    return settings.tenant_policy.resolve(owner=owner, job=batch_id)


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
        # bounded: a line over the cap (a file stored before it was lowered) is never held
        for number, raw in enumerate(bounded_lines(handle, settings.batch_max_line_bytes), 1):
            if raw is None:
                found.lines += 1
                bad_lines += 1
                if len(errors) < SHOWN_LINE_ERRORS:
                    errors.append(
                        line_error(
                            "line_too_large",
                            f"the line is over {settings.batch_max_line_bytes:,} bytes "
                            "(EMBEDFLEET_BATCH_MAX_LINE_BYTES)",
                            number,
                        )
                    )
                continue
            if not raw.strip():
                continue
            found.lines += 1
            try:
                line = parse_line(raw, gateway, validating=True)
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


def _entries_of_job(
    entries: Sequence[tuple[Any, Any]], job: str, limits: ChunkLimits
) -> list[bytes]:
    """The ids of the entries whose chunk belongs to ``job`` (decoded as a worker would), of a
    page of XRANGE's (entry id, fields) pairs."""
    ids = []
    for entry_id, fields in entries:
        try:
            chunk = decode_chunk((fields or {}).get(PAYLOAD_FIELD, b""), limits)
        except ProtocolError:  # not a chunk of any batch: a worker dead-letters it
            continue
        if chunk.job == job:
            ids.append(entry_id)
    return ids


async def withdraw_job(client: aioredis.Redis, keys: Keys, job: str, limits: ChunkLimits) -> int:
    """Take every entry of ``job`` out of the ingest streams (each partition's, every tenant's):
    acknowledged and deleted, a page at a time, in one MULTI per page (the stream and its group
    share a slot). An entry a worker has read and not yet acknowledged is acknowledged here, so
    the worker's own acknowledgement finds nothing and answers nothing. Returns how many."""
    withdrawn = 0
    for partition in keys.partitions_keys:
        tenants = sorted(as_str(t) for t in await client.smembers(partition.tenants))
        for stream in [partition.ingest, *(partition.ingest_for(t) for t in tenants)]:
            start = "-"
            while True:
                entries = await client.xrange(stream, start, "+", count=WITHDRAW_PAGE)
                if not entries:
                    break
                # decoding a page is CPU work: off the event loop, as the batch's other work
                ids = await asyncio.to_thread(_entries_of_job, entries, job, limits)
                if ids:
                    pipe = client.pipeline(transaction=True)
                    pipe.xack(stream, partition.group, *ids)
                    pipe.xdel(stream, *ids)
                    await pipe.execute()
                    withdrawn += len(ids)
                if len(entries) < WITHDRAW_PAGE:
                    break
                start = "(" + as_str(cast("bytes", entries[-1][0]))
    return withdrawn


class BatchStore:
    """Batch records in Redis: the Batch object (JSON) plus the runner's cursor fields (which
    the runner writes itself, under its lease: BatchRunner._save)."""

    def __init__(self, producer: Producer) -> None:
        self.producer = producer  # job counters are the client's to read (summed over partitions)
        self.client = producer.client
        self.keys = producer.keys

    async def create(
        self,
        batch: dict,
        lines: int,
        owner: str = ANONYMOUS,
        output_expiry_s: int | None = None,
        *,
        max_active: int = 0,
    ) -> bool:
        """Record a new batch of ``owner``; False (nothing recorded) when the owner already has
        ``max_active`` batches running (0: no limit). ``output_expiry_s``: its output files'
        expiry (OpenAI's ``output_expires_after``), unset for the default."""
        batch["request_counts"]["total"] = lines
        batch_id = batch["id"]
        mapping: dict[str, Any] = {
            "object": json.dumps(batch),
            "owner": owner,
            "lines": lines,
            "cursor": 0,
            "offset": 0,
            "inputs": 0,
            **({"output_expiry_s": output_expiry_s} if output_expiry_s else {}),
        }
        keys = self.keys
        created = await self.client.eval(
            CREATE_SCRIPT,
            5,
            keys.batch(batch_id),
            keys.batches,
            keys.batches_active,
            keys.owner_batches(owner),
            keys.owner_batches_active(owner),
            batch_id,
            time.time(),
            max_active,
            *(item for pair in mapping.items() for item in pair),
        )
        return bool(created)

    async def fields(self, batch_id: str, owner: str | None = None) -> dict[str, Any]:
        """The batch's hash; 404 if it is missing or (given ``owner``) another owner's."""
        raw = await self.client.hgetall(self.keys.batch(batch_id))
        fields: dict[str, Any] = {as_str(key): value for key, value in raw.items()}
        fields["owner"] = fields["owner"].decode() if "owner" in fields else ANONYMOUS
        if not raw or (owner is not None and fields["owner"] != owner):
            raise APIError(
                404, f"no batch with id {batch_id!r}", param="batch_id", code="batch_not_found"
            )
        fields["object"] = json.loads(fields["object"])
        for name in ("lines", "cursor", "offset", "inputs"):
            fields[name] = int(fields.get(name, 0))
        return fields

    async def get(self, batch_id: str, owner: str | None = None) -> dict:
        """The Batch object, with live request_counts from the job counters while it runs."""
        fields = await self.fields(batch_id, owner)
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

    async def request_cancel(self, batch_id: str, owner: str | None = None) -> dict:
        batch = await self.get(batch_id, owner)
        if batch["status"] in ("validating", "in_progress"):
            await self.client.hset(self.keys.batch(batch_id), "cancel", int(time.time()))
        return batch

    async def page(self, owner: str, after: str | None, limit: int) -> tuple[list[dict], bool]:
        """One page of ``owner``'s batches, newest first."""
        index = self.keys.owner_batches(owner)
        members = cast("list[bytes]", await self.client.zrevrange(index, 0, -1))  # no scores
        ids = [as_str(i) for i in members]
        if after is not None and after in ids:
            ids = ids[ids.index(after) + 1 :]
        batches = [await self.get(batch_id) for batch_id in ids[:limit]]
        return batches, len(ids) > limit


Outcome = Literal["completed", "cancelled", "expired"]


class InputFileGone(Exception):
    """The batch's input file was deleted or expired: nothing more can be read or written."""


class LeaseLost(Exception):
    """This replica's lease on a batch expired and may be another's: it must not end the batch
    or publish its output (the replica that holds the lease does)."""


@dataclass
class Lease:
    key: str
    token: str  # this step's own: a later step of the same replica has another
    lost: bool = False


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
        self._leases: dict[str, Lease] = {}  # the batches this replica's steps hold now

    def stop(self) -> None:
        self._stopping.set()
        self.wake.set()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        while not self._stopping.is_set():
            try:
                active = sorted(
                    as_str(m) for m in await self.client.smembers(self.keys.batches_active)
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
        lease = Lease(self.keys.batch_lease(batch_id), f"{self.instance}:{uuid.uuid4().hex}")
        lease_ms = self.gateway.settings.batch_lease_ms
        if not await self.client.set(lease.key, lease.token, nx=True, px=lease_ms):
            return
        self._leases[batch_id] = lease
        renewer = asyncio.create_task(self._renew(batch_id, lease, lease_ms))
        try:
            try:
                await self.step(batch_id)
            except LeaseLost:  # the replica that took the lease over runs the batch
                log.warning("batch lease lost; its new holder runs the batch", batch=batch_id)
            except Exception as error:
                await self._on_fault(batch_id, error)
            else:
                self._faults.pop(batch_id, None)
                self._retry_at.pop(batch_id, None)
        finally:
            renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await renewer
            self._leases.pop(batch_id, None)
            await self.client.eval(RELEASE_SCRIPT, 1, lease.key, lease.token)

    async def _renew(self, batch_id: str, lease: Lease, lease_ms: int) -> None:
        """Keep the lease while the step runs: every third of its length, so two renewals can
        fail (a Redis blip) before it expires. Stops once the lease is another's."""
        while True:
            await asyncio.sleep(lease_ms / 3000)  # the renewal period, not a wait for an event
            try:
                renewed = await self._still_ours(lease, lease_ms)
            except RedisError as error:
                log.warning(
                    "batch lease renewal failed; retrying", batch=batch_id, error=repr(error)
                )
                continue
            if not renewed:
                log.warning("batch lease expired while its step ran", batch=batch_id)
                return

    async def _still_ours(self, lease: Lease, lease_ms: int) -> bool:
        """Renew the lease if it is still ours; whether it was."""
        renewed = await self.client.eval(RENEW_SCRIPT, 1, lease.key, lease.token, lease_ms)
        lease.lost = lease.lost or not renewed
        return not lease.lost

    async def _save(self, batch_id: str, mapping: dict[str, Any]) -> None:
        """Fields of the batch's hash written while this step's lease holds; LeaseLost (and
        nothing written) once it is another's."""
        lease = self._lease(batch_id)
        saved = await self.client.eval(
            SAVE_SCRIPT,
            2,
            lease.key,
            self.keys.batch(batch_id),
            lease.token,
            *(item for pair in mapping.items() for item in pair),
        )
        if not saved:
            lease.lost = True
            raise LeaseLost(batch_id)

    def _lease(self, batch_id: str) -> Lease:
        lease = self._leases.get(batch_id)
        if lease is None:  # a step always runs under its lease
            raise LeaseLost(batch_id)
        return lease

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
            await self._save(batch_id, {"expire": now})
            fields["expire"] = now
        if fields.get("expire") and running:
            if status == "validating":  # nothing was sent: there is nothing to write out
                await self._end(batch, "expired", counts=batch["request_counts"])
            else:
                await self._withdraw(batch_id)
                await self._finalize(batch, fields, "expired")
            return
        if fields.get("cancel") and status in ("validating", "in_progress"):
            batch.update(status="cancelling", cancelling_at=now)
            await self._save(batch_id, {"object": json.dumps(batch)})
            status = "cancelling"
        if status == "validating":
            path = self._input_path(batch)
            # the card (the model's maximum length) as the workers last published it; a batch
            # created before any worker started is checked without it, and the worker cuts
            await self.gateway.model_card()
            found = await asyncio.to_thread(validate_file, path, self.gateway)
            if found.errors:
                counts = {"total": found.lines, "completed": 0, "failed": 0}
                await self._fail(batch, found.errors, counts, sent=False)
                return
            batch.update(status="in_progress", in_progress_at=now)
            batch["request_counts"]["total"] = found.lines
            await self._save(batch_id, {"object": json.dumps(batch), "lines": found.lines})
            fields["lines"] = found.lines
            status = "in_progress"
        if status == "in_progress" and fields["cursor"] < fields["lines"]:
            await self._enqueue_slice(batch, fields)
            return
        if status == "in_progress":
            # a batch whose input file went away cannot be written out: it fails now (its
            # inputs withdrawn), not once its inputs were embedded for nothing
            self._input_path(batch)
            if not await self._all_finished(batch_id, fields):
                return
        if status == "cancelling":
            # nothing more is answered: what finished is on the reply lists now
            await self._withdraw(batch_id)
        if status in ("in_progress", "cancelling"):
            batch.update(status="finalizing", finalizing_at=now)
            await self._save(batch_id, {"object": json.dumps(batch)})
            status = "finalizing"
        if status == "finalizing":
            await self._finalize(
                batch, fields, "cancelled" if fields.get("cancel") else "completed"
            )

    async def _all_finished(self, batch_id: str, fields: dict[str, Any]) -> bool:
        """Whether every line is sent and every input sent is done or dead, by the job's
        counters."""
        if fields["cursor"] < fields["lines"]:
            return False
        progress = await self.store.producer.progress(batch_id)  # summed over the partitions
        return progress.done + progress.dead >= fields["inputs"]

    def _input_path(self, batch: dict) -> Path:
        """The input file's data; InputFileGone once it was deleted or has expired."""
        if not self.files.exists(batch["input_file_id"]):
            raise InputFileGone(batch["input_file_id"])
        return self.files.data_path(batch["input_file_id"])

    async def _fail(
        self,
        batch: dict,
        errors: list[dict[str, Any]],
        counts: dict[str, int] | None = None,
        *,
        sent: bool = True,
    ) -> None:
        """The batch ends ``failed`` with ``errors``; what it had sent and no worker finished
        is withdrawn (``sent``: False when it has sent nothing). ``counts``: its request_counts
        (default: those it had reached)."""
        if counts is None:
            counts = (await self.store.get(batch["id"]))["request_counts"]
        if sent:
            await self._withdraw(batch["id"])
        batch["errors"] = {"object": "list", "data": errors}
        await self._end(batch, "failed", counts=counts)

    async def _withdraw(self, batch_id: str) -> None:
        """The batch's inputs that no worker has finished taken out of the ingest streams
        (``withdraw_job``); its reply lists are dropped by ``_end``. Run again, it finds what is
        left: a step that raised half-way is retried from its start."""
        withdrawn = await withdraw_job(
            self.client, self.keys, batch_id, self.gateway.settings.chunk_limits
        )
        if withdrawn:
            log.info("batch inputs withdrawn", batch=batch_id, entries=withdrawn)

    async def _end(
        self,
        batch: dict,
        status: str,
        counts: dict[str, int],
        output: str | None = None,
        errors: str | None = None,
    ) -> None:
        """Record the final state, take the batch off the active sets, drop its reply list;
        only while this step's lease holds (LeaseLost otherwise: nothing is written)."""
        batch_id = batch["id"]
        lease = self._lease(batch_id)
        batch.update(
            status=status,
            output_file_id=output,
            error_file_id=errors,
            request_counts=counts,
            **{f"{status}_at": int(time.time())},
        )
        keys = self.keys
        owner_raw = await self.client.hget(keys.batch(batch_id), "owner")
        owner = as_str(owner_raw) if owner_raw else ANONYMOUS
        ended = await self.client.eval(
            END_SCRIPT,
            4,
            lease.key,
            keys.batch(batch_id),
            keys.batches_active,
            keys.owner_batches_active(owner),
            lease.token,
            json.dumps(batch),
            batch_id,
        )
        if not ended:
            lease.lost = True
            raise LeaseLost(batch_id)
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
        saved, or the rest of one its tenant had no room for) is added and counted once: its
        ids and payloads are the same.

        The runner handles one batch after another, so it never waits for room under the
        batch's tenant's EMBEDFLEET_TENANT_MAX_BACKLOG (the enqueue would wait up to
        EMBEDFLEET_TENANT_BACKLOG_WAIT_S, and every other batch with it): a slice is at most
        what the tenant has room for, the enqueue adds what fits without waiting, and the
        lines whose inputs all went in are saved as sent; the rest is sent on a later tick."""
        settings = self.gateway.settings
        producer = self.store.producer
        batch_id = batch["id"]
        # one read of the backlog for the slice: the high-water mark's figure (the fullest
        # partition, as Producer.backlog reads it) and the tenant's entries
        backlogs = await producer.partition_backlogs()
        if max(backlog.total for backlog in backlogs) >= settings.backlog_high_water:
            return  # backpressure: wait, as Producers do (without holding the runner)
        tenants = settings.tenant_policy
        tenant = batch_tenant(settings, fields["owner"], batch_id)  # once for the slice
        limit = tenants.backlog_limit(tenant)
        room: int | None = None
        if limit is not None:
            room = limit - tenant_backlog(backlogs, tenants.wire(tenant))
            if room <= 0:
                return  # the tenant at its EMBEDFLEET_TENANT_MAX_BACKLOG: a later tick
        cursor, offset, inputs = fields["cursor"], fields["offset"], fields["inputs"]
        chunks: list[Chunk] = []
        ends: list[tuple[int, int]] = []  # per line read: its end's offset, inputs up to it
        for end_of_line, raw in self.files.lines(batch["input_file_id"], offset):
            line = parse_line(raw, self.gateway)  # passed the validating step
            options = wire_options(None, line.dimensions)
            for text in line.texts:
                chunk = Chunk(
                    id=str(inputs),
                    text=text,
                    job=batch_id,
                    reply=batch_id,
                    # past the window nobody waits for it: a worker drops it unanswered
                    deadline_ms=batch["expires_at"] * 1000,
                )
                chunks.append(options.apply(chunk))
                inputs += 1
            ends.append((end_of_line, inputs))
            if len(ends) >= LINES_PER_SLICE or (room is not None and len(chunks) >= room):
                break
        try:
            await producer.enqueue(chunks, job=batch_id, tenant=tenant, backlog_wait_s=0)
        except TenantBacklogFullError as full:
            # backpressure, not a fault (another producer of the tenant took the room, or a
            # partition's share of it was less): the lines whose inputs all went in are sent
            sent = [end for end in ends if end[1] - fields["inputs"] <= full.handled]
            log.debug(
                "batch waits for room under its tenant's backlog limit",
                batch=batch_id,
                tenant=tenant,
                lines_sent=len(sent),
                lines_left=len(ends) - len(sent),
            )
            if sent:
                offset, inputs = sent[-1]
                await self._save(
                    batch_id, {"cursor": cursor + len(sent), "offset": offset, "inputs": inputs}
                )
            return  # the rest on a later tick: the other batches go on meanwhile
        offset, inputs = ends[-1] if ends else (offset, inputs)
        await self._save(
            batch_id, {"cursor": cursor + len(ends), "offset": offset, "inputs": inputs}
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
        output_id, error_id = await self._file_ids(batch_id)
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
                    counts = await asyncio.to_thread(
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
                    # a replica whose lease expired while it wrote publishes nothing (and
                    # were it to, under the same ids: one file each still)
                    if not await self._still_ours(
                        self._lease(batch_id), self.gateway.settings.batch_lease_ms
                    ):
                        raise LeaseLost(batch_id)
                    output, errors = await asyncio.to_thread(
                        self._publish,
                        batch,
                        fields,
                        output_path,
                        error_path,
                        (output_id, error_id if counts["failed"] else None),
                    )
            finally:
                answers.vectors = None  # the memmap's file is open until then
        await self._end(batch, outcome, counts, output, errors)

    async def _file_ids(self, batch_id: str) -> tuple[str, str]:
        """The ids the batch's output and error files get, reserved in its hash on the first
        finalize, so that every finalize of the batch (a retry, another replica) uses them."""
        key = self.keys.batch(batch_id)
        pipe = self.client.pipeline(transaction=True)
        pipe.hsetnx(key, "output_id", new_file_id(time.time_ns()))
        pipe.hsetnx(key, "error_id", new_file_id(time.time_ns()))
        pipe.hmget(key, ["output_id", "error_id"])
        *_, (output_id, error_id) = await pipe.execute()
        return output_id.decode(), error_id.decode()

    def _publish(
        self,
        batch: dict,
        fields: dict[str, Any],
        output_path: Path,
        error_path: Path,
        ids: tuple[str, str | None],
    ) -> tuple[str, str | None]:
        """The written output (and error file, given its id) published under the reserved
        ids as the batch owner's files; their ids."""
        name = batch["id"]
        expiry = fields.get("output_expiry_s")
        expires_after_s = int(expiry) if expiry else self.gateway.settings.files_default_expiry_s
        keep = expires_after_s or None  # 0: kept until deleted
        output_id, error_id = ids
        owner = fields["owner"]
        self.files.publish(
            output_path,
            f"{name}_output.jsonl",
            "batch_output",
            keep,
            owner=owner,
            file_id=output_id,
        )
        if error_id is not None:
            self.files.publish(
                error_path,
                f"{name}_error.jsonl",
                "batch_output",
                keep,
                owner=owner,
                file_id=error_id,
            )
        return output_id, error_id

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
    ) -> dict[str, int]:
        """The output and error lines written to their temporary files; the request counts."""
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
                if outcome != "completed" and missing and not any(i in failures for i in missing):
                    # withdrawn unfinished: expired or cancelled, as the requests never sent
                    record.update(
                        response=None,
                        error={
                            "code": f"batch_{ended}",
                            "message": "the batch's completion window ended before this "
                            "request finished; send it again in a new batch"
                            if outcome == "expired"
                            else "the batch was cancelled before this request finished",
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
                assert card is not None and vectors is not None  # (else all were missing)
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
        return {"total": fields["lines"], "completed": completed, "failed": failed}
