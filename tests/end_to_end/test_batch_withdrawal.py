"""A Batch API batch that ends before its inputs are embedded takes them back (issue 40, point 5).

With the real `openai` SDK against a running gateway, a real worker process and a real Redis
server: a batch of 3,000 inputs whose worker is paused (SIGSTOP) after it has read some of them,
so that when the batch expires, is cancelled or fails, part of its inputs wait in the ingest
stream and part are held by the paused worker. Once the batch has ended, none of its entries may
be left in the ingest streams (nor pending in the group) and no reply list may exist; then the
worker is resumed, and it must answer none of them: the batch's job counters do not move and no
reply key is created again (it would live EMBEDFLEET_JOB_REPLY_TTL_S, 7 days, ~1 KB per input).

The completion window is shortened to 20 s (24 h in production) so the expiry is the same code
path in a test's time. Each test runs one gateway (every gateway's runner works every batch).
"""

from __future__ import annotations

import json
import signal
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import redis
import redis.asyncio as aioredis

from embedfleet.server import ServerProcess, isolated_settings
from embedfleet.shared.keys import Keys
from embedfleet.shared.protocol import (
    PAYLOAD_FIELD,
    Chunk,
    ProtocolError,
    decode_chunk,
    encode_chunk,
)
from embedfleet.shared.settings import Settings
from tests.conftest import WorkerProcess
from tests.gateway_support import (
    Gateway,
    module_fleet_settings,
    module_gateway,
    module_worker,
    running_gateway,
    wait_for_worker,
)

# the slow tier (make test-full, CI): starts processes or servers, or compiles a model
pytestmark = [pytest.mark.slow, pytest.mark.serial]  # serial: its assertions hold times (Makefile)

MODEL = "all-MiniLM-L6-v2"
COUNT = 3_000
FINAL = ("completed", "failed", "expired", "cancelled")
WINDOW_S = 20

fleet_settings = module_fleet_settings("bw")
worker = module_worker("bw")

gateway = module_gateway()


@pytest.fixture
def store(fleet_settings: Settings) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(fleet_settings.redis_url)
    yield client
    client.close()


def wait_for(what: str, predicate: Callable[[], bool], timeout: float = 120) -> None:
    """Until ``predicate()`` holds (a condition on the server's state), else AssertionError."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what}: not within {timeout:g}s"
        time.sleep(0.05)  # polling the server's own state, not waiting blind


def upload_batch(client: openai.OpenAI, tmp_path: Path) -> tuple[str, str]:
    """A batch of COUNT one-input requests of a few dozen words each (so that the worker takes
    seconds over them); (batch id, input file id)."""
    words = "a batch input long enough to keep a small cpu busy for a while, number"
    lines = [
        json.dumps(
            {
                "custom_id": f"r{n}",
                "method": "POST",
                "url": "/v1/embeddings",
                "body": {"model": MODEL, "input": f"{words} {n}: " + words * 3},
            }
        )
        for n in range(COUNT)
    ]
    path = tmp_path / "batch.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with path.open("rb") as handle:
        uploaded = client.files.create(file=handle, purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h"
    )
    return batch.id, uploaded.id


def ingest_streams(store: redis.Redis, keys: Keys) -> list[tuple[Keys, str]]:
    """Every ingest stream of every partition: the default tenant's and each named one's."""
    streams = []
    for partition in keys.partitions_keys:
        tenants = sorted(t.decode() for t in store.smembers(partition.tenants))
        streams += [(partition, s) for s in [partition.ingest, *map(partition.ingest_for, tenants)]]
    return streams


def queued(store: redis.Redis, keys: Keys, job: str) -> int:
    """The job's entries in the ingest streams (unread, or read and not acknowledged)."""
    count = 0
    for _, stream in ingest_streams(store, keys):
        for _, fields in store.xrange(stream):
            try:
                count += decode_chunk(fields[PAYLOAD_FIELD]).job == job
            except ProtocolError:
                continue
    return count


def pending(store: redis.Redis, keys: Keys) -> int:
    """Entries delivered to a worker and not acknowledged, over every ingest stream."""
    return sum(
        store.xpending(stream, partition.group)["pending"]
        for partition, stream in ingest_streams(store, keys)
    )


def reply_keys(store: redis.Redis, keys: Keys, job: str) -> dict[str, tuple[int, int]]:
    """The batch's reply lists that exist: key -> (answers, seconds to live)."""
    found = {}
    for partition in keys.partitions_keys:
        key = partition.reply(job)
        if store.exists(key):
            found[key] = (store.llen(key), store.ttl(key))
    return found


def answered(store: redis.Redis, keys: Keys, job: str) -> int:
    """What the workers acknowledged for the job (embedded or dead-lettered), all partitions."""
    total = 0
    for partition in keys.partitions_keys:
        done, dead = store.hmget(partition.job(job), "done", "dead")
        total += int(done or 0) + int(dead or 0)
    return total


def after_the_resumed_worker_caught_up(store: redis.Redis, keys: Keys) -> None:
    """Until the resumed worker has gone past whatever it held when paused: a few chunks of a
    job of their own, added after it, are acknowledged (windows are embedded in order)."""
    sentinel = f"sentinel-{uuid.uuid4().hex[:8]}"
    for n in range(3):
        chunk = Chunk(id=f"{sentinel}:{n}", text=f"sentinel text {n}", job=sentinel)
        store.xadd(keys.partition_for(chunk.id).ingest, {PAYLOAD_FIELD: encode_chunk(chunk)})
    wait_for("the sentinel chunks embedded", lambda: answered(store, keys, sentinel) == 3, 300)


def pause_holding_some(worker: WorkerProcess, store: redis.Redis, keys: Keys) -> None:
    """SIGSTOP the worker while it holds some inputs. Seen holding some, it may still
    acknowledge them before the signal lands (a slow CPU finishing its window): then it is
    resumed and caught again, until stopped (its state in /proc) with some held."""
    while True:
        wait_for("the worker holds some inputs", lambda: pending(store, keys) > 0)
        worker.send_signal(signal.SIGSTOP)
        wait_for("the worker stopped", lambda: _state(worker.popen.pid) in ("T", "t"))
        if pending(store, keys) > 0:  # a stopped process acknowledges nothing more
            return
        worker.send_signal(signal.SIGCONT)


def _state(pid: int) -> str:
    """A process's state letter (``T``: stopped), from /proc/<pid>/stat."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0]


def run_and_end(
    client: openai.OpenAI,
    store: redis.Redis,
    keys: Keys,
    worker: WorkerProcess,
    tmp_path: Path,
    end: Callable[[str, str], None],
) -> dict[str, Any]:
    """The scenario: the batch sent, the worker paused once it holds some of it, ``end(batch,
    input file)`` ends the batch; the figures at its end and after the worker resumed."""
    batch_id, file_id = upload_batch(client, tmp_path)
    pause_holding_some(worker, store, keys)
    try:
        wait_for(
            "every input sent",
            lambda: queued(store, keys, batch_id) + answered(store, keys, batch_id) >= COUNT,
        )
        figures: dict[str, Any] = {"held": pending(store, keys)}
        end(batch_id, file_id)
        deadline = time.monotonic() + WINDOW_S + 60
        while (batch := client.batches.retrieve(batch_id)).status not in FINAL:
            if time.monotonic() > deadline:
                break  # figures taken anyway: the assertions below say what is wrong
            time.sleep(0.1)  # polling the batch's state, not waiting blind
        figures.update(
            status=batch.status,
            left=queued(store, keys, batch_id),
            pending=pending(store, keys),
            replies=reply_keys(store, keys, batch_id),
            answered=answered(store, keys, batch_id),
        )
    finally:
        worker.send_signal(signal.SIGCONT)
    after_the_resumed_worker_caught_up(store, keys)
    figures.update(
        answered_after=answered(store, keys, batch_id),
        replies_after=reply_keys(store, keys, batch_id),
        left_after=queued(store, keys, batch_id),
    )
    print(f"batch {batch_id}: {figures}")
    return figures


def assert_withdrawn(figures: dict[str, Any], status: str) -> None:
    assert figures["held"] > 0  # the paused worker held some when the batch ended
    assert figures["status"] == status, figures
    assert figures["left"] == 0 and figures["pending"] == 0, figures
    assert figures["replies"] == {}, figures
    # resumed, the worker answered none of what it held or what was queued
    assert figures["answered_after"] == figures["answered"], figures
    assert figures["replies_after"] == {} and figures["left_after"] == 0, figures


# ``scenario(client, end)``: run_and_end on this module's fleet
Scenario = Callable[[openai.OpenAI, Callable[[str, str], None]], dict[str, Any]]


@pytest.fixture
def scenario(
    store: redis.Redis, fleet_settings: Settings, worker: WorkerProcess, tmp_path: Path
) -> Scenario:
    def run(client: openai.OpenAI, end: Callable[[str, str], None]) -> dict[str, Any]:
        return run_and_end(client, store, fleet_settings.keys, worker, tmp_path, end)

    return run


def test_an_expired_batch_withdraws_its_queued_inputs(gateway: Gateway, scenario: Scenario) -> None:
    with gateway(batch_completion_window_s=WINDOW_S) as client:
        figures = scenario(client, lambda *_: None)
    assert_withdrawn(figures, "expired")


def test_a_cancelled_batch_withdraws_its_queued_inputs(
    gateway: Gateway, scenario: Scenario
) -> None:
    with gateway() as client:
        figures = scenario(client, lambda batch_id, _: client.batches.cancel(batch_id) and None)
    assert_withdrawn(figures, "cancelled")


def test_a_failed_batch_withdraws_its_queued_inputs(gateway: Gateway, scenario: Scenario) -> None:
    """The input file deleted while the batch runs fails it (``input_file_missing``)."""
    with gateway() as client:
        figures = scenario(client, lambda _, file_id: client.files.delete(file_id) and None)
    assert_withdrawn(figures, "failed")


async def test_a_withdrawn_entry_dead_lettered_by_its_worker_gets_no_reply(
    settings: Settings, client: aioredis.Redis
) -> None:
    """A worker that dead-letters an entry someone else has acknowledged and deleted meanwhile
    (``withdraw_job`` of an ended batch, a 504'd request's ``_withdraw``) must not create the
    caller's reply key again (it would live EMBEDFLEET_JOB_REPLY_TTL_S, 7 days, read by nobody):
    its error reply is written only for what its own acknowledgement acknowledged, as the
    success path's (shared/scripts/acknowledge.lua). A job not withdrawn still gets its error.
    Against a real Redis server, the worker's DeadLetters writer itself."""
    from embedfleet.gateway.batch.runner import withdraw_job
    from embedfleet.producer.client import Producer
    from embedfleet.shared.dead_letters import DeadReason
    from embedfleet.sinks import Delivery
    from embedfleet.workers.dead_letter_writer import DeadLetters, Rejected
    from embedfleet.workers.events import WorkerEvents

    keys = settings.keys
    gone, kept = f"gone-{uuid.uuid4().hex[:6]}", f"kept-{uuid.uuid4().hex[:6]}"
    chunks = [Chunk(id=f"{job}:0", text="some text", job=job, reply=job) for job in (gone, kept)]
    async with Producer(settings, client) as producer:  # its setup makes the groups
        for chunk in chunks:
            await producer.enqueue([chunk], job=chunk.job)
    # the worker reads both entries
    read: dict[str, tuple[str, Chunk]] = {}
    for chunk in chunks:
        stream = keys.partition_for(chunk.id).ingest
        for _, entries in await client.xreadgroup(settings.group, "w", {stream: ">"}, count=10):
            for entry_id, fields in entries:
                got = decode_chunk(fields[PAYLOAD_FIELD])
                read[got.id] = (stream, entry_id.decode())
    assert set(read) == {c.id for c in chunks}
    # the gateway withdraws one job: its entry acknowledged and deleted under the worker
    assert await withdraw_job(client, keys, gone, settings.chunk_limits) == 1
    # then the worker gives up on both (the model failed on them, say)
    writer = DeadLetters(client, keys, WorkerEvents(), 60, 65536, job_reply_ttl_s=7 * 24 * 3600)
    await writer.send(
        [
            Rejected.chunk(
                Delivery(read[c.id][0], read[c.id][1], c.job), c, DeadReason.MODEL, "model failed"
            )
            for c in chunks
        ]
    )
    gone_reply, kept_reply = (keys.partition_for(c.id).reply(c.job or "") for c in chunks)
    figures = {
        "gone_reply": (await client.llen(gone_reply), await client.ttl(gone_reply)),
        "kept_reply": (await client.llen(kept_reply), await client.ttl(kept_reply)),
        "gone_dead": (await client.hget(keys.partition_for(chunks[0].id).job(gone), "dead")),
        "kept_dead": (await client.hget(keys.partition_for(chunks[1].id).job(kept), "dead")),
    }
    print(figures)
    assert figures["gone_reply"] == (0, -2), figures  # no reply key: -2, it does not exist
    assert figures["gone_dead"] is None, figures
    # the job nobody withdrew gets its error reply, with the job reply lists' lifetime
    assert figures["kept_reply"][0] == 1 and figures["kept_reply"][1] > 24 * 3600, figures
    assert figures["kept_dead"] == b"1", figures


def tenant_held(store: redis.Redis, keys: Keys, tenant: str) -> int:
    """The entries a tenant's ingest streams hold (every partition's)."""
    return sum(store.xlen(partition.ingest_for(tenant)) for partition in keys.partitions_keys)


def upload_lines(client: openai.OpenAI, path: Path, count: int, tag: str) -> str:
    """A batch of ``count`` one-input requests ``<tag><n>``; its id."""
    lines = [
        json.dumps(
            {
                "custom_id": f"{tag}{n}",
                "method": "POST",
                "url": "/v1/embeddings",
                "body": {"model": MODEL, "input": f"input {n} of the batch {tag}"},
            }
        )
        for n in range(count)
    ]
    path.write_text("\n".join(lines) + "\n")
    with path.open("rb") as handle:
        uploaded = client.files.create(file=handle, purpose="batch")
    return client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h"
    ).id


def answered_once(client: openai.OpenAI, batch: Any, tag: str, count: int) -> None:
    """Every request of a completed batch answered once, with a vector."""
    assert batch.status == "completed" and batch.error_file_id is None, batch
    assert batch.output_file_id is not None, batch
    rows = [
        json.loads(line) for line in client.files.content(batch.output_file_id).text.splitlines()
    ]
    ids = [row["custom_id"] for row in rows]
    assert sorted(ids) == sorted(f"{tag}{n}" for n in range(count)), (len(ids), len(set(ids)))
    assert all(row["response"]["status_code"] == 200 for row in rows)


def test_a_batch_at_its_tenants_backlog_limit_holds_up_no_other_batch(
    worker: WorkerProcess, store: redis.Redis, fleet_settings: Settings, tmp_path: Path
) -> None:
    """One tenant's batch at its EMBEDFLEET_TENANT_MAX_BACKLOG must not hold up the runner.

    The runner handles batches one after another; enqueueing a slice of a batch whose tenant
    is at its limit used to wait inside ``Producer.enqueue`` for room (up to
    EMBEDFLEET_TENANT_BACKLOG_WAIT_S, 300 s), so every other batch waited too. Here tenant
    ``big`` (one API key's owner) may hold 10 entries and sends 1,000 inputs; the worker is
    paused (SIGSTOP) once it holds its 10, so no room comes; another owner's (the default
    tenant's) 5-input batch created then must be enqueued at once, and complete when the worker
    resumes while ``big`` still waits for room (its 10 entries at a time); ``big`` then
    completes too, every line answered once (a slice sent again adds only what it had not)."""
    from embedfleet.gateway.auth import owner_id

    keys = fleet_settings.keys
    limit, big_count, small_count = 10, 1_000, 5
    settings = fleet_settings.model_copy(
        update={
            "api_keys": "k-big,k-small",
            "tenant_map": f"owner:{owner_id(b'k-big')}=big",
            "tenant_max_backlog": f"big={limit}",
        }
    )
    with running_gateway(settings) as url:
        wait_for_worker(url)
        big, small = (
            openai.OpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0)
            for key in ("k-big", "k-small")
        )
        worker.send_signal(signal.SIGSTOP)
        try:
            big_id = upload_lines(big, tmp_path / "big.jsonl", big_count, "b")
            wait_for("big at its limit", lambda: tenant_held(store, keys, "big") >= limit)
            small_id = upload_lines(small, tmp_path / "small.jsonl", small_count, "s")
            started = time.monotonic()
            try:
                wait_for(
                    "the other tenant's batch enqueued",
                    lambda: queued(store, keys, small_id) == small_count,
                    timeout=60,
                )
            finally:
                print(
                    f"small batch: {queued(store, keys, small_id)} of {small_count} inputs "
                    f"enqueued after {time.monotonic() - started:.1f}s, status "
                    f"{small.batches.retrieve(small_id).status}; big holds "
                    f"{tenant_held(store, keys, 'big')} of {limit}"
                )
            assert tenant_held(store, keys, "big") == limit  # the limit held, with no room
        finally:
            worker.send_signal(signal.SIGCONT)
        done = wait_final_of(small, small_id)
        big_then = big.batches.retrieve(big_id)
        cursor = int(store.hget(keys.batch(big_id), "cursor") or 0)
        print(f"small {done.status}; big then {big_then.status}, {cursor} of {big_count} sent")
        answered_once(small, done, "s", small_count)
        assert big_then.status == "in_progress" and cursor < big_count, (big_then, cursor)
        answered_once(big, wait_final_of(big, big_id, timeout=600), "b", big_count)
    progress = [store.hmget(p.job(big_id), "enqueued", "done") for p in keys.partitions_keys]
    assert sum(int(enqueued or 0) for enqueued, _ in progress) == big_count, progress
    assert sum(int(done or 0) for _, done in progress) == big_count, progress


def wait_final_of(client: openai.OpenAI, batch_id: str, timeout: float = 300) -> Any:
    """The batch once it has ended (polled), else AssertionError."""
    deadline = time.monotonic() + timeout
    while (batch := client.batches.retrieve(batch_id)).status not in FINAL:
        assert time.monotonic() < deadline, f"{batch_id} still {batch.status}"
        time.sleep(0.1)  # polling the batch's state, not waiting blind
    return batch


async def test_an_enqueue_that_does_not_wait_says_from_where_to_send_again(
    redis_server: ServerProcess, client: aioredis.Redis
) -> None:
    """What the batch runner relies on: ``enqueue(..., backlog_wait_s=0)`` of 100 chunks for a
    tenant that may hold 25 over 2 partitions adds what fits and raises at once (not after
    EMBEDFLEET_TENANT_BACKLOG_WAIT_S, 300 s), and ``handled`` is a prefix of the chunks every one
    of which is in the job: sending again from there loses none. Then, room made each time, the
    rest sent again from ``handled`` completes the job with each chunk enqueued once."""
    from embedfleet.producer.client import Producer, TenantBacklogFullError

    limit, count = 25, 100
    tight = isolated_settings(redis_server.url, partitions=2, tenant_max_backlog=f"t={limit}")
    keys = tight.keys
    chunks = [Chunk(id=f"c{n}", text=f"text {n}") for n in range(count)]
    async with Producer(tight, client, tenant="t") as producer:
        started = time.monotonic()
        with pytest.raises(TenantBacklogFullError) as raised:
            await producer.enqueue(chunks, job="j", batch_size=40, backlog_wait_s=0)
        waited = time.monotonic() - started
        handled = raised.value.handled
        in_job = [
            bool(await client.hexists(keys.partition_for(c.id).job_ids("j"), c.id)) for c in chunks
        ]
        print(f"added {int(raised.value.added)}, handled {handled}, waited {waited:.2f}s")
        assert waited < 10 and int(raised.value.added) == limit == sum(in_job)
        assert 0 < handled < count and all(in_job[:handled]) and not in_job[handled]
        # room made (as a worker would), the rest sent again from where it said, until all
        # went in: each chunk enqueued once
        rest, rounds = chunks[handled:], 1
        while True:
            for partition in keys.partitions_keys:
                await client.xtrim(partition.ingest_for("t"), maxlen=0)
            try:
                await producer.enqueue(rest, job="j", batch_size=40, backlog_wait_s=0)
                break
            except TenantBacklogFullError as full:
                assert 0 < full.handled < len(rest) and rounds < count, (full.handled, rounds)
                rest, rounds = rest[full.handled :], rounds + 1
        progress = await producer.progress("j")
    print(f"{rounds} rounds; the job counts {progress.enqueued} of {count}")
    assert progress.enqueued == count
