"""EMBEDFLEET_MIN_REPLICAS on a real Redis Cluster whose slot moves under the producer.

3 masters + 3 replicas of Debian's redis-server. The producer's slot map still names the old
owner when its batch goes out: the old owner answers MOVED (a finished move) or ASK (a move
under way) and the batch's writes land on the new owner. The new owner's only replica is
stopped (SIGSTOP), so nothing written there can be confirmed: a producer that reports the batch
sent before that replica is back has confirmed writes that no replica holds (the WAIT it
counted ran on the old owner, for writes it never made). The move is made to meet the batch in
the one moment a finished move still catches it (see SlotMovingProducer).
"""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Callable, Iterable, Iterator

import pytest

from embedfleet.producer import Producer
from embedfleet.producer.backlog_waits import BacklogWaits
from embedfleet.producer.client import ReplicasNotConfirmedError
from embedfleet.server import isolated_settings
from embedfleet.shared.keys import Keys, key_slot
from embedfleet.shared.protocol import Chunk
from embedfleet.shared.retry import OutageListener
from embedfleet.shared.settings import Settings
from loadtest.local_cluster import LocalCluster

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def cluster() -> Iterator[LocalCluster]:
    with LocalCluster(masters=3, replicas_per_master=1) as running:
        yield running


class Outages:
    """The producer's outage listener: set once a batch is being re-sent."""

    def __init__(self) -> None:
        self.down = asyncio.Event()
        self.errors: list[BaseException] = []

    def redis_down(self, server: str, error: BaseException, give_up_after_s: float) -> None:
        self.errors.append(error)
        self.down.set()

    def redis_back(self, server: str, down_s: float) -> None:
        pass


def _waits_on(cluster: LocalCluster, port: int) -> int:
    """How many WAITs the node on ``port`` has run since its stats were reset."""
    with contextlib.closing(cluster.client(port)) as client:
        stats = client.info("commandstats")
    return int(stats.get("cmdstat_wait", {}).get("calls", 0))


def _replica_stream_length(cluster: LocalCluster, port: int, stream: str) -> int:
    with contextlib.closing(cluster.client(port)) as client:
        client.execute_command("READONLY")
        return int(client.xlen(stream))


class SlotMovingProducer(Producer):
    """A producer whose next batch meets a slot move in the worst moment: after its
    backpressure check (an XLEN, whose MOVED would refresh the client's slot map) and before
    its pipeline goes out."""

    before_next_batch: Callable[[], None] | None = None

    def __init__(self, settings: Settings, *, on_outage: OutageListener) -> None:
        super().__init__(settings, on_outage=on_outage)
        self._enqueuer.waits = _WaitsThenDisturb(self)


class _WaitsThenDisturb(BacklogWaits):
    """The producer's backpressure check (producer/backlog_waits.py), then its
    ``before_next_batch``, once."""

    def __init__(self, producer: SlotMovingProducer) -> None:
        super().__init__(producer)
        self.producer = producer

    async def wait_for_room(self, partitions: Iterable[Keys], tenants: set[str | None]) -> None:
        await super().wait_for_room(partitions, tenants)
        if self.producer.before_next_batch is not None:
            disturb, self.producer.before_next_batch = self.producer.before_next_batch, None
            await asyncio.to_thread(disturb)


@pytest.mark.parametrize("redirect", ["moved", "ask"])
async def test_a_batch_redirected_to_a_new_owner_is_confirmed_by_the_new_owners_replica(
    cluster: LocalCluster, redirect: str
) -> None:
    settings: Settings = isolated_settings(
        cluster.url,
        f"m{uuid.uuid4().hex[:8]}",
        min_replicas=1,
        min_replicas_timeout_ms=200,
        redis_retry_s=120,
        partitions=2,  # keys with hash tags: each partition's keys share a slot
    )
    partition = settings.keys.partition_for("first")
    # five more chunks, all in the first one's partition: all in the slot that moves
    ids = [i for i in (f"c{n}" for n in range(100)) if settings.keys.partition_for(i) == partition]
    slot = key_slot(partition.ingest)
    outages = Outages()
    async with SlotMovingProducer(settings, on_outage=outages) as producer:
        # the producer learns the slot's owner, and writes the job's first chunk there
        assert await producer.enqueue([Chunk(id="first", text="one")], job="j") == 1
        old = cluster.master_of(slot)
        new = next(m for m in cluster.masters() if m.port != old.port)
        [replica] = cluster.replicas_of(new)

        def move() -> None:
            # finished (the old owner answers MOVED) or under way (ASK); the new owner's only
            # replica stops, so nothing written on the new owner can be confirmed
            cluster.move_slot(slot, new.port, finish=redirect == "moved")
            with contextlib.closing(cluster.client(new.port)) as client:
                client.config_resetstat()
            cluster.pause(replica.port)

        producer.before_next_batch = move
        try:
            chunks = [Chunk(id=i, text=f"text {i}") for i in ids[:5]]
            sending = asyncio.create_task(producer.enqueue(chunks, job="j"))
            down = asyncio.create_task(outages.down.wait())
            await asyncio.wait({sending, down}, return_when=asyncio.FIRST_COMPLETED)
            assert not sending.done(), (
                f"after {redirect.upper()}, the batch was reported sent while the only replica "
                "of the node now holding it was stopped: nothing confirmed its writes"
            )
            assert isinstance(outages.errors[0], ReplicasNotConfirmedError), outages.errors
        finally:
            cluster.resume(replica.port)
        assert await sending == 5
        down.cancel()
    # the new owner ran the WAITs, and its replica holds every entry the producer reported sent
    assert _waits_on(cluster, new.port) >= 2
    if redirect == "ask":  # a replica serves reads of a slot its master owns
        cluster.finish_slot_move(slot, new.port)
    assert _replica_stream_length(cluster, replica.port, partition.ingest) == 6
