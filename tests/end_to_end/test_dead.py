"""Dead letters you can act on: list, show, replay once the cause is fixed, purge.

A real worker dead-letters hand-made bad entries; `embedfleet dead ...` is run as a user runs
it (a process); a second worker, its cause fixed, embeds what was replayed.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
from collections import Counter

import pytest
import redis.asyncio as aioredis

from embedfleet.producer import Producer
from embedfleet.shared.dead_letters import DeadLetter, DeadReason
from embedfleet.shared.protocol import PAYLOAD_FIELD, Chunk, decode_result, encode_chunk
from embedfleet.shared.settings import Settings
from tests import forks
from tests.conftest import Recorder, WorkerLauncher

# the slow tier (make test-full, CI): starts processes or servers, or compiles a model
pytestmark = pytest.mark.slow

LONG = "a sentence that keeps going and going, " * 200  # far over the model's 256 tokens


def embedfleet(settings: Settings, *args: str) -> subprocess.CompletedProcess[str]:
    return forks.run(
        args,
        text=True,
        timeout=120,
        env={
            **os.environ,
            "EMBEDFLEET_REDIS_URL": settings.effective_redis_url,
            "EMBEDFLEET_NAMESPACE": settings.namespace,
        },
    )


async def run(settings: Settings, *args: str) -> subprocess.CompletedProcess[str]:
    result = await asyncio.to_thread(embedfleet, settings, *args)
    assert result.returncode == 0, result.stderr[-2000:]
    return result


async def dead_letters(client: aioredis.Redis, settings: Settings) -> list[DeadLetter]:
    return [DeadLetter.from_fields(i, f) for i, f in await client.xrange(settings.keys.dead)]


async def test_replay_after_the_cause_is_fixed_embeds_each_id_once(
    workers: WorkerLauncher, settings: Settings, client: aioredis.Redis, encoder
) -> None:
    strict = settings.model_copy(update={"truncate": False})
    good = [Chunk(f"good-{n}", f"a short text, number {n}") for n in range(12)]
    long = [Chunk(f"long-{n}", f"{n}: {LONG}", meta={"n": n}) for n in range(5)]
    async with Producer(strict, client) as producer:
        async with workers.run(strict) as worker:
            recorder: Recorder = worker.listener
            await producer.enqueue(good + long, job="replay")
            # hand-made: not msgpack, and a chunk with an empty text (both of job "replay")
            await client.xadd(strict.keys.ingest, {PAYLOAD_FIELD: b"\xc1 not msgpack"})
            # (the empty string: whitespace is text since TEI's rule, 0d1f650)
            empty = encode_chunk(Chunk("empty", "", job="replay"))
            await client.xadd(strict.keys.ingest, {PAYLOAD_FIELD: empty})
            await recorder.wait_for(
                lambda r: r.texts_written == 12 and sum(r.dead.values()) == 7, "12 written, 7 dead"
            )
        assert recorder.dead == Counter(too_long=5, not_msgpack=1, invalid=1)

        listed = await run(strict, "dead", "list", "--reason", "too_long", "--json")
        rows = [json.loads(line) for line in listed.stdout.splitlines()]
        assert sorted(row["id"] for row in rows) == [c.id for c in long]
        assert all(row["replayable"] and row["job"] == "replay" for row in rows)
        shown = json.loads((await run(strict, "dead", "show", rows[0]["dead_id"])).stdout)
        assert shown["chunk"]["text"].endswith(LONG) and shown["reason"] == "too_long"

        dry = await run(strict, "dead", "replay", "--reason", "too_long", "--dry-run")
        assert "would replay 5, skipped 0" in dry.stdout
        assert len(await dead_letters(client, strict)) == 7  # a dry run changes nothing

        # the cause, fixed: this worker truncates overlong texts (and flags them)
        fixed = strict.model_copy(update={"truncate": True})
        async with workers.run(fixed) as worker:
            recorder = worker.listener
            replayed = await run(fixed, "dead", "replay", "--reason", "too_long", "--job", "replay")
            assert "replayed 5, skipped 0" in replayed.stdout
            again = await run(fixed, "dead", "replay", "--reason", "too_long")
            assert "replayed 0, skipped 0" in again.stdout  # twice is harmless
            await recorder.wait_for(lambda r: r.texts_written == 5, "the 5 replayed embedded")
            progress = await producer.wait_for_job("replay", timeout=60)

    results = [decode_result(f[PAYLOAD_FIELD]) for _, f in await client.xrange(fixed.keys.results)]
    per_id = Counter(result.id for result in results)
    assert {c.id: per_id[c.id] for c in long} == {c.id: 1 for c in long}  # each exactly once
    assert sum(per_id.values()) == 17 and all(count == 1 for count in per_id.values())
    replayed_results = [r for r in results if r.id.startswith("long-")]
    assert all(r.truncated and r.job == "replay" for r in replayed_results)
    assert sorted(r.meta["n"] for r in replayed_results) == list(range(5))  # original payload
    # the job's counts moved from dead to done: 17 enqueued by the producer, 17 done
    assert (progress.enqueued, progress.done) == (17, 17)
    left = await dead_letters(client, fixed)
    assert sorted(letter.reason for letter in left) == [DeadReason.INVALID, DeadReason.NOT_MSGPACK]
    assert (await client.xpending(fixed.keys.ingest, fixed.group))["pending"] == 0

    purged = await run(fixed, "dead", "purge", "--reason", "invalid", "--yes")
    assert "purged 1 dead letters" in purged.stdout
    assert [letter.reason for letter in await dead_letters(client, fixed)] == [
        DeadReason.NOT_MSGPACK
    ]


async def test_letters_that_cannot_be_replayed_are_skipped_and_kept(
    settings: Settings, client: aioredis.Redis
) -> None:
    """A query's caller has gone; a prefix is not the payload: both stay, each says why."""
    from embedfleet.shared.dead_letters import dead_letter_fields

    common = {"detail": "d", "entry_id": "1-0", "max_payload_bytes": 8}
    await client.xadd(
        settings.keys.dead,
        dead_letter_fields(
            reason=DeadReason.MODEL, stream=settings.keys.query, payload=b"small", **common
        ),
    )
    await client.xadd(
        settings.keys.dead,
        dead_letter_fields(
            reason=DeadReason.MODEL, stream=settings.keys.ingest, payload=b"x" * 64, **common
        ),
    )
    result = await run(settings, "dead", "replay")
    assert "replayed 0, skipped 2" in result.stdout
    assert "a query: its caller has gone" in result.stderr
    assert "only a prefix was kept (64 bytes" in result.stderr
    assert (
        await client.xlen(settings.keys.dead) == 2 and await client.xlen(settings.keys.ingest) == 0
    )
    shown = await asyncio.to_thread(embedfleet, settings, "dead", "show", "0-1")
    assert shown.returncode == 1 and "no dead letter '0-1'" in shown.stderr


class PagedAfterTheWorker:
    """The dead-letter store's retry hook: before it reads a page, the worker has dead-lettered
    again every letter replayed so far, so a replay that read to the stream's end would find
    them there (the real race, made certain). Fails the test past twice the letters there."""

    give_up_after_s = 0.0

    def __init__(self, recorder: Recorder, letters: int) -> None:
        self.recorder, self.letters, self.replays = recorder, letters, 0

    async def call(self, doing: str, operation):
        if doing.startswith("replay dead letter"):
            self.replays += 1
            assert self.replays <= 2 * self.letters, "replay went on past the letters it found"
        elif doing == "read the dead letters" and self.replays:
            replays = self.replays
            await self.recorder.wait_for(
                lambda r: r.dead["too_large"] == self.letters + replays,
                "the replayed letters dead-lettered again",
            )
        return await operation()


async def test_replay_of_letters_that_fail_again_ends_after_one_pass(
    workers: WorkerLauncher,
    settings: Settings,
    client: aioredis.Redis,
    encoder,
    monkeypatch,
) -> None:
    """Letters that fail again at once (the cause is not fixed) are replayed once each."""
    from embedfleet.ops import dead_letter_admin
    from embedfleet.ops.dead_letter_admin import DeadLetterStore, Filters

    LETTERS = 12
    monkeypatch.setattr(dead_letter_admin, "PAGE", 5)  # pages end within the letters
    narrow = settings.model_copy(update={"max_text_chars": 8})  # the worker refuses them all
    async with Producer(settings, client) as producer, workers.run(narrow) as worker:
        recorder: Recorder = worker.listener
        await producer.enqueue(
            [Chunk(f"wide-{n}", f"longer than eight, {n}") for n in range(LETTERS)], job="again"
        )
        await recorder.wait_for(lambda r: r.dead["too_large"] == LETTERS, "all dead-lettered")
        pacer = PagedAfterTheWorker(recorder, LETTERS)
        store = DeadLetterStore(client, settings.keys, retry=pacer)
        report = await store.replay(Filters())
        await recorder.wait_for(
            lambda r: r.dead["too_large"] == 2 * LETTERS, "the replays dead-lettered again"
        )
        progress = await producer.progress("again")
    assert len(report.replayed) == LETTERS and pacer.replays == LETTERS
    assert sorted(letter.chunk_id for letter in report.replayed) == sorted(
        f"wide-{n}" for n in range(LETTERS)
    )
    letters = await dead_letters(client, settings)
    assert sorted(letter.chunk_id for letter in letters) == sorted(
        f"wide-{n}" for n in range(LETTERS)
    )
    assert (progress.enqueued, progress.done, progress.dead) == (LETTERS, 0, LETTERS)
