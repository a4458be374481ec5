"""OpenAI's Batch API over the ingest stream: a batch is a job whose chunks answer on a list.

State lives in Redis (``{ns}:batch:<id>``: the Batch object and the enqueue cursor) and files in
EMBEDFLEET_FILES_DIR, so any gateway replica can serve any batch and a restart loses none. The
``BatchRunner`` of every replica moves active batches along under a lease (only one works on a
batch at a time):

    validating → in_progress   every line's form checked, the caps too, and each request as
                               the online endpoint would: a request it refuses (an input over
                               the model's context, bad ``dimensions``, ...) is never sent, and
                               is answered in the error file (gateway/batch/lines.py)
    validating → failed        a malformed file (not JSON, a line without its custom_id or
                               with another url or method, a custom_id used twice, a model not
                               served), too many requests or inputs: ``errors`` names them
    in_progress                the input file's inputs enqueued in slices, through the client's
                               one enqueue path (partitions, backpressure, job counters); the
                               cursor is saved after each slice, and a slice sent again after
                               a restart adds nothing (each input id of a job is added once);
                               a tenant at its EMBEDFLEET_TENANT_MAX_BACKLOG gets what fits,
                               the rest on a later tick (the runner never waits for room)
    in_progress → finalizing   once the job's counters say every input is done or dead
    finalizing → completed     output and error files written from the reply lists (one per
                               partition; the client's collector, producer/replies.py), and
                               the refused requests' errors in the error file
    in_progress → expired      the completion window passed: its inputs no worker finished are
                               withdrawn; what finished is in the output file, the rest in the
                               error file (``batch_expired``)
    cancelling → cancelled     enqueueing stops, its inputs no worker finished are withdrawn;
                               what finished is written out, the rest is ``batch_cancelled``
    any → failed               the input file went away, or the batch keeps raising; its inputs
                               no worker finished are withdrawn

Withdrawn, as the gateway withdraws a request that timed out (producer/queries.py,
``Queries._withdraw``): the entries are deleted from the ingest streams and the reply lists
dropped, so nothing embeds them for a caller who has gone, and nothing writes a reply list
(EMBEDFLEET_JOB_REPLY_TTL_S, 7 days) nobody will read. They are acknowledged too, in the same
step (``withdraw_job``): a worker that had already read one then finds it acknowledged, and its
acknowledgement script answers nothing (shared/scripts/acknowledge.lua answers only what it
acknowledged). A batch's chunks also carry its expiry as their deadline, so a worker drops them
once the window has passed even while no gateway runs.

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

Here: the records (``BatchStore``), the runner's life cycle (``BatchRunner``: the loop, each
batch's step and faults) and the slices it sends (``BatchSlices``). Beside it: the input file's
request lines (gateway/batch/lines.py), the leases and the writes they fence
(gateway/batch/lease.py), the output and error files (gateway/batch/output.py).

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
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from embedfleet.gateway.auth import ANONYMOUS
from embedfleet.gateway.batch import SCRIPTS_PACKAGE
from embedfleet.gateway.batch.files import FileStore
from embedfleet.gateway.batch.lease import BatchLeases, LeaseLost
from embedfleet.gateway.batch.lines import (
    ENDPOINT,
    BatchLine,
    Refused,
    line_error,
    parse_line,
    validate_file,
)
from embedfleet.gateway.batch.output import BatchOutput, InputFileGone, batch_usage, input_path_of
from embedfleet.gateway.errors import APIError
from embedfleet.gateway.state import Gateway, wire_options
from embedfleet.producer.client import Producer, TenantBacklogFullError
from embedfleet.shared import scripts
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

LINES_PER_SLICE = 500  # input lines enqueued per MULTI
TICK_S = 0.25
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
RETRY_MAX_S = 30.0  # a faulting batch is retried after TICK_S, doubling up to this
MAX_UNEXPECTED_FAULTS = 5  # consecutive unexplained errors before a batch is failed
SWEEP_EVERY_S = 10.0  # expired files and stale temporaries removed this often
WITHDRAW_PAGE = 1000  # ingest entries read per step when withdrawing a batch's inputs
# a batch is recorded only within its owner's limit of active batches
CREATE_SCRIPT = scripts.load("create_batch", SCRIPTS_PACKAGE)


def batch_tenant(settings: Settings, owner: str, batch_id: str) -> str:
    """The tenant a batch is accounted to: its owner's (EMBEDFLEET_TENANT_MAP), else its job's
    (the batch id), else the default (shared/tenants.py)."""
    return settings.tenant_policy.resolve(owner=owner, job=batch_id)


def new_batch(
    input_file_id: str, completion_window: str, metadata: dict | None, window_s: int, model: str
) -> dict:
    """A Batch object in ``validating`` for ``model`` (the gateway's own: the one model a batch
    serves); it expires ``window_s`` after now. Its ``usage`` counts nothing until its output is
    written."""
    now = int(time.time())
    return {
        "id": f"batch_{uuid.uuid4().hex}",
        "object": "batch",
        "endpoint": ENDPOINT,
        "model": model,
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
        "usage": batch_usage(0),
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
        fields["refused"] = Refused.of(fields.get("refused"))  # set in the validating step
        for name in ("lines", "cursor", "offset", "inputs"):
            fields[name] = int(fields.get(name, 0))
        return fields

    async def get(self, batch_id: str, owner: str | None = None) -> dict:
        """The Batch object, with live request_counts from the job counters while it runs."""
        fields = await self.fields(batch_id, owner)
        batch = fields["object"]
        refused: Refused = fields["refused"]
        refused_lines = refused.count()
        if batch["status"] in ACTIVE and (fields["inputs"] or refused_lines):
            progress = await self.producer.progress(batch_id)
            done, dead = progress.done, progress.dead
            # the lines sent so far, the refused ones (never sent, failed) left out
            sent = fields["cursor"] - refused.count(below=fields["cursor"])
            # exact when every line has one input (the usual batch); otherwise inputs are
            # scaled to lines until the output is written and the exact counts are known
            scale = sent / fields["inputs"] if fields["inputs"] else 0.0
            batch["request_counts"] = {
                "total": fields["lines"],
                "completed": int(done * scale),
                "failed": refused_lines + min(int(np.ceil(dead * scale)), sent),
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


class BatchRunner:
    """Moves every active batch along; one per gateway replica, leases keep them apart."""

    def __init__(self, gateway: Gateway, files: FileStore, store: BatchStore) -> None:
        self.gateway = gateway
        self.files = files
        self.store = store
        self.client = gateway.client
        self.keys = gateway.settings.keys
        self._stopping = asyncio.Event()
        self.wake = asyncio.Event()
        # a step's parts: its lease and fenced writes, the slices it sends, the files it writes
        self.leases = BatchLeases(self.client, self.keys, gateway.settings.batch_lease_ms)
        self.instance = self.leases.instance
        self.slices = BatchSlices(gateway, files, store.producer, self.leases, self.wake)
        self.output = BatchOutput(gateway, files, self.leases)
        # per batch: consecutive faults and when to try it again (this replica's view; the
        # counted reasons are in the batch's hash for operators)
        self._faults: dict[str, int] = {}
        self._retry_at: dict[str, float] = {}
        self._foreign: set[str] = set()  # batches of another files folder, warned about once
        self._next_sweep = 0.0

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
        async with self.leases.held(batch_id) as ours:
            if not ours:  # another replica's step runs it now
                return
            try:
                await self.step(batch_id)
            except LeaseLost:  # the replica that took the lease over runs the batch
                log.warning("batch lease lost; its new holder runs the batch", batch=batch_id)
            except Exception as error:
                await self._on_fault(batch_id, error)
            else:
                self._faults.pop(batch_id, None)
                self._retry_at.pop(batch_id, None)

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
        """One move of the batch along its life cycle (this module's docstring draws it)."""
        fields = await self.store.fields(batch_id)
        batch = fields["object"]
        status = batch["status"]
        if self._in_another_folder(batch_id, batch):
            return
        now = int(time.time())
        if await self._expire(batch_id, batch, fields, now):
            return
        if fields.get("cancel") and status in ("validating", "in_progress"):
            batch.update(status="cancelling", cancelling_at=now)
            await self.leases.save(batch_id, {"object": json.dumps(batch)})
            status = "cancelling"
        if status == "validating":
            if not await self._validate(batch_id, batch, fields, now):
                return
            status = "in_progress"
        if status == "in_progress" and fields["cursor"] < fields["lines"]:
            await self.slices.send(batch, fields)
            return
        if status == "in_progress":
            # a batch whose input file went away cannot be written out: it fails now (its
            # inputs withdrawn), not once its inputs were embedded for nothing
            input_path_of(self.files, batch)
            if not await self._all_finished(batch_id, fields):
                return
        if status == "cancelling":
            # nothing more is answered: what finished is on the reply lists now
            await self._withdraw(batch_id)
        if status in ("in_progress", "cancelling"):
            batch.update(status="finalizing", finalizing_at=now)
            await self.leases.save(batch_id, {"object": json.dumps(batch)})
            status = "finalizing"
        if status == "finalizing":
            await self.output.finalize(
                batch, fields, "cancelled" if fields.get("cancel") else "completed"
            )

    def _in_another_folder(self, batch_id: str, batch: dict) -> bool:
        """Whether the batch's input file is in another gateway's files folder: the gateways
        that have the file run it (failing it here for a file this folder never held would be
        wrong). Said once per batch."""
        if not self.files.in_another_folder(batch["input_file_id"]):
            return False
        if batch_id not in self._foreign:
            self._foreign.add(batch_id)
            log.warning(
                "a batch's input file is in another gateway's files folder; this gateway "
                "leaves the batch to those that have it. Every gateway of a namespace must "
                "share one EMBEDFLEET_FILES_DIR (one volume, ReadWriteMany)",
                batch=batch_id,
                input_file_id=batch["input_file_id"],
                files_dir=str(self.files.root),
            )
        return True

    async def _expire(self, batch_id: str, batch: dict, fields: dict[str, Any], now: int) -> bool:
        """A running batch past its completion window is marked to expire (unless it is done
        just in time: then it completes) and ended ``expired``; whether it was."""
        running = batch["status"] in ("validating", "in_progress")
        if (
            running
            and not fields.get("expire")
            and now >= batch["expires_at"]
            and not await self._all_finished(batch_id, fields)  # done just in time: completed
        ):
            await self.leases.save(batch_id, {"expire": now})
            fields["expire"] = now
        if not (fields.get("expire") and running):
            return False
        if batch["status"] == "validating":  # nothing was sent: there is nothing to write out
            await self.leases.end(batch, "expired", counts=batch["request_counts"])
        else:
            await self._withdraw(batch_id)
            await self.output.finalize(batch, fields, "expired")
        return True

    async def _validate(self, batch_id: str, batch: dict, fields: dict[str, Any], now: int) -> bool:
        """The validating step: the input file checked (validate_file), then the batch
        ``in_progress`` with its lines and the lines refused on their own; False when the file
        failed it (the batch is ``failed``)."""
        path = input_path_of(self.files, batch)
        # the card (the model's maximum length) as the workers last published it; a batch
        # created before any worker started is checked without it, and the worker cuts
        await self.gateway.model_card()
        found = await asyncio.to_thread(validate_file, path, self.gateway)
        if found.errors:
            counts = {"total": found.lines, "completed": 0, "failed": 0}
            await self._fail(batch, found.errors, counts, sent=False)
            return False
        batch.update(status="in_progress", in_progress_at=now)
        batch["request_counts"]["total"] = found.lines
        await self.leases.save(
            batch_id,
            {
                "object": json.dumps(batch),
                "lines": found.lines,
                "refused": bytes(found.refused.bits),
            },
        )
        fields.update(lines=found.lines, refused=found.refused)
        return True

    async def _all_finished(self, batch_id: str, fields: dict[str, Any]) -> bool:
        """Whether every line is sent and every input sent is done or dead, by the job's
        counters."""
        if fields["cursor"] < fields["lines"]:
            return False
        progress = await self.store.producer.progress(batch_id)  # summed over the partitions
        return progress.done + progress.dead >= fields["inputs"]

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
        await self.leases.end(batch, "failed", counts=counts)

    async def _withdraw(self, batch_id: str) -> None:
        """The batch's inputs that no worker has finished taken out of the ingest streams
        (``withdraw_job``); its reply lists are dropped at its end (``BatchLeases.end``). Run
        again, it finds what is left: a step that raised half-way is retried from its start."""
        withdrawn = await withdraw_job(
            self.client, self.keys, batch_id, self.gateway.settings.chunk_limits
        )
        if withdrawn:
            log.info("batch inputs withdrawn", batch=batch_id, entries=withdrawn)


@dataclass(eq=False)
class BatchSlices:
    """Sends the input lines of the batches this replica runs, a slice per step (``send``)."""

    gateway: Gateway
    files: FileStore
    producer: Producer
    leases: BatchLeases
    wake: asyncio.Event  # set when more is to send: the runner comes back without a tick

    async def send(self, batch: dict, fields: dict[str, Any]) -> None:
        """The next slice of input lines as chunks of the batch's job, through the client's
        enqueue path; then the cursor. A slice sent again (a restart before the cursor was
        saved, or the rest of one its tenant had no room for) is added and counted once: its
        ids and payloads are the same.

        The runner handles one batch after another, so it never waits for room under the
        batch's tenant's EMBEDFLEET_TENANT_MAX_BACKLOG (the enqueue would wait up to
        EMBEDFLEET_TENANT_BACKLOG_WAIT_S, and every other batch with it): a slice is at most
        what the tenant has room for, the enqueue adds what fits without waiting, and the
        lines whose inputs all went in are saved as sent; the rest is sent on a later tick."""
        batch_id = batch["id"]
        tenant = batch_tenant(self.gateway.settings, fields["owner"], batch_id)  # once a slice
        room = await self._room(tenant)
        if room == 0:
            return  # no room now: a later tick (the runner never waits)
        part = self._read_slice(batch, fields, room)
        try:
            if part.chunks:  # (a slice of refused lines only sends nothing)
                await self.producer.enqueue(
                    part.chunks, job=batch_id, tenant=tenant, backlog_wait_s=0
                )
        except TenantBacklogFullError as full:
            # backpressure, not a fault (another producer of the tenant took the room, or a
            # partition's share of it was less): the lines whose inputs all went in are sent
            sent = [end for end in part.ends if end[1] - fields["inputs"] <= full.handled]
            log.debug(
                "batch waits for room under its tenant's backlog limit",
                batch=batch_id,
                tenant=tenant,
                lines_sent=len(sent),
                lines_left=len(part.ends) - len(sent),
            )
            if sent:
                await self._save_cursor(batch_id, fields, sent, part.newly_refused)
            return  # the rest on a later tick: the other batches go on meanwhile
        await self._save_cursor(batch_id, fields, part.ends, part.newly_refused)
        self.wake.set()  # more to send: come back without waiting a tick

    async def _room(self, tenant: str) -> int | None:
        """How many inputs the slice may send: None for no limit, 0 for none now (the fleet's
        backlog at its high-water mark, or the tenant at its EMBEDFLEET_TENANT_MAX_BACKLOG)."""
        settings = self.gateway.settings
        # one read of the backlog for the slice: the high-water mark's figure (the fullest
        # partition, as Producer.backlog reads it) and the tenant's entries
        backlogs = await self.producer.partition_backlogs()
        if max(backlog.total for backlog in backlogs) >= settings.backlog_high_water:
            return 0  # backpressure: wait, as Producers do (without holding the runner)
        return (await self.producer.room_for(tenant, backlogs)).left

    def _read_slice(self, batch: dict, fields: dict[str, Any], room: int | None) -> Slice:
        """The input lines after the cursor, up to LINES_PER_SLICE or the inputs ``room`` has
        space for: the chunks of those to send, and each line's end. A line found refused
        now is marked in ``fields["refused"]``."""
        refused: Refused = fields["refused"]
        refused_before = refused.count()
        part = Slice()
        inputs = fields["inputs"]
        for end_of_line, raw in self.files.lines(batch["input_file_id"], fields["offset"]):
            number = fields["cursor"] + len(part.ends)
            line = None
            if number not in refused:
                try:
                    line = parse_line(raw, self.gateway)  # its form passed the validating step
                except APIError:
                    # passed validating without the card, which the checks now have (a batch
                    # created before any worker published it): refused on its own too
                    refused.add(number)
            if line is not None:  # (else never sent: answered in the error file)
                part.chunks.extend(chunks_of(line, batch, first_id=inputs))
                inputs += len(line.inputs)
            part.ends.append((end_of_line, inputs))
            if len(part.ends) >= LINES_PER_SLICE:
                break
            if line is not None and room is not None and len(part.chunks) >= room:
                break
        # the refused lines found in this slice are saved with its cursor
        if refused.count() > refused_before:
            part.newly_refused = {"refused": bytes(refused.bits)}
        return part

    async def _save_cursor(
        self,
        batch_id: str,
        fields: dict[str, Any],
        sent: list[tuple[int, int]],
        newly_refused: dict[str, bytes],
    ) -> None:
        """The cursor moved past the ``sent`` lines (their ends), with the lines refused."""
        offset, inputs = sent[-1] if sent else (fields["offset"], fields["inputs"])
        await self.leases.save(
            batch_id,
            {
                "cursor": fields["cursor"] + len(sent),
                "offset": offset,
                "inputs": inputs,
                **newly_refused,
            },
        )


@dataclass
class Slice:
    """One slice of a batch's input lines: the chunks to send, and per line read its end's
    offset and the inputs up to it (the cursor saved once they are sent)."""

    chunks: list[Chunk] = field(default_factory=list)
    ends: list[tuple[int, int]] = field(default_factory=list)
    newly_refused: dict[str, bytes] = field(default_factory=dict)


def chunks_of(line: BatchLine, batch: dict, first_id: int) -> list[Chunk]:
    """A request line's inputs as chunks of the batch's job, their ids counted from
    ``first_id`` (so a slice sent again gives the same ids); an image's bytes as an image
    chunk (no text)."""
    options = wire_options(None, line.dimensions, window_overlap=line.window_overlap)
    return [
        options.apply(
            Chunk(
                id=str(first_id + offset),
                text=item if isinstance(item, str) else "",
                image=item if isinstance(item, bytes) else None,
                job=batch["id"],
                reply=batch["id"],
                # past the window nobody waits for it: a worker drops it unanswered
                deadline_ms=batch["expires_at"] * 1000,
            )
        )
        for offset, item in enumerate(line.inputs)
    ]
