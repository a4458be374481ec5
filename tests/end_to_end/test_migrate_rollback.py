"""Issue 40, point 8: `migrate rollback` after producers moved to the new lane loses nothing.

The scenario, against a real redis-server, LanceDB and two `embedfleet worker` processes: model
A (the packaged model) writes ``emb_a`` in the default lane, model B (a tiny random-weight
BERT, tests/model_zoo.py) writes ``emb_b`` in lane ``tiny``. ``embedfleet migrate start``
copies A's table, ``switch`` points the readers' alias at B's table, the producers move to lane
B and write 200 new chunks there, then ``rollback`` points the alias back at A's table. Every
one of the 200 must be in A's table (exported and found by a search through the alias), each
id once, and the verbs must say truthfully which tables are written. Before the fix the dual
write copied A -> B only, so A held none of the 200 while `switch` said "both tables are still
written".
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from embedfleet.ops import migration as mig
from embedfleet.ops.search import search
from embedfleet.producer import Producer
from embedfleet.server import (
    ServerProcess,
    embedded_server_binary,
    isolated_settings,
    preferred_server_binary,
)
from embedfleet.shared.protocol import Chunk, Result
from embedfleet.shared.redis_conn import connect
from embedfleet.shared.vector_cache import VectorCache, pack_entry
from embedfleet.sinks import open_backend, parse_sink_url
from tests import forks
from tests.conftest import WorkerLauncher, cli_env, until
from tests.end_to_end.test_migrate import LANE, chunks, corpus_texts, tiny_model_dir

# the slow tier (make test-full, CI): starts processes or servers, or compiles a model
pytestmark = pytest.mark.slow

AFTER_SWITCH = 200  # the figure: chunks written through lane B after the switch


def stored_ids(url: str, table: str) -> list[str]:
    """Every id of ``table``, one entry per stored row (the export an operator would read)."""
    with open_backend(parse_sink_url(url, table)) as backend:
        return [row.id for row in backend.export_rows()]


def migrate(env: dict[str, str], *args: str, as_json: bool = True) -> tuple[dict[str, Any], str]:
    """`embedfleet migrate <args>` as a process: its --json report (or {}), and its stdout."""
    command = ["migrate", *args, *(["--json"] if as_json else [])]
    done = forks.run(command, text=True, timeout=600, env=env)
    assert done.returncode == 0, (args, done.stdout[-2000:], done.stderr[-2000:])
    assert "Traceback" not in done.stderr, done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    return (json.loads(lines[-1]) if lines else {}), done.stdout


async def test_rollback_after_the_producers_moved_to_the_new_lane_loses_nothing(
    redis_server: Any, tmp_path: Path
) -> None:
    url = f"lancedb://{tmp_path / 'lancedb'}"
    a_table, b_table, alias = "emb_a", "emb_b", "emb_live"
    base = isolated_settings(redis_server.url, sink=url, dtype="float32")
    a = base.model_copy(update={"sink_table": a_table})
    b = base.model_copy(
        update={"sink_table": b_table, "model_lane": LANE, "model": str(tiny_model_dir())}
    )
    reader = base.model_copy(update={"sink_table": alias})
    common = {
        "EMBEDFLEET_SINK": url,
        "EMBEDFLEET_DTYPE": "float32",
        "EMBEDFLEET_FROZEN_QUERIES": "false",
        "EMBEDFLEET_FROZEN_BULK": "false",
        "EMBEDFLEET_THREADS": "1",  # two worker processes share two cores
    }
    env_a = {**common, "EMBEDFLEET_SINK_TABLE": a_table}
    env_b = {
        **common,
        "EMBEDFLEET_SINK_TABLE": b_table,
        "EMBEDFLEET_MODEL_LANE": LANE,
        "EMBEDFLEET_MODEL": str(tiny_model_dir()),
    }
    cli = cli_env(a, **env_a, EMBEDFLEET_LOG_LEVEL="warning")
    texts = corpus_texts(20 + AFTER_SWITCH)
    corpus = chunks("doc", texts[:20])
    after = [
        Chunk(id=f"after-{n:03d}", text=text, meta={"n": n}) for n, text in enumerate(texts[20:])
    ]
    launcher = WorkerLauncher(a, lambda: None, tmp_path)
    client = connect(base.effective_redis_url)
    try:
        launcher.process("model-a", a, **env_a)
        launcher.process("model-b", b, **env_b)
        async with Producer(a, client) as lane_a, Producer(b, client) as lane_b:
            await lane_a.enqueue(corpus, job="corpus")
            await lane_a.wait_for_job("corpus", timeout=300)

            started, _ = await asyncio.to_thread(
                migrate,
                cli,
                "start",
                "--to-lane",
                LANE,
                "--to-table",
                b_table,
                "--alias",
                alias,
                "--idle-timeout",
                "300",
            )
            assert started["verified"] and started["in_target"] == len(corpus)
            switched, _ = await asyncio.to_thread(migrate, cli, "switch")
            assert switched["alias_points_at"] == b_table

            # the producers move to the new lane, as `finish` tells them to
            await lane_b.enqueue(after, job="after")
            await lane_b.wait_for_job("after", timeout=300)
            assert sorted(stored_ids(url, b_table)) == sorted(
                [c.id for c in corpus] + [c.id for c in after]
            )

            rolled, _ = await asyncio.to_thread(migrate, cli, "rollback")
            assert rolled["alias_points_at"] == a_table and rolled["queued"] >= 0
            # said as it is done (a second rollback changes nothing): both ways, until finish
            _, said = await asyncio.to_thread(migrate, cli, "rollback", as_json=False)
            assert f"what is written to '{b_table}' (lane {LANE}) is copied to lane default" in said
            assert f"what is written to '{a_table}' (lane default) is copied to lane {LANE}" in said
            # the copies of lane B's writes are queued in lane A (same round trip as lane B's
            # acknowledgement): wait until lane A has embedded what it was given
            await until(lambda: mig._idle(client, a.keys), timeout=300)

            in_a = stored_ids(url, a_table)
            missing = sorted({c.id for c in after} - set(in_a))
            print(
                f"\nafter rollback: {len(missing)} of {AFTER_SWITCH} chunks written since the "
                f"switch absent from {a_table!r}"
            )
            assert not missing, f"{len(missing)} of {AFTER_SWITCH} absent after rollback"
            assert len(in_a) == len(set(in_a)) == len(corpus) + AFTER_SWITCH  # each id once
            # found through the alias by a search, embedded by model A (the alias's table)
            for chunk in (after[0], after[99], after[-1]):
                hits = await search(reader, parse_sink_url(url, alias), chunk.text, 1, 60.0)
                assert hits[0].id == chunk.id, (chunk.id, hits)

            # no ping-pong: a copy is never copied back (each lane's job counted 200 once)
            await until(lambda: mig._idle(client, b.keys), timeout=300)
            assert (await lane_b.progress("after")).enqueued == AFTER_SWITCH
            assert (await lane_a.progress("after")).enqueued == AFTER_SWITCH

            # the verbs say which tables are written, and `finish` stops both copies
            status, _ = await asyncio.to_thread(migrate, cli, "status")
            assert status["copies"] == [
                {"from_table": a_table, "to_lane": LANE, "to_table": b_table},
                {"from_table": b_table, "to_lane": "", "to_table": a_table},
            ], status
            finished, _ = await asyncio.to_thread(migrate, cli, "finish")
            assert finished["copies"] == [] and not finished["dual_write"]
    finally:
        for process in launcher.processes:
            process.stop()
        await client.aclose()


def test_the_verbs_text_says_which_tables_are_written() -> None:
    """The text each verb prints is built from the record: no claim of a copy that is off."""
    settings = isolated_settings("redis://127.0.0.1:1/0")
    target = parse_sink_url("lancedb:///nowhere", "emb_a")
    record = {
        "source": "emb_a",
        "source_lane": "",
        "target": "emb_b",
        "target_lane": LANE,
        "alias": "emb_live",
        "state": "copying",
        "dual_write": "1",
    }
    copying = mig.Migration(settings, target, dict(record))
    assert [dataclasses.asdict(c) for c in copying.copies] == [
        {"from_table": "emb_a", "to_lane": LANE, "to_table": "emb_b"}
    ]
    text = copying.describe_copies()
    assert "'emb_a' (lane default) is copied to lane tiny" in text
    assert "not copied back" in text
    both = mig.Migration(settings, target, {**record, "dual_write_back": "1"})
    assert len(both.copies) == 2 and "not copied back" not in both.describe_copies()
    finished = mig.Migration(settings, target, {**record, "dual_write": "", "state": "finished"})
    assert finished.copies == [] and "no table is copied" in finished.describe_copies()


# --- the vector cache's bound (issue 40, smaller point) --------------------------------------
CACHE_MB = 8  # the figure: 9.6 MB held for a bound of 8 MB


@pytest.mark.parametrize("server", ["debian", "embedded"])
async def test_the_vector_cache_stays_within_its_bound_as_redis_counts_it(server: str) -> None:
    """The cache filled to twice its bound with MiniLM's vectors (384 x fp16), as a worker
    stores them (``VectorCache.store``, 256 a window): what Redis reports for the cache's keys
    (MEMORY USAGE, every element counted) stays within EMBEDFLEET_VECTOR_CACHE_MB."""
    binary = preferred_server_binary() if server == "debian" else embedded_server_binary()
    with ServerProcess(binary) as redis_process:
        settings = isolated_settings(redis_process.url)
        client = connect(settings.effective_redis_url)
        try:
            cache = VectorCache(client, settings.keys, max_mb=CACHE_MB, ttl_s=3600)
            rng = np.random.default_rng(40)
            keys = settings.keys
            stored = evicted = 0
            while stored < 2 * cache.bound_bytes // 800:  # twice what the bound holds
                vectors = rng.normal(size=(256, 384)).astype(np.float16)
                window = [
                    (
                        f"v1:{stored + n:032x}",
                        pack_entry(Result(id="", model="m", vector=vectors[n]), tokens=40),
                    )
                    for n in range(256)
                ]
                evicted += await cache.store(keys, window)
                stored += len(window)
            used = 0
            for key in (keys.vector_cache, keys.vector_cache_lru, keys.vector_cache_stats):
                used += int(await client.memory_usage(key, samples=0) or 0)
            held = await client.hlen(keys.vector_cache)
            counted = int((await client.hgetall(keys.vector_cache_stats))[b"bytes"])
        finally:
            await client.aclose()
    print(
        f"\n{server}: {stored:,} entries stored, {held:,} held, {evicted:,} evicted; Redis "
        f"reports {used / 1e6:.2f} MB for a bound of {CACHE_MB} MB "
        f"({used / (CACHE_MB * 1e6):.2f}x), the script counts {counted / 1e6:.2f} MB"
    )
    assert evicted > 0 and held + evicted == stored
    assert used <= CACHE_MB * 1_000_000, f"{used / (CACHE_MB * 1e6):.2f}x the bound"
    assert counted >= used  # what status shows is no less than what Redis holds
    # and the bound is used, not wasted: at least 80% of it holds entries
    assert used >= 0.8 * CACHE_MB * 1_000_000


async def test_the_servers_own_figure_bounds_the_cache_when_the_count_is_short(
    settings: Any, client: Any
) -> None:
    """The guard for another allocator or layout: when the count the script keeps is below
    what MEMORY USAGE reports (here the count halved by hand), the script evicts on the
    server's figure, and the cache's keys stay within the bound all the same."""
    cache = VectorCache(client, settings.keys, max_mb=1, ttl_s=3600)
    keys = settings.keys
    vector = np.ones(384, np.float16)
    entry = pack_entry(Result(id="", model="m", vector=vector), tokens=40)
    names = iter(f"v1:{n:032x}" for n in range(100_000))

    async def fill(windows: int) -> None:
        for _ in range(windows):
            await cache.store(keys, [(next(names), entry) for _ in range(256)])

    async def used() -> int:
        total = 0
        for key in (keys.vector_cache, keys.vector_cache_lru):
            total += int(await client.memory_usage(key, samples=0) or 0)
        return total

    await fill(8)  # about twice the bound
    counted = int(await client.hget(keys.vector_cache_stats, "bytes"))
    await client.hset(keys.vector_cache_stats, "bytes", counted // 2)
    await fill(4)  # ~1,000 entries the halved count alone would let in
    assert await used() <= 1_000_000


async def test_a_server_that_refuses_memory_usage_still_stores_within_the_count(
    redis_server: Any, settings: Any, client: Any
) -> None:
    """MEMORY renamed or outside the ACL user's rights (managed services): the store works and
    the script's own count bounds the cache."""
    await client.execute_command("ACL SETUSER nomemory on >pw ~* &* +@all -memory")
    url = f"redis://nomemory:pw@127.0.0.1:{redis_server.port}/0"
    limited = connect(url)
    try:
        cache = VectorCache(limited, settings.keys, max_mb=1, ttl_s=3600)
        entry = pack_entry(Result(id="", model="m", vector=np.ones(384, np.float16)), tokens=4)
        for window in range(8):  # about twice the bound
            names = [f"v1:{window * 256 + n:032x}" for n in range(256)]
            await cache.store(settings.keys, [(name, entry) for name in names])
    finally:
        await limited.aclose()
    counted = int(await client.hget(settings.keys.vector_cache_stats, "bytes"))
    used = 0
    for key in (settings.keys.vector_cache, settings.keys.vector_cache_lru):
        used += int(await client.memory_usage(key, samples=0) or 0)
    assert used <= counted <= 1_000_000
