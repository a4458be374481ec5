"""Moving a live index to a new model (issue 31), on each database sink, against the real thing.

Model A is the packaged model (384 dimensions) in the namespace's default lane; model B a tiny
random-weight BERT (32 dimensions, tests/model_zoo.py) in lane ``tiny``: a query embedded by one
and searched in the other's table cannot even run, so a mix would fail the query loop.

The scenario, per database: A's table holds a corpus; ``migrate start`` turns the dual write on
and points the alias at A's table; a query loop searches the alias throughout. The copy runs
while B's workers are not up yet, so it stops at the backlog mark, and is killed there
(SIGKILL of an ``embedfleet migrate start`` process; Qdrant's local mode allows one process, so
there the copy is a task of this process, abandoned by cancellation). New chunks are enqueued
for the index meanwhile. B's workers start, the same command runs again and finishes; canary,
switch, rollback, switch, more new chunks, finish --drop-old. Every query got one model's
answers, A's before the switch and B's after; both tables hold every id exactly once with its
text; the new chunks are in both.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import os
import signal
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from click.testing import CliRunner

from embedfleet.cli import main
from embedfleet.ops import migration as mig
from embedfleet.ops.search import search
from embedfleet.producer import Producer
from embedfleet.producer.chunker import builtin_corpus
from embedfleet.server import isolated_settings
from embedfleet.shared import migrations as records
from embedfleet.shared.protocol import Chunk, Result
from embedfleet.shared.redis_conn import connect
from embedfleet.shared.settings import Settings
from embedfleet.sinks import SinkTarget, VectorDBError, build_sink, open_backend, parse_sink_url
from tests import forks
from tests.conftest import WorkerLauncher, cli_env, running_pg, shared_encoder, until
from tests.model_zoo import sentence_transformers_dir

# the slow tier (make test-full, CI): starts processes or servers, or compiles a model
pytestmark = pytest.mark.slow

DATABASES = ["lancedb", "pgvector", "qdrant-local"]
LANE = "tiny"
PAGE = 10
HIGH_WATER = 30  # the copy stops here while B's workers are not up: killed midway, for sure


@functools.cache
def tiny_model_dir() -> Path:
    import tempfile

    return sentence_transformers_dir("bert", Path(tempfile.mkdtemp(prefix="embedfleet-zoo-")))


@functools.cache
def tiny_encoder() -> Any:
    from embedfleet.workers.model.encoder import Encoder

    return Encoder(str(tiny_model_dir()), device="cpu")


def sink_url(kind: str, request: pytest.FixtureRequest, folder: Path) -> str:
    if kind == "pgvector":
        server = running_pg(request.getfixturevalue("pg_session_server"))
        return server.get_uri()
    if kind == "lancedb":
        return f"lancedb://{folder / 'lancedb'}"
    return f"qdrant+local://{folder / 'qdrant'}"


def chunks(prefix: str, texts: Sequence[str]) -> list[Chunk]:
    return [Chunk(id=f"{prefix}-{n:03d}", text=text, meta={"n": n}) for n, text in enumerate(texts)]


def corpus_texts(count: int) -> list[str]:
    texts = list(dict.fromkeys(chunk.text for chunk in builtin_corpus(count * 2)))
    assert len(texts) >= count
    return texts[:count]


def rows_of(target: SinkTarget, table: str) -> list[tuple[str, str | None, str | None]]:
    """(id, text, model) of every row, one entry per stored row."""
    with open_backend(dataclasses.replace(target, table=table)) as backend:
        found, cursor = [], None
        while True:
            rows, cursor = backend.scan_rows(cursor, 50)
            found += [(row.id, row.text, row.model) for row in rows]
            if cursor is None:
                return found


@dataclasses.dataclass
class Answer:
    started: float
    ended: float
    asked: str
    models: set[str]
    top: str


class QueryLoop:
    """Searches the alias over and over, as a reader would, and keeps every answer."""

    def __init__(self, settings: Settings, target: SinkTarget, texts: dict[str, str]) -> None:
        self.settings, self.target, self.texts = settings, target, texts
        self.answers: list[Answer] = []
        self.failures: list[str] = []
        self.stop = asyncio.Event()

    async def run(self) -> None:
        ids = sorted(self.texts)
        n = 0
        while not self.stop.is_set():
            asked = ids[n % len(ids)]
            n += 1
            started = time.monotonic()
            try:
                hits = await search(self.settings, self.target, self.texts[asked], 3, 30.0)
            except Exception as error:  # the loop must never fail: each failure is kept
                self.failures.append(f"{type(error).__name__}: {error}")
                continue
            self.answers.append(
                Answer(started, time.monotonic(), asked, {h.model or "" for h in hits}, hits[0].id)
            )

    async def until_answers_after(self, moment: float, count: int = 3) -> None:
        async def enough() -> bool:
            assert not self.failures, self.failures
            return sum(a.started > moment for a in self.answers) >= count

        await until(enough, timeout=60)


def invoke(env: dict[str, str], *args: str) -> dict[str, Any]:
    """`embedfleet <args> --json` in this process (Qdrant's local mode allows one process)."""
    result = CliRunner().invoke(main, [*args, "--json"], env=env, catch_exceptions=False)
    assert result.exit_code == 0, (args, result.output)
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    return json.loads(lines[-1])


@pytest.mark.parametrize("kind", DATABASES)
async def test_a_live_index_moves_to_another_model(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path, redis_server: Any
) -> None:
    url = sink_url(kind, request, tmp_path)
    suffix = os.urandom(3).hex()  # PostgreSQL's tables outlive a test: names of its own
    a_table, b_table, alias = f"emb_a_{suffix}", f"emb_b_{suffix}", f"emb_live_{suffix}"
    base = isolated_settings(
        redis_server.url,
        sink=url,
        dtype="float32",  # the tiny model's texts are close: bf16 noise could reorder them
        frozen_queries=False,
        frozen_bulk=False,
        backlog_high_water=HIGH_WATER,
    )
    a = base.model_copy(update={"sink_table": a_table})
    b = base.model_copy(
        update={"sink_table": b_table, "model_lane": LANE, "model": str(tiny_model_dir())}
    )
    reader = base.model_copy(update={"sink_table": alias})
    target = parse_sink_url(url, a_table)
    env = cli_env(
        a,
        EMBEDFLEET_SINK=url,
        EMBEDFLEET_SINK_TABLE=a_table,
        EMBEDFLEET_BACKLOG_HIGH_WATER=str(HIGH_WATER),
        EMBEDFLEET_LOG_LEVEL="warning",
    )
    texts = corpus_texts(80)
    corpus, live, later = (
        chunks("doc", texts[:60]),
        chunks("live", texts[60:70]),
        chunks("new", texts[70:]),
    )
    model_a, model_b = shared_encoder().name, tiny_encoder().name
    client = connect(base.effective_redis_url)
    workers = WorkerLauncher(a, shared_encoder, tmp_path)
    try:
        async with (
            workers.run(a, sink=build_sink(a, client), client=client),
            Producer(a, client) as producer,
        ):
            await producer.enqueue(corpus, job="corpus")
            await producer.wait_for_job("corpus", timeout=60)

            migration = await mig.start(
                a,
                client,
                target,
                source=a_table,
                target=b_table,
                target_lane=LANE,
                alias=alias,
            )
            loop = QueryLoop(reader, parse_sink_url(url, alias), {c.id: c.text for c in corpus})
            queries = asyncio.create_task(loop.run())
            await loop.until_answers_after(0.0)

            # the copy, killed midway: it waits at the backlog mark, B's workers not up yet
            key = a.keys.migration(a_table)

            async def at_the_mark() -> bool:
                return int(await client.hget(key, records.SCANNED) or 0) >= HIGH_WATER

            if kind == "qdrant-local":
                copying = asyncio.create_task(mig.copy(migration, client, page=PAGE))
                await until(at_the_mark)
                copying.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await copying
            else:
                process = await forks.start(
                    ["migrate", "start", "--page", str(PAGE)],
                    env=env,
                    stdout=asyncio.subprocess.DEVNULL,
                    stderr=asyncio.subprocess.DEVNULL,
                )
                try:
                    await until(at_the_mark)
                finally:
                    process.send_signal(signal.SIGKILL)
                    assert await process.wait() == -signal.SIGKILL
            record = records.decoded(await client.hgetall(key))
            # killed before the end of the scan, its cursor recorded
            assert record.get(records.SCAN_DONE) != "1" and record[records.CURSOR], record
            assert record[records.STATE] == "copying", record

            # new chunks for the index while it is being migrated
            await producer.enqueue(live, job="live")
            await producer.wait_for_job("live", timeout=60)

            async with workers.run(
                b, sink=build_sink(b, client), client=client, encoder=tiny_encoder()
            ):
                copied = await asyncio.to_thread(
                    invoke, env, "migrate", "start", "--page", str(PAGE), "--idle-timeout", "60"
                )
                assert copied["verified"] and copied["state"] == "copied"
                assert copied["in_target"] == copied["total"] == len(corpus) + len(live)
                assert copied["rows_per_s"] > 0 and copied["tokens"] > 0
                # resumed from the cursor, not from the start (Qdrant scrolls in point-id
                # order: a new chunk before the cursor came by the dual write alone)
                resumed_rows = len(corpus) + len(live) - HIGH_WATER
                assert copied["enqueued"] <= resumed_rows
                assert kind == "qdrant-local" or copied["enqueued"] == resumed_rows

                status = await asyncio.to_thread(invoke, env, "migrate", "status")
                assert status["state"] == "copied" and status["alias_points_at"] == a_table
                assert status["dual_write"] and status["seconds_left"] == 0

                queries_file = tmp_path / "queries.jsonl"
                queries_file.write_text(
                    "\n".join(json.dumps({"query": c.text, "relevant": [c.id]}) for c in corpus[:4])
                )
                canary = await asyncio.to_thread(
                    invoke, env, "migrate", "canary", "--queries", str(queries_file), "--k", "1"
                )
                # a stored text finds itself first with either model: overlap and recall 1
                assert canary["overlap"] == 1.0 and canary["recall_target"] == 1.0

                steps: list[tuple[float, float]] = []  # (began, returned) of each reader step
                for verb, points_at in (
                    ("switch", b_table),
                    ("rollback", a_table),
                    ("switch", b_table),
                ):
                    began = time.monotonic()
                    pointed = await asyncio.to_thread(invoke, env, "migrate", verb)
                    steps.append((began, time.monotonic()))
                    assert pointed["alias_points_at"] == points_at
                    await loop.until_answers_after(steps[-1][1])

                # more new chunks after the switch: the dual write still runs
                await producer.enqueue(later, job="later")
                await producer.wait_for_job("later", timeout=60)
                async with Producer(b, client) as lane_b:
                    await lane_b.wait_for_job("later", timeout=60)
                    await lane_b.wait_for_job("live", timeout=60)
                loop.stop.set()
                await queries

                everything = {c.id: c.text for c in [*corpus, *live, *later]}
                for table, model in ((a_table, model_a), (b_table, model_b)):
                    stored = await asyncio.to_thread(rows_of, target, table)
                    assert len(stored) == len({row[0] for row in stored}), table  # once each
                    assert {row[0]: row[1] for row in stored} == everything, table
                    assert {row[2] for row in stored} == {model}, table

                finished = await asyncio.to_thread(invoke, env, "migrate", "finish", "--drop-old")
                assert finished["dropped"] == a_table and not finished["dual_write"]
                with pytest.raises(VectorDBError):
                    await asyncio.to_thread(rows_of, target, a_table)
                hits = await search(reader, parse_sink_url(url, alias), corpus[0].text, 1, 30)
                assert hits[0].id == corpus[0].id and hits[0].model == model_b
    finally:
        await client.aclose()

    assert not loop.failures, loop.failures
    for answer in loop.answers:
        assert len(answer.models) == 1, answer  # one model's answers, never a mix
        assert answer.top == answer.asked, answer  # and the right ones: the text finds itself
    # A's answers before the switch, B's after, A's after the rollback, B's after the second
    # switch (a query in flight during a step may get either, but one of them: checked above)
    bounds = [0.0, *(moment for step in steps for moment in step), float("inf")]
    phases = list(zip(bounds[0::2], bounds[1::2], strict=True))  # between the steps
    for (begin, end), model in zip(phases, (model_a, model_b, model_a, model_b), strict=True):
        inside = [a for a in loop.answers if a.started > begin and a.ended < end]
        assert inside and all(a.models == {model} for a in inside), (model, inside[:3])


# --- each backend's migration methods, without workers --------------------------------------
def results(prefix: str, count: int, dim: int, model: str) -> list[Result]:
    rng = np.random.default_rng(len(prefix))
    vectors = rng.normal(size=(count, dim)).astype(np.float16)
    return [
        Result(
            id=f"{prefix}{n:02d}",
            model=model,
            vector=vectors[n],
            job="j",
            meta={"n": n},
            text=f"t{n}",
        )
        for n in range(count)
    ]


@pytest.mark.parametrize("kind", DATABASES)
def test_scan_alias_and_drop_on_each_database(
    kind: str, request: pytest.FixtureRequest, tmp_path: Path
) -> None:
    url = sink_url(kind, request, tmp_path)
    suffix = os.urandom(3).hex()
    old, new, alias = f"old_{suffix}", f"new_{suffix}", f"live_{suffix}"
    for table, dim, count in ((old, 8, 23), (new, 4, 5)):
        with open_backend(parse_sink_url(url, table)) as backend:
            backend.setup("m", dim)
            backend.upsert(results("r", count, dim, f"m{dim}"))
    with open_backend(parse_sink_url(url, old)) as backend:
        assert backend.count_rows() == 23
        pages, cursor, seen = 0, None, []
        while True:
            rows, cursor = backend.scan_rows(cursor, 7)
            pages += 1
            seen += [row.id for row in rows]
            if cursor is None:
                break
        # every row once, resumable by the cursor alone; the texts and jobs come along
        assert sorted(seen) == [f"r{n:02d}" for n in range(23)] and len(seen) == 23
        assert pages in (4, 5) and rows[-1].text is not None
        backend.point_alias(alias)
    with open_backend(parse_sink_url(url, alias)) as reader:
        assert reader.resolve() == old and reader.vector_format()[1] == 8
    with open_backend(parse_sink_url(url, new)) as backend:
        backend.point_alias(alias)  # the switch: one step
        with pytest.raises(VectorDBError, match=r"not an alias|not a view"):
            backend.point_alias(old)  # a table is never replaced by an alias
    with open_backend(parse_sink_url(url, alias)) as reader:
        assert reader.resolve() == new
        hits = reader.nearest(np.ones(4, np.float32), 2)  # readers of the alias read the new table
        assert len(hits) == 2 and {h.model for h in hits} == {"m4"}
    with open_backend(parse_sink_url(url, old)) as backend:
        backend.drop_table()
    with open_backend(parse_sink_url(url, old)) as backend, pytest.raises(VectorDBError):
        backend.count_rows()


async def test_a_migration_of_another_target_is_refused_and_a_resume_keeps_it(
    settings: Settings, client: Any, tmp_path: Path
) -> None:
    url = f"lancedb://{tmp_path / 'lancedb'}"
    target = parse_sink_url(url, "emb_a")
    with open_backend(target) as backend:
        backend.setup("m", 4)
        backend.upsert(results("r", 3, 4, "m"))
    a = settings.model_copy(update={"sink": url, "sink_table": "emb_a"})
    started = await mig.start(
        a, client, target, source="emb_a", target="emb_b", target_lane=LANE, alias=None
    )
    assert started.alias == "emb_a_live" and started.record[records.DUAL_WRITE] == "1"
    lanes = await client.hgetall(a.keys.table_lanes)
    assert lanes == {b"emb_a": b"", b"emb_b": LANE.encode()}
    resumed = await mig.start(
        a, client, target, source="emb_a", target=None, target_lane=None, alias=None
    )
    assert resumed.record == {**started.record}
    with pytest.raises(mig.MigrationError, match="already being migrated"):
        await mig.start(
            a, client, target, source="emb_a", target="emb_c", target_lane=LANE, alias=None
        )
    with pytest.raises(mig.MigrationError, match="not verified"):
        await mig.point_readers(resumed, client, "target")
    with pytest.raises(mig.MigrationError, match="another model's lane"):
        await mig.start(
            a, client, parse_sink_url(url, "x"), source="x", target="y", target_lane="", alias=None
        )


def test_estimates_come_from_the_measured_rates() -> None:
    estimate = mig.Estimate(
        done=250, total=1000, rows_per_s=50.0, tokens_per_row=12.0, tokens_measured="tokenizer"
    )
    assert estimate.seconds_left == 15.0 and estimate.tokens_total == 12_000
    assert estimate.as_dict()["tokens_per_s"] == 600.0
    assert "about 15 s left" in estimate.describe()
    assert mig.Estimate(0, 10, 0.0, 0.0, "characters").seconds_left is None
    meter = mig.TokenMeter(tiny_model_dir(), 48)
    meter.count(["hello world", "the def statement"])
    assert meter.measured == "tokenizer" and meter.per_row > 2  # [CLS] ... [SEP] at least


def test_the_query_file_takes_text_and_labelled_lines(tmp_path: Path) -> None:
    path = tmp_path / "q.txt"
    path.write_text('plain question\n\n{"query": "labelled", "relevant": ["a", "b"]}\n')
    assert mig.read_queries(path) == [
        mig.Query("plain question"),
        mig.Query("labelled", frozenset({"a", "b"})),
    ]
    path.write_text('{"relevant": []}\n')
    with pytest.raises(mig.MigrationError, match=":1: not a query line"):
        mig.read_queries(path)


@pytest.mark.parametrize("verb", ["start", "status", "canary", "switch", "rollback", "finish"])
def test_migrate_verbs_explain_themselves(verb: str) -> None:
    result = CliRunner().invoke(main, ["migrate", verb, "--help"])
    assert result.exit_code == 0 and "--json" in result.output and "--table" in result.output
