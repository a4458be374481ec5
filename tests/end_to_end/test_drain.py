"""Results that drain (issue 28): consuming readers, the workers' bound on the results stream,
the streamed export, and the benchmark stand-in encoder (issue 29) the long runs use.

All against a real redis-server (tests/conftest.py); the worker runs the real tokenizer behind
the stand-in encoder, so these tests time the pipeline, not the model.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import redis.asyncio as aioredis

from embedfleet.producer import Producer
from embedfleet.server import isolated_settings
from embedfleet.shared.protocol import PAYLOAD_FIELD, Result, encode_result
from embedfleet.shared.settings import Settings
from tests.conftest import cli_env, start_cli, until

DIM = 32


def make_result(index: int, dim: int = DIM, job: str | None = "j") -> Result:
    vector = np.full(dim, index % 1000, np.float16)
    return Result(id=f"r{index}", model="m", vector=vector, job=job)


async def write_results(client: aioredis.Redis, stream: str, first: int, count: int) -> None:
    """``count`` results straight onto a results stream, as the Redis sink writes them."""
    for start in range(first, first + count, 1000):
        pipe = client.pipeline(transaction=False)
        for index in range(start, min(first + count, start + 1000)):
            pipe.xadd(stream, {PAYLOAD_FIELD: encode_result(make_result(index))})
        await pipe.execute()


DOOMED_READER = textwrap.dedent(
    """
    import asyncio, sys
    from embedfleet.producer import Producer
    from embedfleet.shared.settings import Settings

    async def main():
        async with Producer(Settings()) as producer:
            reader = producer.results_reader(consumer="doomed", page=int(sys.argv[1]))
            first = await reader.next_page()
            with open(sys.argv[2], "w") as out:  # written, then acknowledged
                out.write("\\n".join(r.id for r in first.results) + "\\n")
            await reader.acknowledge(first)
            second = await reader.next_page()  # read, never acknowledged: killed holding it
            print("holding", len(second.entry_ids), flush=True)
            await asyncio.Event().wait()

    asyncio.run(main())
    """
)


async def test_consuming_readers_take_every_result_once_and_claim_a_killed_readers_page(
    redis_server, tmp_path: Path, client: aioredis.Redis
) -> None:
    """Three consuming readers and one killed mid-read (a page read, not acknowledged): every
    result is handed out exactly once over all of them, the killed reader's page by another
    reader once it was idle EMBEDFLEET_RESULTS_CLAIM_IDLE_MS, and the stream is empty after."""
    settings = isolated_settings(redis_server.url, results_claim_idle_ms=300)
    stream = settings.keys.results
    await write_results(client, stream, 0, 4000)
    doomed_out = tmp_path / "doomed.txt"
    env = cli_env(settings, EMBEDFLEET_RESULTS_CLAIM_IDLE_MS="300")
    doomed = await asyncio.create_subprocess_exec(
        sys.executable,
        "-c",
        DOOMED_READER,
        "150",
        str(doomed_out),
        stdout=asyncio.subprocess.PIPE,
        env=env,
    )
    assert doomed.stdout is not None
    line = await asyncio.wait_for(doomed.stdout.readline(), 120)
    assert line.decode().split() == ["holding", "150"]
    doomed.send_signal(signal.SIGKILL)
    await doomed.wait()

    async def read(name: str) -> list[str]:
        async with Producer(settings) as producer:
            return [r.id async for r in producer.results(consume=True, consumer=name, page=100)]

    async def write_more() -> None:  # results keep arriving while the readers drain
        await write_results(client, stream, 4000, 1000)

    *taken, _ = await asyncio.gather(read("a"), read("b"), read("c"), write_more())
    written_by_doomed = doomed_out.read_text().split()
    handed_out = [i for ids in taken for i in ids] + written_by_doomed
    assert sorted(handed_out) == sorted(f"r{i}" for i in range(5000))  # each exactly once
    assert len(written_by_doomed) == 150 and all(taken)  # the three shared the work
    assert await client.xlen(stream) == 0
    assert (await client.xpending(stream, settings.keys.results_group))["pending"] == 0
    consumers = {c["name"] for c in await client.xinfo_consumers(stream, "results-readers")}
    assert consumers == {b"doomed"}  # the live readers left the group, holding nothing


async def test_a_consuming_read_of_one_job_is_refused(settings: Settings) -> None:
    async with Producer(settings) as producer:
        with pytest.raises(ValueError, match="every job's results"):
            async for _ in producer.results(job="x", consume=True):
                pass


async def test_worker_waits_at_the_results_bound_and_goes_on_once_a_reader_drains(
    settings: Settings, workers, client: aioredis.Redis
) -> None:
    """EMBEDFLEET_RESULTS_MAX_ENTRIES=N and no reader: the worker stops writing at about N
    (one micro-batch over at most) and the job does not finish; a consuming reader then drains
    the stream and the worker goes on until the job is done, every result read once."""
    from embedfleet.sinks import RedisStreamSink

    bound, chunks, max_batch = 120, 600, 16
    settings = settings.model_copy(
        update={"results_max_entries": bound, "read_count": 32, "max_batch": max_batch}
    )
    sink = RedisStreamSink(client, settings.keys, settings.results_max_entries)
    stream = settings.keys.results
    async with (
        workers.run(settings, sink=sink, encoder=standin_encoder()),
        Producer(settings) as producer,
    ):
        await producer.enqueue(
            ({"id": f"c{i}", "text": f"text number {i} " * (1 + i % 7)} for i in range(chunks)),
            job="bound",
        )

        async def at_the_bound() -> bool:
            return sink.waiting

        await until(at_the_bound, timeout=120)
        held = await client.xlen(stream)
        assert bound <= held < bound + max_batch
        assert (await producer.progress("bound")).done == held < chunks
        stop = asyncio.Event()
        reader = producer.results_reader(page=50)
        seen: list[str] = []
        while len(seen) < chunks:
            page = await reader.next_page(follow=True, stop=stop)
            assert page is not None
            seen += [r.id for r in page.results]
            await reader.acknowledge(page)
        await reader.close()
        progress = await producer.wait_for_job("bound", timeout=60)
    assert progress.done == chunks and sink.waits >= 1
    assert sorted(seen) == sorted(f"c{i}" for i in range(chunks))
    assert await client.xlen(stream) == 0


def standin_encoder():
    from embedfleet.workers.model.standin import StandInEncoder

    return StandInEncoder(us_per_token=0)


def test_standin_encoder_names_itself_and_keeps_the_models_shape_and_tokenizer(
    encoder, caplog
) -> None:
    """The stand-in keeps the real tokenizer (the same token ids), the model's dimension and
    maximum, returns unit vectors (equal texts, equal vectors), and its card names it."""
    from embedfleet.workers.model.standin import StandInEncoder

    standin = StandInEncoder(us_per_token=1.0)
    texts = ["a cat sat", "a cat sat", "something else entirely, and longer"]
    assert [t.ids for t in standin.tokenize(texts)] == [t.ids for t in encoder.tokenize(texts)]
    vectors = standin.embed_texts(texts)
    assert vectors.shape == (3, encoder.dim) and vectors.dtype == np.float32
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-5)
    assert np.array_equal(vectors[0], vectors[1]) and not np.array_equal(vectors[0], vectors[2])
    assert standin.card.name == standin.name == f"benchmark-standin:{encoder.name}"
    assert standin.max_length == encoder.max_length and not standin.prepare_query_graph()


def test_the_worker_builds_the_standin_only_when_its_setting_is_set(capsys) -> None:
    from embedfleet.shared.logging import configure_logging
    from embedfleet.workers.model.standin import StandInEncoder
    from embedfleet.workers.runtime import load_encoder

    configure_logging("info", "json")
    built = load_encoder(Settings(benchmark_standin_encoder_us_per_token=0))
    assert isinstance(built, StandInEncoder)
    assert "BENCHMARK STAND-IN ENCODER" in capsys.readouterr().err
    assert "standin" not in Settings().model_dump_json().lower().replace(
        "benchmark_standin_encoder_us_per_token", ""
    )


@pytest.mark.parametrize("suffix", [".jsonl", ".npz"])
async def test_results_out_consume_drains_the_stream_into_the_file(
    settings: Settings, client: aioredis.Redis, tmp_path: Path, suffix: str
) -> None:
    """`embedfleet results --out F --consume`: every result in the file (the .npz as np.load
    reads it), the stream empty after; `--consume --job` is refused."""
    await write_results(client, settings.keys.results, 0, 2500)
    out = tmp_path / f"drained{suffix}"
    env = cli_env(settings)
    ran = await start_cli(env, "results", "--out", str(out), "--consume", "--page", "300", "--json")
    stdout, stderr = await ran.communicate()
    assert ran.returncode == 0, stderr.decode()
    assert json.loads(stdout)["vectors"] == 2500
    if suffix == ".npz":
        with np.load(out) as archive:
            ids, vectors = list(archive["ids"]), archive["vectors"]
        assert vectors.dtype == np.float16 and vectors.shape == (2500, DIM)
    else:
        rows = [json.loads(line) for line in out.read_text().splitlines()]
        ids, vectors = [row["id"] for row in rows], np.array([row["vector"] for row in rows])
    assert sorted(ids) == sorted(f"r{i}" for i in range(2500))
    by_id = dict(zip(ids, vectors, strict=True))
    assert by_id["r1234"][0] == 234  # each id's own vector
    assert await client.xlen(settings.keys.results) == 0
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".part")]
    refused = await start_cli(env, "results", "--out", str(out), "--consume", "--job", "j")
    _, stderr = await refused.communicate()
    assert refused.returncode == 2 and "--consume drains every job" in stderr.decode()


async def test_a_finished_jobs_id_record_expires_soon_and_an_enqueue_extends_it_again(
    settings: Settings, client: aioredis.Redis
) -> None:
    """EMBEDFLEET_JOB_IDS_FINISHED_TTL_S: the id record keeps EMBEDFLEET_JOB_IDS_TTL_S while the
    job runs and gets the short TTL with its last acknowledgement; the next enqueue to the job
    gives it the long one again, cut once more when that chunk is done. The acknowledgements
    are the Redis sink's own (``RedisStreamSink.write``, acknowledge.lua) on entries read
    through the workers' group, so no model is needed."""
    from embedfleet.sinks import Delivery, RedisStreamSink

    settings = settings.model_copy(update={"job_ids_finished_ttl_s": 120})
    record, ingest = settings.keys.job_ids("ttl"), settings.keys.ingest
    sink = RedisStreamSink(client, settings.keys)

    async def finish(count: int) -> None:
        reply = await client.xreadgroup(settings.group, "t", {ingest: ">"}, count=count)
        entries = reply[0][1]
        deliveries = [Delivery(ingest, entry_id.decode(), "ttl") for entry_id, _ in entries]
        await sink.write([make_result(i, job="ttl") for i in range(len(entries))], deliveries)

    async with Producer(settings) as producer:
        await producer.enqueue(({"id": f"t{i}", "text": f"text {i}"} for i in range(40)), job="ttl")
        await finish(39)
        assert await client.ttl(record) > 120  # one chunk to go: the long TTL
        await finish(1)
        assert (await producer.progress("ttl")).finished
        assert 0 < await client.ttl(record) <= 120
        await producer.enqueue([{"id": "late", "text": "one more"}], job="ttl")
        assert await client.ttl(record) > 120  # the job has work again
        await finish(1)
        assert (await producer.progress("ttl")).done == 41
        assert 0 < await client.ttl(record) <= 120
    assert await client.hlen(record) == 41


async def test_consuming_readers_drain_every_partitions_results_stream(
    redis_server, client: aioredis.Redis
) -> None:
    """With EMBEDFLEET_PARTITIONS each partition's results stream has the readers' group; two
    readers drain them all, each result once, every stream empty after."""
    settings = isolated_settings(redis_server.url, partitions=3)
    for index, partition in enumerate(settings.keys.partitions_keys):
        await write_results(client, partition.results, index * 1000, 700)

    async def read(name: str) -> list[str]:
        async with Producer(settings) as producer:
            return [r.id async for r in producer.results(consume=True, consumer=name, page=64)]

    first, second = await asyncio.gather(read("a"), read("b"))
    expected = [f"r{p * 1000 + i}" for p in range(3) for i in range(700)]
    assert sorted(first + second) == sorted(expected)
    for partition in settings.keys.partitions_keys:
        assert await client.xlen(partition.results) == 0


def test_the_workers_sink_takes_the_bound_from_the_setting(client: aioredis.Redis) -> None:
    from embedfleet.sinks import build_sink

    assert build_sink(Settings(), client).max_entries == 1_000_000  # type: ignore[attr-defined]
    bounded = build_sink(Settings(results_max_entries=7), client)
    assert bounded.max_entries == 7  # type: ignore[attr-defined]


async def test_status_says_when_a_results_stream_is_at_its_bound(
    settings: Settings, client: aioredis.Redis
) -> None:
    """A fleet waiting at the results bound is not stalled for want of workers: status says
    which partition is full and what drains it."""
    await write_results(client, settings.keys.results, 0, 30)
    env = cli_env(settings, EMBEDFLEET_RESULTS_MAX_ENTRIES="30")

    async def status(*flags: str) -> str:
        ran = await start_cli(env, "status", "--sample", "0", *flags)
        out, _ = await ran.communicate()
        assert ran.returncode == 0
        return out.decode()

    data = json.loads(await status("--json"))
    assert data["results_full"] == [0] and data["results_max_entries"] == 30
    assert "results     WARNING: at EMBEDFLEET_RESULTS_MAX_ENTRIES (30)" in await status()
    await client.xtrim(settings.keys.results, maxlen=10, approximate=False)
    assert json.loads(await status("--json"))["results_full"] == []


@pytest.mark.parametrize("suffix", [".jsonl", ".npz"])
def test_an_export_that_fails_midway_keeps_what_it_wrote(tmp_path: Path, suffix: str) -> None:
    """A consuming export has acknowledged the pages it wrote: a failure after them finishes
    the file with them; a failure before any leaves no file."""
    from embedfleet.ops.export import ExportWriter

    out = tmp_path / f"partial{suffix}"
    with pytest.raises(ConnectionError), ExportWriter(out) as writer:
        writer.write([make_result(i) for i in range(5)], durable=True)
        raise ConnectionError("redis went away")
    if suffix == ".npz":
        with np.load(out) as archive:
            assert list(archive["ids"]) == [f"r{i}" for i in range(5)]
    else:
        assert [json.loads(line)["id"] for line in out.read_text().splitlines()] == [
            f"r{i}" for i in range(5)
        ]
    empty = tmp_path / f"empty{suffix}"
    with pytest.raises(ConnectionError), ExportWriter(empty):
        raise ConnectionError("before anything")
    assert not empty.exists() and not list(tmp_path.glob("*.part"))


async def test_results_consume_follow_drains_as_results_arrive_until_sigterm(
    settings: Settings, client: aioredis.Redis, tmp_path: Path
) -> None:
    """`results --out F.npz --consume --follow` beside a fleet: it drains what arrives, and
    SIGTERM ends it between pages with the archive finished, every result in it once."""
    out = tmp_path / "followed.npz"
    follower = await start_cli(
        cli_env(settings), "results", "--out", str(out), "--consume", "--follow", "--page", "100"
    )
    stream = settings.keys.results

    async def drained() -> bool:
        groups = await client.xinfo_groups(stream) if await client.exists(stream) else []
        return bool(groups) and await client.xlen(stream) == 0

    for first in (0, 600):  # two bursts, the second after the first was drained
        await until(drained, timeout=120)
        await write_results(client, stream, first, 600)
    await until(drained, timeout=120)
    follower.send_signal(signal.SIGTERM)
    _, stderr = await follower.communicate()
    assert follower.returncode == 0, stderr.decode()
    with np.load(out) as archive:
        assert sorted(archive["ids"]) == sorted(f"r{i}" for i in range(1200))
