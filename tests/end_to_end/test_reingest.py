"""Re-ingestion (issue 31): a corpus enqueued again runs the model only for what changed.

Real parts: a real Redis, the real model in an in-process worker, LanceDB as the database
sink (pgvector and Qdrant local mode for pruning). The model's own counters (the worker's
``embedded`` texts and ``real_tokens``, as its ``batch_encoded`` events report them) say what
went through the model; every row is checked against sentence-transformers.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
from click.testing import CliRunner

from embedfleet.cli import main
from embedfleet.ops.prune import prune
from embedfleet.ops.status import _render_cache, _render_jobs, report, take_snapshot
from embedfleet.producer import Producer
from embedfleet.producer.client import EmbeddingOptions
from embedfleet.shared.keys import Keys
from embedfleet.shared.protocol import PAYLOAD_FIELD, Chunk, Result, decode_chunk, decode_result
from embedfleet.shared.settings import Settings
from embedfleet.shared.vector_cache import VectorCache, pack_entry
from embedfleet.sinks import (
    SinkTarget,
    local_sink_url,
    open_backend,
    parse_sink_url,
    prune_job,
)
from embedfleet.workers.metrics import WorkerMetrics
from loadtest.reingest import WORDS  # the benchmark's words, in other sentences
from tests.conftest import reference_model, running_pg, shared_encoder
from tests.sink_fleet_support import sink_fleet

# the slow tier (make test-full, CI): starts processes or servers, or compiles a model
pytestmark = pytest.mark.slow

CORPUS = 2000
CHANGED, NEW, REMOVED = CORPUS // 10, CORPUS // 20, CORPUS // 20  # 10%, 5%, 5%
MOODS = ("quiet", "bright", "rebuilt")


def text_of(n: int, version: int = 0) -> str:
    first, second = WORDS[n % len(WORDS)], WORDS[(n // len(WORDS)) % len(WORDS)]
    return f"Note {n}: {first} and {second}, {MOODS[version]}."


def first_corpus() -> list[Chunk]:
    return [Chunk(id=f"doc-{n}", text=text_of(n), meta={"n": n}) for n in range(CORPUS)]


def next_day(first: list[Chunk]) -> tuple[list[Chunk], list[Chunk], list[Chunk], list[Chunk]]:
    """The corpus re-crawled: the last REMOVED chunks gone, CHANGED others with a new text,
    NEW chunks added. Returns (the new corpus, the changed, the new, the removed)."""
    kept, removed = first[: CORPUS - REMOVED], first[CORPUS - REMOVED :]
    changed_at = set(range(0, len(kept), len(kept) // CHANGED)[:CHANGED])
    second, changed = [], []
    for position, chunk in enumerate(kept):
        if position in changed_at:
            chunk = dataclasses.replace(chunk, text=text_of(position, version=1))
            changed.append(chunk)
        second.append(chunk)
    new = [
        Chunk(id=f"doc-{n}", text=text_of(n, 2), meta={"n": n}) for n in range(CORPUS, CORPUS + NEW)
    ]
    return second + new, changed, new, removed


def token_count(chunks: list[Chunk]) -> int:
    return sum(t.length for t in shared_encoder().tokenize([c.text for c in chunks]))


@pytest.fixture
def lancedb_settings(redis_server, tmp_path: Path) -> Settings:
    return Settings(
        redis_url=redis_server.url,
        namespace=f"ri{uuid.uuid4().hex[:10]}",
        consumer="reingest",
        block_ms=100,
        log_format="json",
        sink=local_sink_url("lancedb", tmp_path),
        sink_table="chunks",
        frozen_queries=False,  # eager is enough here; the frozen graph is slow on a small CPU
        cpu_int8=False,
        slice_ms=0,  # bulk only: whole token-budget batches, no query slices to size them to
    )


async def test_a_reingested_corpus_embeds_only_what_changed(
    lancedb_settings: Settings, encoder, tmp_path: Path
) -> None:
    settings = lancedb_settings
    first = first_corpus()
    second, changed, new, removed = next_day(first)
    unchanged = [c for c in second if c not in changed and c not in new]
    assert len(unchanged) == CORPUS - REMOVED - CHANGED
    async with sink_fleet(settings, tmp_path) as fleet:
        client = fleet.client
        async with fleet.run() as (producer, worker):
            await producer.enqueue(first, job="docs")
            run_one = await producer.wait_for_job("docs", timeout=300)
            assert (run_one.done, run_one.cache_hits, run_one.cache_misses) == (CORPUS, 0, CORPUS)
            assert worker.stats.embedded == CORPUS
            before = dataclasses.replace(worker.stats)
            # the next day: the job's id record has expired (EMBEDFLEET_JOB_IDS_FINISHED_TTL_S),
            # so every chunk of the corpus is sent again and only the cache can tell
            await client.delete(*(keys.job_ids("docs") for keys in settings.keys.partitions_keys))
            await producer.enqueue(second, job="docs")
            run_two = await producer.wait_for_job("docs", timeout=300)
            data = report(await take_snapshot(client, settings.keys), None, settings)
        # the model ran for the changed and new chunks only, token for token
        assert worker.stats.embedded - before.embedded == CHANGED + NEW
        assert worker.stats.real_tokens - before.real_tokens == token_count(changed + new)
        hits, saved = len(unchanged), token_count(unchanged)
        assert worker.stats.cache.hits - before.cache.hits == hits
        assert worker.stats.cache.tokens_saved - before.cache.tokens_saved == saved
        # the counters as a job, status and its JSON see them; done and dead as ever
        assert (run_two.enqueued, run_two.done, run_two.dead) == (2 * CORPUS, 2 * CORPUS, 0)
        assert (run_two.cache_hits, run_two.tokens_saved) == (hits, saved)
        assert run_two.cache_misses == CORPUS + CHANGED + NEW
        assert data["vector_cache"]["hits"] == hits
        assert data["vector_cache"]["tokens_saved"] == saved
        assert 0 < data["vector_cache"]["bytes"] <= settings.vector_cache_mb * 1_000_000
        docs = next(j for j in data["jobs"] if j["job"] == "docs")
        assert (docs["cache_hits"], docs["tokens_saved"]) == (hits, saved)

        # deletions: the rows of the removed ids go, nothing else
        gone = await prune(settings, "docs", {c.id for c in second})
        assert gone == sorted(c.id for c in removed)
        target = parse_sink_url(settings.sink, settings.sink_table)
        with open_backend(target) as backend:
            rows = backend.export_rows()
        assert [r.id for r in rows] == sorted(c.id for c in second)
        # every row holds the vector of its current text, as sentence-transformers makes it
        current = {c.id: c for c in second}
        reference = reference_model().encode(
            [current[r.id].text for r in rows], normalize_embeddings=True, batch_size=256
        )
        stored = np.stack([np.asarray(r.vector, np.float32) for r in rows])
        stored /= np.linalg.norm(stored, axis=1, keepdims=True)
        cosines = np.sum(stored * reference, axis=1)
        assert cosines.min() >= 0.999, f"worst row {rows[int(cosines.argmin())].id}"
        assert all(r.text == current[r.id].text and r.meta == current[r.id].meta for r in rows)


async def test_another_prompt_dimension_or_precision_reembeds(settings, workers, client) -> None:
    settings = settings.model_copy(
        update={"frozen_queries": False, "cpu_int8": False, "slice_ms": 0}
    )
    chunks = [Chunk(id=f"o{n}", text=text_of(n)) for n in range(20)]
    async with Producer(settings, client) as producer, workers.run(settings, client=client) as w:

        async def embedded(job: str, reembed: bool = False, **options: Any) -> int:
            """How many of the chunks the model ran for, sent as ``job`` with ``options``."""
            before = w.stats.embedded
            await producer.enqueue(
                chunks, job=job, options=EmbeddingOptions(**options), reembed=reembed
            )
            await producer.wait_for_job(job, timeout=120)
            return w.stats.embedded - before

        assert await embedded("plain") == 20
        assert await embedded("plain-again") == 0  # the same chunks: every one a hit
        assert await embedded("prompt", prompt="passage: ") == 20
        assert await embedded("dimensions", dimensions=128) == 20
        assert await embedded("float32", dtype="float32") == 20
        assert await embedded("binary", dtype="binary") == 20
        assert await embedded("float32-again", dtype="float32") == 0
        assert await embedded("dimensions-again", dimensions=128) == 0
        assert await embedded("forced", reembed=True) == 20  # the opt-out
    # a result from the cache is the result the model gave, byte for byte
    results: dict[str, dict[str, Result]] = {}
    for _, fields in await client.xrange(settings.keys.results):
        result = decode_result(fields[b"m"])
        results.setdefault(result.job or "", {})[result.id] = result
    for job, again in (("plain", "plain-again"), ("float32", "float32-again")):
        for chunk in chunks:
            made, cached = results[job][chunk.id], results[again][chunk.id]
            assert made.vector.tobytes() == cached.vector.tobytes()
            assert (made.dtype, made.dim) == (cached.dtype, cached.dim)
    assert results["dimensions-again"]["o0"].dim == 128


def test_the_metrics_count_hits_misses_and_tokens_saved() -> None:
    metrics = WorkerMetrics()
    metrics.vector_cache_checked(hits=7, misses=3, tokens_saved=91)
    value = metrics.registry.get_sample_value
    assert value("embedfleet_vector_cache_hits_total") == 7
    assert value("embedfleet_vector_cache_misses_total") == 3
    assert value("embedfleet_tokens_saved_total") == 91


@pytest.fixture(params=["lancedb", "qdrant-local", "pgvector"])
def database_url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    pg = None
    if request.param == "pgvector":
        pg = running_pg(request.getfixturevalue("pg_session_server")).get_uri()
    return local_sink_url(request.param, tmp_path, pg)


def test_prune_deletes_only_the_jobs_rows_not_sent_again(database_url: str) -> None:
    table = f"prune_{uuid.uuid4().hex[:8]}"
    target = parse_sink_url(database_url, table)
    vector = np.ones(4, dtype=np.float16)
    rows = [Result(id=f"a{n}", model="m", vector=vector, job="a") for n in range(5)]
    rows += [
        Result(id="b0", model="m", vector=vector, job="b"),
        Result(id="it's", model="m", vector=vector, job="a"),
    ]
    with open_backend(target) as backend:
        backend.setup("m", 4)
        backend.upsert(rows)
        assert backend.job_ids("a") == {"a0", "a1", "a2", "a3", "a4", "it's"}
        assert prune_job(backend, "a", {"a0", "a2"}, dry_run=True) == ["a1", "a3", "a4", "it's"]
        assert len(backend.export_rows()) == 7  # a dry run deletes nothing
        assert prune_job(backend, "a", {"a0", "a2", "b0"}) == ["a1", "a3", "a4", "it's"]
        assert sorted(r.id for r in backend.export_rows()) == ["a0", "a2", "b0"]  # b's row stays
        assert prune_job(backend, "a", {"a0", "a2"}) == []


def docs_table(folder: Path) -> tuple[str, SinkTarget]:
    """A LanceDB table ``chunks`` in ``folder`` with the rows d0 to d3 of job ``docs``: its sink
    URL and its target."""
    sink = local_sink_url("lancedb", folder)
    target = parse_sink_url(sink, "chunks")
    vector = np.ones(4, dtype=np.float16)
    with open_backend(target) as backend:
        backend.setup("m", 4)
        backend.upsert([Result(id=f"d{n}", model="m", vector=vector, job="docs") for n in range(4)])
    return sink, target


def test_the_prune_verb(tmp_path: Path) -> None:
    sink, target = docs_table(tmp_path)
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"id": f"d{n}", "text": "t"}) + "\n" for n in (0, 2)))
    env = {
        "EMBEDFLEET_SINK": sink,
        "EMBEDFLEET_SINK_TABLE": "chunks",
        "EMBEDFLEET_LOG_FORMAT": "json",
    }
    runner = CliRunner()
    args = ["prune", "--job", "docs", "--keep", str(corpus)]
    dry = runner.invoke(main, [*args, "--dry-run", "--json"], env=env)
    assert dry.exit_code == 0, dry.output
    assert json.loads(dry.output) == {"job": "docs", "dry_run": True, "pruned": ["d1", "d3"]}
    done = runner.invoke(main, args, env=env)
    assert done.exit_code == 0, done.output
    assert "deleted 2 rows of job 'docs'" in done.output
    with open_backend(target) as backend:
        assert [r.id for r in backend.export_rows()] == ["d0", "d2"]
    refused = runner.invoke(main, args, env={**env, "EMBEDFLEET_SINK": "redis"})
    assert refused.exit_code == 1 and "database sink" in refused.output


def test_enqueue_prune_deletes_the_rows_the_corpus_lost(redis_server, tmp_path: Path) -> None:
    """`enqueue --job J --prune`: once the corpus is sent, the job's rows of ids it no longer
    has go; with a rejected line nothing is pruned (its id was not sent, its row would go)."""
    sink, target = docs_table(tmp_path)
    corpus = tmp_path / "corpus.jsonl"
    lines = [json.dumps({"id": f"d{n}", "text": f"text {n}"}) for n in (0, 1, 5)]
    env = {
        "EMBEDFLEET_REDIS_URL": redis_server.url,
        "EMBEDFLEET_NAMESPACE": f"ep{uuid.uuid4().hex[:8]}",
        "EMBEDFLEET_SINK": sink,
        "EMBEDFLEET_SINK_TABLE": "chunks",
        "EMBEDFLEET_LOG_FORMAT": "json",
    }
    runner = CliRunner()
    corpus.write_text("\n".join([*lines, '{"id": "d2", "text": ""}']) + "\n")  # d2's line is bad
    refused = runner.invoke(main, ["enqueue", str(corpus), "--job", "docs", "--prune"], env=env)
    assert refused.exit_code != 0 and "not pruned" in refused.output
    with open_backend(target) as backend:
        assert len(backend.export_rows()) == 4
    corpus.write_text("\n".join(lines) + "\n")
    args = ["enqueue", str(corpus), "--job", "docs", "--prune", "--reembed", "--json"]
    done = runner.invoke(main, args, env=env)
    assert done.exit_code == 0, done.output
    assert json.loads(done.output.strip().splitlines()[-1])["pruned"] == ["d2", "d3"]
    with open_backend(target) as backend:
        assert [r.id for r in backend.export_rows()] == ["d0", "d1"]
    no_job = runner.invoke(main, ["enqueue", str(corpus), "--prune"], env=env)
    assert no_job.exit_code == 2 and "--prune needs --job" in no_job.output
    # --reembed marked every chunk it sent (the protocol's reembed field)
    direct = redis.Redis.from_url(redis_server.url)
    entries: Any
    try:
        entries = direct.xrange(Keys(env["EMBEDFLEET_NAMESPACE"]).ingest)
    finally:
        direct.close()
    sent = [decode_chunk(fields[PAYLOAD_FIELD]) for _, fields in entries]
    assert {c.id: c.reembed for c in sent if c.reembed} == {"d0": True, "d1": True, "d5": True}


async def test_the_cache_keeps_to_its_bound_least_recently_used_first(settings, client) -> None:
    """The store script's own bound (not the server's maxmemory policy): past it the least
    recently used entries go, a looked-up entry counts as used, and idle ones past the TTL go
    at the next store; the bytes it counts are what it holds."""
    cache = VectorCache(client, settings.keys, max_mb=1, ttl_s=3600)
    keys = settings.keys
    entry = pack_entry(Result(id="", model="m", vector=np.ones(384, np.float16)), tokens=9)
    names = [f"v1:{n:032x}" for n in range(15)]
    assert await cache.store(keys, [(names[0], entry)]) == 0
    # what the script counts for an entry (what Redis allocates for it, shared/scripts/
    # vector_cache_put.lua), and no less than Redis reports for the cache's keys
    size = int(await client.hget(keys.vector_cache_stats, "bytes"))
    reported = sum(
        [
            await client.memory_usage(key, samples=0)
            for key in (keys.vector_cache, keys.vector_cache_lru)
        ]
    )
    assert len(entry) < size and reported <= size + 1000  # 1000: the two keys' fixed parts
    cache.bound_bytes = 10 * size  # room for ten
    assert await cache.store(keys, [(name, entry) for name in names[1:10]]) == 0
    # stored in this order, a few seconds ago (not all in one millisecond: ties go by name)
    past = int(time.time() * 1000) - 10_000
    await client.zadd(keys.vector_cache_lru, {n: past + i for i, n in enumerate(names[:10])})
    found = await cache.lookup(keys, [names[0]])  # the oldest, used again: kept
    assert found[0] is not None and found[0].tokens == 9
    assert await cache.store(keys, [(name, entry) for name in names[10:]]) == 5
    kept = await cache.lookup(keys, names)
    assert [name for name, hit in zip(names, kept, strict=True) if hit] == [
        names[0],
        *names[6:],
    ]
    stats = await client.hgetall(keys.vector_cache_stats)
    assert int(stats[b"bytes"]) == 10 * size and int(stats[b"evicted"]) == 5
    assert await client.hlen(keys.vector_cache) == await client.zcard(keys.vector_cache_lru) == 10
    # an entry idle past the TTL goes at the next store, whatever the room
    await client.zadd(keys.vector_cache_lru, {names[0]: 1}, xx=True)  # last used in 1970
    assert await cache.store(keys, [(names[6], entry)]) == 1
    assert (await cache.lookup(keys, [names[0]]))[0] is None


def test_status_shows_the_cache_in_its_text_view() -> None:
    cache: dict[str, Any] = {"max_mb": 256, "hits": 1700, "misses": 300, "tokens_saved": 20_000}
    cache |= {"hit_ratio": 0.85, "bytes": 1_800_000, "evicted": 0}
    jobs = [{"job": "docs", "enqueued": 2000, "done": 2000, "dead": 0, "remaining": 0}]
    lines = _render_cache(cache) + _render_jobs([{**jobs[0], "cache_hits": 1700}], 10)
    text = "\n".join(lines)
    assert "vector cache  1,700 hits, 300 misses (85.0% hits), 20,000 tokens saved" in text
    assert "1.8 of 256 MB, 0 evicted" in text
    assert "cache hits" in lines[2] and lines[3].split()[-2] == "1,700"
    assert "off" in _render_cache({"max_mb": 0})[0]
