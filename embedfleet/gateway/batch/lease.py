"""The leases that keep gateway replicas apart on a batch, and the writes they fence.

A replica's step on a batch runs under the batch's lease (EMBEDFLEET_BATCH_LEASE_MS): taken with
SET NX, renewed every third of its length while the step runs (``renew_lease.lua``, only if
still ours), released after (``release_lease.lua``, the same condition). The lease is a fencing
token: the runner's writes to the batch's hash (``save_batch.lua``) and its end
(``end_batch.lua``) happen only while the lease holds this step's token; otherwise LeaseLost,
and nothing is written (the replica that holds the lease runs the batch).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from embedfleet.gateway.auth import ANONYMOUS
from embedfleet.gateway.batch import SCRIPTS_PACKAGE
from embedfleet.producer.replies import ingest_reply_keys
from embedfleet.shared import scripts
from embedfleet.shared.keys import Keys
from embedfleet.shared.logging import get_logger
from embedfleet.shared.redis_conn import as_str

log = get_logger("embedfleet.gateway.batches")

RELEASE_SCRIPT = scripts.load("release_lease", SCRIPTS_PACKAGE)  # only if it is still ours
RENEW_SCRIPT = scripts.load("renew_lease", SCRIPTS_PACKAGE)  # only if it is still ours
END_SCRIPT = scripts.load("end_batch", SCRIPTS_PACKAGE)  # only with the lease's token: the fence
SAVE_SCRIPT = scripts.load(
    "save_batch", SCRIPTS_PACKAGE
)  # the runner's writes, fenced the same way


class LeaseLost(Exception):
    """This replica's lease on a batch expired and may be another's: it must not end the batch
    or publish its output (the replica that holds the lease does)."""


@dataclass
class Lease:
    key: str
    token: str  # this step's own: a later step of the same replica has another
    lost: bool = False


class BatchLeases:
    """This replica's leases on batches (one per step running) and the writes they fence."""

    def __init__(self, client: aioredis.Redis, keys: Keys, lease_ms: int) -> None:
        self.client = client
        self.keys = keys
        self.lease_ms = lease_ms
        self.instance = uuid.uuid4().hex  # this replica, in its leases' tokens
        self._leases: dict[str, Lease] = {}  # the batches this replica's steps hold now

    @contextlib.asynccontextmanager
    async def held(self, batch_id: str) -> AsyncIterator[bool]:
        """The batch's lease for a step, renewed while it runs and released after; yields
        False (and holds nothing) while another replica holds it."""
        lease = Lease(self.keys.batch_lease(batch_id), f"{self.instance}:{uuid.uuid4().hex}")
        if not await self.client.set(lease.key, lease.token, nx=True, px=self.lease_ms):
            yield False
            return
        self._leases[batch_id] = lease
        renewer = asyncio.create_task(self._renew(batch_id, lease))
        try:
            yield True
        finally:
            renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await renewer
            self._leases.pop(batch_id, None)
            await self.client.eval(RELEASE_SCRIPT, 1, lease.key, lease.token)

    async def _renew(self, batch_id: str, lease: Lease) -> None:
        """Keep the lease while the step runs: every third of its length, so two renewals can
        fail (a Redis blip) before it expires. Stops once the lease is another's."""
        while True:
            # the renewal period, not a wait for an event
            await asyncio.sleep(self.lease_ms / 3000)
            try:
                renewed = await self.still_ours(lease, self.lease_ms)
            except RedisError as error:
                log.warning(
                    "batch lease renewal failed; retrying", batch=batch_id, error=repr(error)
                )
                continue
            if not renewed:
                log.warning("batch lease expired while its step ran", batch=batch_id)
                return

    async def still_ours(self, lease: Lease, lease_ms: int) -> bool:
        """Renew the lease if it is still ours; whether it was."""
        renewed = await self.client.eval(RENEW_SCRIPT, 1, lease.key, lease.token, lease_ms)
        lease.lost = lease.lost or not renewed
        return not lease.lost

    async def check(self, batch_id: str) -> None:
        """LeaseLost unless the step's lease on the batch is still ours (renewed if it is)."""
        if not await self.still_ours(self.lease(batch_id), self.lease_ms):
            raise LeaseLost(batch_id)

    def lease(self, batch_id: str) -> Lease:
        lease = self._leases.get(batch_id)
        if lease is None:  # a step always runs under its lease
            raise LeaseLost(batch_id)
        return lease

    async def save(self, batch_id: str, mapping: dict[str, Any]) -> None:
        """Fields of the batch's hash written while this step's lease holds; LeaseLost (and
        nothing written) once it is another's."""
        lease = self.lease(batch_id)
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

    async def end(
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
        lease = self.lease(batch_id)
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
