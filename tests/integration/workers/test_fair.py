"""Fair share between tenants (issue 30): the scheduler, the tenant policy, the keys, fair reads
against a real Redis, accounting that matches the tokenizer, and a SIGKILLed worker mid-read.

The throughput figures (B's completion time behind A's backlog, a 3:1 split measured over a
window) are benchmarks, not tests: loadtest/fairness.py, docs/BENCHMARKS.md.
"""

from __future__ import annotations

import asyncio
import json
import signal
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from embedfleet.ops.status import report, take_snapshot
from embedfleet.producer import Producer
from embedfleet.producer.client import TenantBacklogFullError
from embedfleet.shared.fleet import read_fleet
from embedfleet.shared.keys import Keys, key_slot
from embedfleet.shared.protocol import PAYLOAD_FIELD, Chunk, ProtocolError, decode_chunk
from embedfleet.shared.settings import Settings, SettingsError, load_settings
from embedfleet.shared.tenants import TenantPolicy
from embedfleet.workers.consumer import StreamConsumer
from embedfleet.workers.fair import FairShare
from tests.conftest import WorkerLauncher, cli_env, start_cli, until

# --- the scheduler (pure) -------------------------------------------------------------------


def run_rounds(fair: FairShare, rounds: int, count: int, backlogs: dict[str, int]) -> Counter[str]:
    """``rounds`` reads of ``count``, each tenant given what it asked for (its backlog
    permitting), the backlogs drawn down."""
    taken: Counter[str] = Counter()
    left = dict(backlogs)
    for _ in range(rounds):
        asks = fair.plan(count, left)
        got = {t: min(n, left[t]) for t, n in asks.items()}
        fair.settle(asks, got)
        for tenant, n in got.items():
            left[tenant] -= n
            taken[tenant] += n
    return taken


def test_weights_3_to_1_share_reads_3_to_1_whatever_the_backlogs() -> None:
    fair = FairShare(TenantPolicy(weights={"a": 3, "b": 1}).weight)
    taken = run_rounds(fair, 200, 100, {"a": 10**9, "b": 10**6})
    assert taken["a"] / taken["b"] == pytest.approx(3.0, rel=0.01)
    assert sum(taken.values()) >= 200 * 98, "each read is (nearly) full"


def test_a_light_tenant_gets_all_it_has_and_the_rest_goes_to_the_others() -> None:
    fair = FairShare(TenantPolicy().weight)
    asks = fair.plan(100, {"big": 10**6, "small": 7})
    assert asks == {"big": 93, "small": 7}, "work-conserving: the read stays full"
    fair.settle(asks, asks)
    assert "small" not in fair.credit or fair.credit["small"] < 1


def test_no_tenant_is_starved_by_a_tiny_weight() -> None:
    fair = FairShare(TenantPolicy(weights={"tiny": 0.01, "huge": 100}).weight)
    taken = run_rounds(fair, 2000, 64, {"tiny": 10**6, "huge": 10**9})
    expected = 2000 * 64 * 0.01 / 100.01  # 12.8 entries
    assert expected - 1 <= taken["tiny"] <= expected + 1


def test_an_idle_tenant_saves_up_no_burst_and_a_held_one_is_left_out() -> None:
    fair = FairShare(TenantPolicy().weight)
    asks = fair.plan(100, {"a": 10, "b": 10**6})
    fair.settle(asks, asks)
    asks = fair.plan(100, {"a": 0, "b": 10**6})
    assert asks == {"b": 100} and "a" not in fair.credit
    fair.settle(asks, asks)
    assert fair.plan(100, {"a": 10**6, "b": 10**6}, held=frozenset({"a"})) == {"b": 100}


def test_a_tenant_given_less_than_asked_has_run_out_and_loses_its_credit() -> None:
    fair = FairShare(TenantPolicy().weight)
    asks = fair.plan(11, {"a": 100, "b": 100})
    fair.settle(asks, {"a": asks["a"], "b": 1})  # b's backlog was in flight elsewhere
    assert "b" not in fair.credit and "a" in fair.credit


def test_a_tenants_ask_is_split_over_its_partitions_by_backlog() -> None:
    fair = FairShare(TenantPolicy().weight)
    shares = fair.split({"a": 100}, {"a": {"s0": 300, "s1": 100, "s2": 0}})
    assert shares == {"s0": 75, "s1": 25}


# --- the policy and the keys ------------------------------------------------------------------


def test_the_tenant_map_resolves_owners_then_jobs_then_the_default() -> None:
    policy = load_settings(
        tenant_map="owner:abc=rag,docs-*=search,*-backfill=batch", default_tenant="misc"
    ).tenant_policy
    assert policy.resolve(owner="abc", job="docs-1") == "rag"
    assert policy.resolve(job="docs-1") == "search"
    assert policy.resolve(job="x-backfill") == "batch"
    assert policy.resolve(job="other") == "misc"
    assert policy.resolve("given", job="docs-1") == "given", "a named tenant wins"
    assert policy.wire("misc") is None and policy.named(None) == "misc"


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("tenant_weights", "a=0"),
        ("tenant_weights", "a"),
        ("tenant_max_backlog", "a=lots"),
        ("tenant_map", "docs-*=bad|name"),
        ("default_tenant", "no:colons"),
    ],
)
def test_bad_tenant_settings_are_refused_naming_the_variable(name: str, value: str) -> None:
    with pytest.raises(SettingsError, match=f"EMBEDFLEET_{name.upper()}"):
        load_settings(**{name: value})


def test_tenant_streams_share_their_partitions_slot_and_route_back() -> None:
    keys = Keys(namespace="ns", partitions=6)
    for partition in keys.partitions_keys:
        stream = partition.ingest_for("a.team-1")
        assert stream == partition.ingest + ":t:a.team-1"
        assert key_slot(stream) == key_slot(partition.ingest) == key_slot(partition.tenants)
        assert keys.owner_of(stream) == partition and keys.tenant_of(stream) == "a.team-1"
    assert keys.tenant_of(keys.partition(0).ingest) is None
    plain = Keys(namespace="ns")
    assert plain.ingest_for(None) == "ns:ingest" and plain.owner_of("ns:ingest:t:b") == plain
    with pytest.raises(ValueError, match="not a valid name"):
        plain.ingest_for("x:y")


def test_the_tenant_field_is_checked_and_survives_the_wire() -> None:
    from embedfleet.shared.protocol import encode_chunk

    chunk = Chunk(id="1", text="t", job="j", tenant="team-a")
    assert decode_chunk(encode_chunk(chunk)).tenant == "team-a"
    with pytest.raises(ProtocolError, match="'tenant'"):
        decode_chunk(encode_chunk(Chunk(id="1", text="t", tenant="a|b")))


# --- fair reads against Redis -------------------------------------------------------------


def chunks(prefix: str, count: int, text: str = "a short text to embed") -> list[Chunk]:
    return [Chunk(id=f"{prefix}{i}", text=f"{text} {i}") for i in range(count)]


@pytest.mark.parametrize("partitions", [1, 3])
async def test_reads_give_each_tenant_its_weight_however_large_the_others_backlog(
    settings: Settings, client: aioredis.Redis, partitions: int
) -> None:
    """A's backlog is 20 times B's; with weights 3:1 every read until B runs out is about 3:1,
    then A gets the whole read; every entry is read once, over every partition."""
    settings = settings.model_copy(update={"partitions": partitions, "tenant_weights": "a=3,b=1"})
    async with Producer(settings, client) as producer:
        await producer.enqueue(chunks("a", 2000), job="ja", tenant="a")
        await producer.enqueue(chunks("b", 100), job="jb", tenant="b")
        await producer.enqueue(chunks("d", 50), job="jd")  # the default tenant's plain stream
        backlogs = await producer.partition_backlogs()
    assert sum(b.total for b in backlogs) == 2150
    consumer = StreamConsumer(client, settings.keys, "reader", policy=settings.tenant_policy)
    await consumer.setup()
    seen: Counter[str] = Counter()
    first_reads: list[Counter[str]] = []
    while len(read := await consumer.read_ingest(100, block_ms=10)):
        per_tenant = Counter(consumer.tenant_of(entry.stream) for entry in read)
        first_reads.append(per_tenant)
        seen.update(entry.entry_id + entry.stream for entry in read)
    await consumer.finish_waiting()  # the idle wait's blocking reads end within 10 ms
    assert sum(seen.values()) == len(seen) == 2150, "every entry read once"
    # both a and b (and the default) have work in the first reads: 3:1:1 by weight
    early = first_reads[0]
    assert early["b"] >= 15 and early["default"] >= 15 and early["a"] >= 50
    # b's 100 are read within its share of the first reads, not after a's 2,000
    reads_until_b_done = next(
        i for i in range(len(first_reads)) if sum(r["b"] for r in first_reads[: i + 1]) >= 100
    )
    assert reads_until_b_done <= 6
    assert set(consumer.ingest_streams) == {
        p.ingest_for(t) for p in settings.keys.partitions_keys for t in (None, "a", "b")
    }


async def test_a_tenant_at_its_max_backlog_waits_then_raises(
    settings: Settings, client: aioredis.Redis
) -> None:
    settings = settings.model_copy(
        update={"tenant_max_backlog": "small=30", "tenant_backlog_wait_s": 0.3}
    )
    async with Producer(settings, client, tenant="small") as producer:
        assert await producer.enqueue(chunks("s", 30), job="js") == 30
        assert await producer.tenant_backlog() == 30
        with pytest.raises(TenantBacklogFullError, match="small holds 30 of 30"):
            await producer.enqueue(chunks("t", 5), job="js")
        # another tenant is not held up by it
        assert await producer.enqueue(chunks("o", 5), job="jo", tenant="other") == 5


# --- workers: accounting and a SIGKILL --------------------------------------------------------


def tokenizer_counts(texts: list[str], max_length: int) -> list[int]:
    """Token counts as the model's own tokenizer gives them (special tokens in, cut at the
    model's maximum), from the model directory's tokenizer.json, not the worker's code."""
    from tokenizers import Tokenizer

    from embedfleet.shared.model_path import resolve_model_path
    from embedfleet.shared.settings import PACKAGED_MODEL

    tokenizer = Tokenizer.from_file(str(resolve_model_path(PACKAGED_MODEL) / "tokenizer.json"))
    tokenizer.no_padding()
    tokenizer.enable_truncation(max_length)
    return [len(encoding.ids) for encoding in tokenizer.encode_batch(texts)]


async def test_usage_per_tenant_matches_the_tokenizers_count(
    settings: Settings, workers: WorkerLauncher, client: aioredis.Redis
) -> None:
    """Tokens, chunks, dead letters and model time per tenant, job and model, counted by the
    acknowledgement itself: the tokens are the tokenizer's count of the texts embedded."""
    settings = settings.model_copy(update={"tenant_weights": "a=2", "read_count": 64})
    texts_a = [f"tenant a's text number {i} " + "word " * (i % 40) for i in range(120)]
    texts_b = [f"b {i} " + "longer words here " * (i % 300) for i in range(40)]  # some cut
    async with workers.run(settings) as worker, Producer(settings, client) as producer:
        await producer.enqueue(
            [Chunk(id=f"a{i}", text=t) for i, t in enumerate(texts_a)], job="ja", tenant="a"
        )
        await producer.enqueue(
            [Chunk(id=f"b{i}", text=t) for i, t in enumerate(texts_b)], job="jb", tenant="b"
        )
        # one bad entry on a's stream: dead-lettered, and counted for a
        bad = b"\x83\xa1v\x01\xa2id\xa3bad\xa6tenant\xa1a"  # no text
        await client.xadd(settings.keys.ingest_for("a"), {PAYLOAD_FIELD: bad})
        await producer.wait_for_job("ja", timeout=120)
        await producer.wait_for_job("jb", timeout=120)
        await until(lambda: _dead_counted(client, settings))
        model = worker.encoder.name
        max_length = worker.encoder.max_length
    state = await read_fleet(client, settings.keys, usage=True)
    usage = {(u.tenant, u.job): u for u in state.usage}
    assert {u.model for u in state.usage} == {model}
    a, b, dead = usage["a", "ja"], usage["b", "jb"], usage["a", None]
    assert (a.chunks, b.chunks, dead.dead, dead.chunks) == (120, 40, 1, 0)
    assert a.tokens == sum(tokenizer_counts(texts_a, max_length))
    assert b.tokens == sum(tokenizer_counts(texts_b, max_length))
    assert a.model_us > 0 and b.model_us > 0
    data = report(await take_snapshot(client, settings.keys), None, settings)
    rows = {(row["tenant"], row["job"]): row for row in data["usage"]}
    assert rows["a", "ja"]["tokens"] == a.tokens and rows["b", "jb"]["chunks"] == 40
    weights = {row["tenant"]: row["weight"] for row in data["tenants"]}
    assert weights == {"default": 1.0, "a": 2.0, "b": 1.0}


async def _dead_counted(client: aioredis.Redis, settings: Settings) -> bool:
    return bool(await client.xlen(settings.keys.dead))


@pytest.mark.slow  # starts two worker processes: make test-full and CI run it
async def test_a_worker_sigkilled_during_fair_reads_loses_nothing_and_leaves_nothing_pending(
    settings: Settings, workers: WorkerLauncher, client: aioredis.Redis
) -> None:
    """Three tenants' backlogs over two partitions; the first worker is SIGKILLed while it holds
    entries of the tenant streams; a second one reclaims them: every chunk has one result,
    every job is done exactly, nothing is pending on any stream, the usage counts each once."""
    settings = settings.model_copy(
        update={"partitions": 2, "tenant_weights": "a=3,b=1", "reclaim_idle_ms": 1000}
    )
    env = {
        "EMBEDFLEET_PARTITIONS": "2",
        "EMBEDFLEET_TENANT_WEIGHTS": "a=3,b=1",
        "EMBEDFLEET_RECLAIM_IDLE_MS": "1000",
        "EMBEDFLEET_READ_COUNT": "64",
        "EMBEDFLEET_THREADS": "1",
        # no forward pass, a cost per token: slow enough to be killed holding a window
        "EMBEDFLEET_BENCHMARK_STANDIN_ENCODER_US_PER_TOKEN": "150",
    }
    sizes = {"a": 600, "b": 200, None: 100}
    async with Producer(settings, client) as producer:
        for tenant, size in sizes.items():
            await producer.enqueue(chunks(str(tenant), size), job=f"j{tenant}", tenant=tenant)
        streams = [p.ingest_for(t) for p in settings.keys.partitions_keys for t in sizes]

        async def pending() -> int:
            return sum([(await client.xpending(s, settings.group))["pending"] for s in streams])

        doomed = workers.process("doomed", settings, **env)

        async def holding_tenant_entries() -> bool:
            held = [
                await client.xpending(p.ingest_for("b"), settings.group)
                for p in settings.keys.partitions_keys
            ]
            return sum(h["pending"] for h in held) > 0 and await pending() > 0

        await until(holding_tenant_entries, timeout=300)
        doomed.send_signal(signal.SIGKILL)
        await asyncio.to_thread(doomed.wait, 30)
        assert await pending() > 0, "killed holding entries"
        survivor = workers.process("survivor", settings, **env)
        progress = {
            tenant: await producer.wait_for_job(f"j{tenant}", timeout=300) for tenant in sizes
        }
        results = [r async for r in producer.results()]
        await until(lambda: _nothing_pending(pending), timeout=30)
        state = await read_fleet(client, settings.keys, usage=True)
        survivor.send_signal(signal.SIGTERM)
        await asyncio.to_thread(survivor.wait, 60)
    ids = Counter(r.id for r in results)
    expected = {c.id for tenant, size in sizes.items() for c in chunks(str(tenant), size)}
    assert set(ids) == expected and all(n == 1 for n in ids.values()), "once each"
    assert {t: (p.done, p.dead) for t, p in progress.items()} == {
        t: (n, 0) for t, n in sizes.items()
    }
    per_tenant: Counter[str | None] = Counter()
    for row in state.usage:
        per_tenant[row.tenant] += row.chunks
    assert per_tenant == Counter({t: n for t, n in sizes.items()}), "counted once each"
    assert state.streams["ingest"].length == 0


async def _nothing_pending(pending: Callable[[], Awaitable[int]]) -> bool:
    return await pending() == 0


# --- the chart ------------------------------------------------------------------------------


def test_the_chart_gives_each_listed_tenant_its_streams_triggers_and_settings() -> None:
    from tests.unit.repository.test_helm_chart import render, validate_objects

    r = render(
        {
            "partitions": 2,
            "tenants": [
                {"name": "search", "weight": 3, "maxBacklog": 100000},
                {"name": "backfill", "weight": 1, "tokenRate": 50000},
                {"name": "default", "weight": 2},  # the plain streams: no triggers of its own
            ],
        }
    )
    so = r.scaled_object("worker")
    triggers = so["spec"]["triggers"]
    keys = Keys(partitions=2)
    streams = [t["metadata"]["stream"] for t in triggers]
    assert streams == [
        *(p.ingest for p in keys.partitions_keys),
        *(p.ingest_for("search") for p in keys.partitions_keys),
        *(p.ingest_for("backfill") for p in keys.partitions_keys),
        keys.priority_streams.interactive,
        keys.priority_streams.query,
    ], "the chart's tenant streams are the ones shared/keys.py names"
    formula = so["spec"]["advanced"]["scalingModifiers"]["formula"]
    assert formula.startswith("p0 + p1 + t0p0 + t0p1 + t1p0 + t1p1 + interactive + query")
    config = r.config()
    assert config["EMBEDFLEET_TENANT_WEIGHTS"] == "search=3,backfill=1,default=2"
    assert config["EMBEDFLEET_TENANT_MAX_BACKLOG"] == "search=100000"
    assert config["EMBEDFLEET_TENANT_TOKEN_RATE"] == "backfill=50000"
    policy = load_settings(
        **{k.removeprefix("EMBEDFLEET_").lower(): v for k, v in config.items() if "TENANT" in k}
    ).tenant_policy
    assert policy.weight("search") == 3 and policy.backlog_limit("search") == 100000
    validate_objects(r)


async def test_enqueue_tenant_puts_the_lines_on_the_tenants_stream(
    settings: Settings, client: aioredis.Redis, tmp_path: Path
) -> None:
    source = tmp_path / "chunks.jsonl"
    source.write_text(
        "\n".join(
            [
                json.dumps({"id": "1", "text": "one"}),
                json.dumps({"id": "2", "text": "two"}),
                json.dumps({"id": "3", "text": "three", "tenant": "own"}),
            ]
        )
        + "\n"
    )
    env = cli_env(settings)
    process = await start_cli(
        env, "enqueue", str(source), "--job", "cli", "--tenant", "search", "--json"
    )
    out, err = await process.communicate()
    assert process.returncode == 0, err.decode()
    assert json.loads(out)["enqueued"] == 3
    keys = settings.keys
    assert await client.xlen(keys.ingest_for("search")) == 2
    assert await client.xlen(keys.ingest_for("own")) == 1, "a line's own tenant wins"
    assert await client.smembers(keys.tenants) == {b"search", b"own"}
    bad = await start_cli(env, "enqueue", str(source), "--tenant", "a:b")
    _, err = await bad.communicate()
    assert bad.returncode != 0 and b"not a tenant name" in err


async def test_a_tenant_over_its_token_rate_is_left_out_of_the_reads(
    settings: Settings, client: aioredis.Redis
) -> None:
    settings = settings.model_copy(update={"tenant_token_rate": "a=1000"})
    async with Producer(settings, client) as producer:
        await producer.enqueue(chunks("a", 10), job="ja", tenant="a")
        await producer.enqueue(chunks("b", 10), job="jb", tenant="b")
    consumer = StreamConsumer(client, settings.keys, "reader", policy=settings.tenant_policy)
    await consumer.setup()
    consumer.charge("a", 4000)  # more than its bucket (the fleet's, in Redis) holds: held
    consumer.charge("b", 10**6)  # b has no rate: not counted
    read = await consumer.read_ingest(100, block_ms=10)
    assert {consumer.tenant_of(entry.stream) for entry in read} == {"b"}
    assert len(read) == 10
    assert [key async for key in client.scan_iter(match=f"{settings.namespace}:tenantrate:*")]
    await consumer.finish_waiting()
