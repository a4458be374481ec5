"""`embedfleet search` and `embedfleet index`: query and index the vector database sink.

The query text is embedded by the fleet itself, through the priority lane
(``Producer.embed_query``), so it gets the same model, pooling and precision as the stored
vectors; the nearest-neighbour query then goes straight to the database the workers write.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time

import click
import numpy as np

from embedfleet.producer.client import EmbeddingOptions
from embedfleet.producer.migration import lane_of
from embedfleet.producer.waiting import (
    client_for,
    json_report_option,
    redis_url_option,
    run_client,
)
from embedfleet.shared.protocol import QueryFailedError
from embedfleet.shared.retry import RedisUnavailableError
from embedfleet.shared.settings import Settings, SettingsError, load_settings
from embedfleet.shared.vectordb import (
    Hit,
    MissingExtraError,
    SinkTarget,
    SinkURLError,
    VectorDBError,
    open_backend,
    parse_sink_url,
)

SNIPPET_CHARS = 72  # one line of a 120-column terminal, with the score, id and meta beside it


def _target(verb: str, redis_url: str | None = None) -> tuple[Settings, SinkTarget]:
    try:
        settings = load_settings(**({"redis_url": redis_url} if redis_url else {}))
        target = parse_sink_url(settings.sink, settings.sink_table, settings.s3_endpoint_url)
    except (SettingsError, SinkURLError) as error:
        raise click.ClickException(str(error)) from None
    if target.kind == "redis":
        raise click.ClickException(
            f"`embedfleet {verb}` needs a vector database sink, and EMBEDFLEET_SINK is `redis` "
            "(the results stream has no search): set EMBEDFLEET_SINK to the lancedb://, "
            "postgresql:// or qdrant:// URL your workers write to"
        )
    return settings, target


async def search(
    settings: Settings, target: SinkTarget, text: str, k: int, timeout: float
) -> list[Hit]:
    """Embed ``text`` through the fleet's priority lane, then ask the database for ``k``.

    ``target.table`` may be a reader name (``embedfleet migrate``'s alias): it is resolved to
    its table once, the query is embedded by the model lane that writes that table
    (``Keys.table_lanes``) and that table is searched, so a switch between two models' tables
    gives each query one model's answers, never a mix."""
    with open_backend(target) as reader:
        table = await asyncio.to_thread(reader.resolve)
    producer = client_for(settings)  # not `async with`: the query's timeout bounds its set-up
    try:
        lane = await producer.retry.call(
            "read which model writes the table",
            lambda: lane_of(producer.client, settings.keys, table, settings.model_lane),
            deadline=time.monotonic() + timeout,
        )
        if lane != settings.model_lane:
            await producer.close()
            producer = client_for(settings.model_copy(update={"model_lane": lane}))
        with open_backend(dataclasses.replace(target, table=table)) as backend:
            # the query as the stored vectors were made: the model's query prompt (the
            # worker's query lane), the table's dimension (Matryoshka), float32 for the
            # database's own search or the rescoring of quantized rows
            _, dim = await asyncio.to_thread(backend.vector_format)
            options = EmbeddingOptions(dimensions=dim, dtype="float32")
            vector = await producer.embed_query(text, timeout=timeout, options=options)
            return await asyncio.to_thread(backend.nearest, np.asarray(vector), k)
    finally:
        await producer.close()


def snippet(text: str | None, width: int = SNIPPET_CHARS) -> str:
    """The text on one line (whitespace folded), cut at a word boundary to at most ``width``
    characters with an ellipsis."""
    if text is None:
        return "(text not stored)"
    flat = " ".join(text.split())
    if len(flat) <= width:
        return flat
    cut = flat.rfind(" ", 0, width - 1)
    return flat[: cut if cut > width // 2 else width - 1] + "…"


def format_hits(hits: list[Hit], *, as_json: bool = False) -> list[str]:
    """Lines to print: one JSON object per hit (the full text), or for people
    ``score  id  snippet  meta``, one line each."""
    if as_json:
        return [json.dumps(hit.as_dict(), ensure_ascii=False) for hit in hits]
    if not hits:
        return ["no results: the table is empty"]
    id_width = max(len(hit.id) for hit in hits)
    snippets = [snippet(hit.text) for hit in hits]
    text_width = max(len(line) for line in snippets)
    return [
        f"{hit.score:6.3f}  {hit.id:<{id_width}}  {line:<{text_width}}  "
        f"{json.dumps(hit.meta, ensure_ascii=False)}"
        for hit, line in zip(hits, snippets, strict=True)
    ]


@click.command("search")
@click.argument("text")
@click.option("--k", default=10, type=click.IntRange(1, 1000), help="Chunks to print (default 10).")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
@click.option(
    "--timeout",
    type=float,
    default=30.0,
    show_default=True,
    help="Seconds to wait for a worker to embed the query.",
)
@redis_url_option
def search_command(text: str, k: int, as_json: bool, timeout: float, redis_url: str | None) -> None:
    """Print the K stored chunks nearest to TEXT: similarity, id, a snippet of the text, meta.

    With --json, one object per line with the full stored text (EMBEDFLEET_STORE_TEXT).

    TEXT is embedded by a running worker (it jumps the bulk queue), then the vector database
    named by EMBEDFLEET_SINK (lancedb://, postgresql://, qdrant://) is searched. Needs a worker
    running on the same Redis (EMBEDFLEET_REDIS_URL).
    """
    settings, target = _target("search", redis_url)
    try:
        hits = run_client(search(settings, target, text, k, timeout))
    except TimeoutError as error:
        if isinstance(error.__cause__, RedisUnavailableError):
            raise click.ClickException(str(error)) from None  # it names the server
        raise click.ClickException(
            f"no worker embedded the query within {timeout:g} s: is `embedfleet worker` running "
            f"against {settings.effective_redis_url}?"
        ) from None
    except (VectorDBError, QueryFailedError, MissingExtraError) as error:
        raise click.ClickException(str(error)) from None
    for line in format_hits(hits, as_json=as_json):
        click.echo(line)


@click.command("index")
@click.option(
    "--force", is_flag=True, help="LanceDB: build the vector index even on a small table."
)
@json_report_option("the steps done")
def index_command(force: bool, as_json: bool) -> None:
    """Build the vector index of EMBEDFLEET_SINK's table once a bulk load has finished.

    Workers only upsert; indexing every micro-batch would slow a bulk load many times over.
    LanceDB: compacts, indexes ids, and builds IVF_HNSW_SQ once the table is big enough.
    PostgreSQL: CREATE INDEX … USING hnsw (cosine). Qdrant: turns HNSW indexing on.
    """
    _, target = _target("index")
    try:
        with open_backend(target) as backend:
            done = backend.build_index(force=force)
    except (VectorDBError, MissingExtraError) as error:
        raise click.ClickException(str(error)) from None
    if as_json:
        click.echo(json.dumps({"table": target.describe(), "done": list(done)}))
        return
    for line in done:
        click.echo(line)
