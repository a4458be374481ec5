"""Enqueue-and-count is idempotent per chunk id within a job (producer/enqueue.py)."""

from __future__ import annotations

import io
import json
from collections.abc import Callable

import pytest
import redis.asyncio as aioredis

from embedfleet.producer import EmbeddingOptions, Producer
from embedfleet.producer.enqueue import EnqueueCall, enqueue_script_command, script_counts
from embedfleet.producer.jsonl import BadLine, line_cap, read_chunks
from embedfleet.shared.protocol import (
    DEFAULT_LIMITS,
    PAYLOAD_FIELD,
    Chunk,
    ChunkLimits,
    ProtocolError,
    decode_chunk,
    encode_chunk,
)
from embedfleet.shared.settings import Settings


def chunks(count: int, job: str | None = "j", text: str = "text") -> list[Chunk]:
    return [Chunk(id=f"c{i}", text=f"{text} {i}", job=job) for i in range(count)]


async def entry_ids(client: aioredis.Redis, settings: Settings) -> list[str]:
    entries = await client.xrange(settings.keys.ingest)
    return [decode_chunk(fields[PAYLOAD_FIELD]).id for _, fields in entries]


async def test_a_re_sent_batch_is_added_and_counted_once(
    settings: Settings, client: aioredis.Redis
) -> None:
    async with Producer(settings, client) as producer:
        assert await producer.enqueue(chunks(30), job="j", batch_size=7) == 30
        # the same chunks again, cut into other batches, and one id twice within one batch
        again = [*chunks(30), Chunk(id="c3", text="text 3", job="j")]
        await producer.enqueue(again, job="j", batch_size=11)
        progress = await producer.progress("j")
    assert progress.enqueued == 30
    assert sorted(await entry_ids(client, settings)) == sorted(f"c{i}" for i in range(30))
    assert await client.smembers(settings.keys.jobs_index) == {b"j"}
    ttl = await client.ttl(settings.keys.job_ids("j"))
    assert 0 < ttl <= settings.job_ids_ttl_s


async def test_a_changed_text_is_enqueued_again_and_counted(
    settings: Settings, client: aioredis.Redis
) -> None:
    async with Producer(settings, client) as producer:
        await producer.enqueue(chunks(5), job="j")
        await producer.enqueue([Chunk(id="c2", text="a new text", job="j")])
        progress = await producer.progress("j")
    ids = await entry_ids(client, settings)
    assert progress.enqueued == 6 and sorted(ids) == ["c0", "c1", "c2", "c2", "c3", "c4"]


async def test_the_same_id_in_another_job_is_its_own_chunk(
    settings: Settings, client: aioredis.Redis
) -> None:
    async with Producer(settings, client) as producer:
        await producer.enqueue(chunks(4), job="a")
        await producer.enqueue(chunks(4), job="b")
        # a batch that mixes jobs, and chunks with no job (no counter: plain XADD)
        mixed = [Chunk("x", "x", "a"), Chunk("c0", "text 0", "b"), Chunk("free", "t")]
        await producer.enqueue(mixed)
        a, b = await producer.progress("a"), await producer.progress("b")
    assert (a.enqueued, b.enqueued) == (5, 4)
    assert len(await entry_ids(client, settings)) == 10


async def test_id_record_can_be_kept_for_ever(settings: Settings, client: aioredis.Redis) -> None:
    forever = settings.model_copy(update={"job_ids_ttl_s": 0})
    async with Producer(forever, client) as producer:
        await producer.enqueue(chunks(3), job="j")
    assert await client.ttl(settings.keys.job_ids("j")) == -1


async def test_a_re_run_reports_the_chunks_already_in_the_job(
    settings: Settings, client: aioredis.Redis
) -> None:
    async with Producer(settings, client) as producer:
        first = await producer.enqueue(chunks(30), job="j", batch_size=7)
        assert (int(first), first.present) == (30, 0)
        # the same file again, with one text changed and one chunk more
        again = [*chunks(30), Chunk(id="c30", text="new")]
        again[2] = Chunk(id="c2", text="a changed text")
        second = await producer.enqueue(again, job="j", batch_size=11)
        assert (int(second), second.present, second.chunks) == (2, 29, 31)
        assert await producer.enqueue(chunks(3, job=None)) == 3  # no job: always added
        assert (await producer.progress("j")).enqueued == 32


async def test_force_adds_the_chunks_the_job_already_has(
    settings: Settings, client: aioredis.Redis
) -> None:
    async with Producer(settings, client) as producer:
        await producer.enqueue(chunks(10), job="j")
        # their vectors were lost (a wiped table): embed them again
        forced = await producer.enqueue(chunks(10), job="j", force=True, batch_size=4)
        assert (int(forced), forced.present) == (10, 0)
        progress = await producer.progress("j")
    assert progress.enqueued == 20
    assert sorted(await entry_ids(client, settings)) == sorted(2 * [f"c{i}" for i in range(10)])


async def test_a_re_send_within_one_call_counts_as_that_calls_own(
    settings: Settings, client: aioredis.Redis
) -> None:
    # the script sent twice for one call, as after a lost reply: the second try adds nothing
    # and reports the chunks as added by this call ("again"), even with force
    keys = settings.keys
    payloads = [(c.id, encode_chunk(c)) for c in chunks(4)]

    async def send(call: EnqueueCall) -> tuple[int, int]:
        command = enqueue_script_command(
            stream=keys.ingest,
            counters=keys.job("j"),
            id_record=keys.job_ids("j"),
            chunks=payloads,
            id_record_ttl_s=60,
            call=call,
        )
        return script_counts(await client.execute_command(*command))

    first, forced = EnqueueCall(), EnqueueCall(force=True)
    assert await send(first) == (4, 0)
    assert await send(first) == (0, 4)
    assert await send(EnqueueCall()) == (0, 0)  # another call: already in the job
    assert await send(forced) == (4, 0)
    assert await send(forced) == (0, 4)
    assert int(await client.hget(keys.job("j"), "enqueued")) == 8


# --- the JSON Lines reader (producer/jsonl.py): bad lines are named, the rest still read -------
def _read(
    data: bytes, limits: ChunkLimits = DEFAULT_LIMITS, check: Callable[[Chunk], None] | None = None
) -> tuple[list[str], list[tuple[int, str]]]:
    rejected: list[BadLine] = []
    read = list(read_chunks(io.BytesIO(data), "j", rejected, limits, check))
    return [chunk.id for chunk in read], [(bad.line_number, bad.reason) for bad in rejected]


def _padded(chunk_id: str, size: int) -> bytes:
    """A valid line of exactly ``size`` bytes before its newline (JSON whitespace pads it)."""
    line = json.dumps({"id": chunk_id, "text": "t"}).encode()
    return line[:-1] + b" " * (size - len(line)) + b"}"


def test_a_line_of_the_cap_is_read_and_a_longer_one_is_named() -> None:
    limits = ChunkLimits(max_message_bytes=100)  # lines of at most 600 bytes
    assert line_cap(limits) == 600
    data = _padded("at", 600) + b"\n" + _padded("over", 601) + b"\n" + _padded("after", 40)
    ids, bad = _read(data, limits)
    assert ids == ["at", "after"]
    assert [number for number, _ in bad] == [2] and "longer than 600 bytes" in bad[0][1]


def test_a_line_not_utf8_is_named_and_the_rest_is_read() -> None:
    ids, bad = _read(
        b'{"id": "a", "text": "x"}\n{"id": "b", "text": "caf\xe9"}\n{"id": "c", "text": "y"}'
    )
    assert ids == ["a", "c"]
    assert bad == [(2, "not UTF-8: byte 0xe9 at byte 25 (invalid continuation byte)")]


def test_a_line_the_model_refuses_is_named() -> None:
    def check(chunk: Chunk) -> None:
        if chunk.prompt_name == "nope":
            raise ValueError(f"chunk {chunk.id!r}: prompt_name='nope' is not one of its prompts")

    lines = [{"id": "a", "text": "x"}, {"id": "b", "text": "y", "prompt_name": "nope"}]
    ids, bad = _read(b"\n".join(json.dumps(line).encode() for line in lines), check=check)
    assert ids == ["a"] and bad == [(2, "chunk 'b': prompt_name='nope' is not one of its prompts")]


# past msgpack's 64 bits (the Producer raised msgpack's OverflowError), past the bound, NaN
HUGE_AND_WRONG = [2**70, 10**5000, 1_000_001, -1, 1.5, float("nan"), "5"]
NAMED = ["2**70", "10**5000", "past-the-bound", "negative", "fractional", "NaN", "string"]


@pytest.mark.parametrize("value", HUGE_AND_WRONG, ids=NAMED)
async def test_a_bad_number_is_a_protocol_error_and_nothing_is_sent(
    settings: Settings, client: aioredis.Redis, value: object
) -> None:
    """Every door of the Producer refuses a bad number as ProtocolError, the error every other
    bad value raises, before anything reaches Redis: a chunk's own option, a job's options, a
    query's options, a sparse query's ``max_active_dims``."""
    async with Producer(settings, client) as producer:
        with pytest.raises(ProtocolError, match="'window_overlap' must be an integer from 0"):
            await producer.enqueue([{"id": "a", "text": "t", "window_overlap": value}], job="j")
        options = EmbeddingOptions(window_overlap=value)  # type: ignore[arg-type]
        with pytest.raises(ProtocolError, match="'window_overlap'"):
            await producer.enqueue([Chunk(id="b", text="t")], job="j", options=options)
        with pytest.raises(ProtocolError, match="'window_overlap'"):
            await producer.embed_texts(["t"], options=options, timeout=5)
        with pytest.raises(ProtocolError, match="'dimensions'"):
            dimensions = EmbeddingOptions(dimensions=value)  # type: ignore[arg-type]
            await producer.embed_query("t", options=dimensions, timeout=5)
        with pytest.raises(ProtocolError, match="'max_active_dims'"):
            await producer.embed_sparse(["t"], max_active_dims=value, timeout=5)  # type: ignore[arg-type]
    for stream in (settings.keys.ingest, settings.keys.query, settings.keys.interactive):
        assert await client.xlen(stream) == 0, stream


async def test_a_batch_of_images_is_sent_at_its_bytes_bound(
    settings: Settings, client: aioredis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    # the bound lowered from 96 MiB: a batch of 1,000 images of 3 MiB would hold 3 GB
    monkeypatch.setattr("embedfleet.producer.enqueuer.BATCH_IMAGE_BYTES", 10_000)
    images = [Chunk(id=f"p{i}", image=bytes([i]) * 3_000, image_ref=f"p{i}.png") for i in range(9)]
    sent: list[int] = []
    async with Producer(settings, client) as producer:
        count = await producer.enqueue(
            [*images, Chunk(id="t", text="a caption")], on_batch=sent.append
        )
    assert count == 10 and sent == [4, 4, 2]  # 12,000 bytes at the fourth image, then the rest
    assert sorted(await entry_ids(client, settings)) == sorted([*(c.id for c in images), "t"])
