"""`embedfleet search` and `embedfleet index`: query and index the vector database sink.

The query text is embedded by the fleet itself, through the query stream
(``Producer.embed_query``), so it gets the same model, pooling and precision as the stored
vectors; the nearest-neighbour query then goes straight to the database the workers write.

``--hybrid`` (Qdrant, PostgreSQL): the query's dense vector and sparse weights come from one
forward pass of a model that gives both (BGE-M3), each searches its own index for
``--candidates`` rows, and the two rankings are fused by reciprocal rank
(``embedfleet.sinks.reciprocal_rank_fusion``: ``1 / (k + rank)`` summed, k = ``--rrf-k``). With
``--rerank-lane``, the fused top ``--rerank-top`` are scored by the cross-encoder that lane's
workers serve (``Producer.rerank``, on their stored texts) and printed in its order.

``--image PATH`` (issue 56): a local image file is the query, embedded by the image tower of a
model that embeds images (a CLIP or SigLIP lane) through the interactive stream
(``Producer.embed_texts`` with the file's bytes: the query stream takes texts only), so an image
finds the image rows and, on a shared-space model, the text rows too. A text-only model refuses
it before anything is sent (its card's ``modalities``: ``ModalityError``). An image row keeps
its ``image_ref`` (where the image came from) in the ``text`` column, and is shown by it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import click
import numpy as np

from embedfleet.ops.migration import lane_of
from embedfleet.ops.waiting import (
    client_for,
    count_option,
    json_report_option,
    redis_url_option,
    run_client,
)
from embedfleet.producer.client import EmbeddingOptions, Producer
from embedfleet.producer.images import ImageFileError, read_image
from embedfleet.shared.options import ModalityError, OptionError
from embedfleet.shared.protocol import ProtocolError, QueryFailedError
from embedfleet.shared.retry import RedisUnavailableError
from embedfleet.shared.settings import Settings, SettingsError, load_settings
from embedfleet.sinks import (
    RRF_K,
    Hit,
    MissingExtraError,
    SinkTarget,
    SinkURLError,
    VectorDBError,
    open_backend,
    parse_sink_url,
    reciprocal_rank_fusion,
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
    settings: Settings, target: SinkTarget, text: str | bytes, k: int, timeout: float
) -> list[Hit]:
    """Embed ``text`` through the fleet's query stream, then ask the database for ``k``.
    ``text`` of bytes is an encoded image (``--image``), embedded by the model's image tower
    on the interactive stream (``embed_one``).

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
            # prompt role "query"), the table's dimension (Matryoshka), float32 for the
            # database's own search or the rescoring of quantized rows
            _, dim = await asyncio.to_thread(backend.vector_format)
            options = EmbeddingOptions(dimensions=dim, dtype="float32")
            vector = await embed_one(producer, text, timeout, options)
            return await asyncio.to_thread(backend.nearest, np.asarray(vector), k)
    finally:
        await producer.close()


async def embed_one(
    producer: Producer, query: str | bytes, timeout: float, options: EmbeddingOptions
) -> np.ndarray:
    """A text query's vector (the query stream, the model's query prompt), or an image's (the
    interactive stream, which takes images: the query stream refuses them)."""
    if isinstance(query, str):
        return await producer.embed_query(query, timeout=timeout, options=options)
    (vector,) = await producer.embed_texts([query], timeout=timeout, options=options)
    return vector


async def hybrid_search(
    settings: Settings,
    target: SinkTarget,
    text: str,
    k: int,
    timeout: float,
    *,
    candidates: int = 50,
    rrf_k: int = RRF_K,
    rerank_lane: str | None = None,
    rerank_top: int | None = None,
) -> list[Hit]:
    """Dense + sparse, fused by reciprocal rank, optionally reranked (the module docstring).
    The hits' ``score``: the fused score, or the cross-encoder's where reranked."""
    with open_backend(target) as backend:
        _, dim = await asyncio.to_thread(backend.vector_format)
        options = EmbeddingOptions(dimensions=dim, dtype="float32")
        producer = client_for(settings)  # not `async with`: the query's timeout bounds its set-up
        try:
            (query,) = await producer.embed_representations(
                [text], ("dense", "sparse"), timeout=timeout, options=options
            )
        finally:
            await producer.close()
        if query.sparse is None or query.vector.size == 0:
            raise VectorDBError(
                "the fleet's model did not give dense and sparse: --hybrid needs both"
            )
        width = max(k, candidates)
        dense = await asyncio.to_thread(backend.nearest, np.asarray(query.vector), width)
        sparse = await asyncio.to_thread(backend.nearest_sparse, query.sparse, width)
    fused = reciprocal_rank_fusion([dense, sparse], rrf_k)
    if rerank_lane is None:
        return fused[:k]
    return (await rerank(settings, rerank_lane, text, fused[: rerank_top or k], timeout))[:k]


async def rerank(
    settings: Settings, lane: str, text: str, hits: list[Hit], timeout: float
) -> list[Hit]:
    """``hits`` in the order the cross-encoder of model lane ``lane`` scores (``text``, stored
    text), best first (ties keep the fused order); each hit's score is its score."""
    if not hits:
        return []
    missing = [hit.id for hit in hits if hit.text is None]
    if missing:
        raise VectorDBError(
            f"--rerank-lane scores stored texts, and {missing[0]!r} has none "
            "(EMBEDFLEET_STORE_TEXT was off when it was written)"
        )
    producer = client_for(settings.model_copy(update={"model_lane": lane}))
    try:
        scores = await producer.rerank(text, [hit.text or "" for hit in hits], timeout=timeout)
    finally:
        await producer.close()
    order = np.argsort(-scores, kind="stable")
    return [dataclasses.replace(hits[i], score=float(scores[i])) for i in order.tolist()]


def snippet(text: str | None, width: int = SNIPPET_CHARS) -> str:
    """The text on one line (whitespace folded), cut at a word boundary to at most ``width``
    characters with an ellipsis. One word longer than that (a path, a URI: an image row's
    ``image_ref``) keeps its end, where a file's name is."""
    if text is None:
        return "(no text or image ref stored)"
    flat = " ".join(text.split())
    if len(flat) <= width:
        return flat
    if " " not in flat:
        return "…" + flat[len(flat) - width + 1 :]
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
@click.argument("text", required=False)
@click.option(
    "--image",
    "image",
    default=None,
    metavar="PATH",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Search by this image file instead of TEXT (JPEG, PNG, WebP or GIF, at most "
    "EMBEDFLEET_MAX_IMAGE_BYTES): the image tower of a model that embeds images (a CLIP or "
    "SigLIP lane) embeds it, and on such a shared space it finds text rows too.",
)
@click.option("--k", default=10, type=click.IntRange(1, 1000), help="Chunks to print (default 10).")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per line.")
@click.option(
    "--timeout",
    type=float,
    default=30.0,
    show_default=True,
    help="Seconds to wait for a worker to embed the query.",
)
@click.option(
    "--hybrid",
    is_flag=True,
    help="Dense and sparse search fused by reciprocal rank (Qdrant, PostgreSQL; a model that "
    "gives both, such as BGE-M3, with its rows stored with sparse weights).",
)
@count_option(
    "--candidates",
    default=50,
    maximum=1000,
    help="--hybrid: rows each of the dense and the sparse search brings to the fusion.",
)
@count_option(
    "--rrf-k",
    default=RRF_K,
    minimum=0,
    maximum=10_000,
    help="--hybrid: the reciprocal rank fusion constant (score = sum of 1 / (k + rank)).",
)
@click.option(
    "--rerank-lane",
    default=None,
    metavar="LANE",
    help="--hybrid: rerank the fused top rows with the cross-encoder the workers of model lane "
    "LANE serve (EMBEDFLEET_MODEL_LANE), on their stored texts; scores are then its scores.",
)
@count_option(
    "--rerank-top",
    maximum=1000,
    help="--rerank-lane: how many fused rows to rerank (default: K).",
)
@redis_url_option
def search_command(
    text: str | None,
    image: Path | None,
    k: int,
    as_json: bool,
    timeout: float,
    hybrid: bool,
    candidates: int,
    rrf_k: int,
    rerank_lane: str | None,
    rerank_top: int | None,
    redis_url: str | None,
) -> None:
    """Print the K stored chunks nearest to TEXT (or an image): score, id, text snippet, meta.

    With --json, one object per line with the full stored text (EMBEDFLEET_STORE_TEXT).

    TEXT is embedded by a running worker (it jumps the bulk queue), then the vector database
    named by EMBEDFLEET_SINK (lancedb://, postgresql://, qdrant://) is searched. Needs a worker
    running on the same Redis (EMBEDFLEET_REDIS_URL).

    --image PATH searches by an image instead of TEXT, on a model that embeds images (a CLIP
    or SigLIP lane). An image row shows its image ref (where the image came from: a path, an
    s3:// URI), kept in its text column, where a text row shows its text.

    With --hybrid, one forward pass gives TEXT's dense vector and sparse weights; each
    searches its index, and the two rankings are fused by reciprocal rank (the score printed
    is the fused score); --rerank-lane then reorders the top by a cross-encoder.
    """
    _check_query(text, image, hybrid, rerank_lane or rerank_top)
    settings, target = _target("search", redis_url)
    query = _query(text, image, settings.max_image_bytes)
    work = (
        hybrid_search(
            settings,
            target,
            text or "",  # TEXT, never an image (_check_query)
            k,
            timeout,
            candidates=candidates,
            rrf_k=rrf_k,
            rerank_lane=rerank_lane,
            rerank_top=rerank_top,
        )
        if hybrid
        else search(settings, target, query, k, timeout)
    )
    hits = _hits_or_exit(work, timeout, settings, image)
    for line in format_hits(hits, as_json=as_json):
        click.echo(line)


def _check_query(text: str | None, image: Path | None, hybrid: bool, reranked: object) -> None:
    """The usage errors: TEXT or --image (one of them), --hybrid and its rerank options."""
    if reranked and not hybrid:
        raise click.UsageError("--rerank-lane and --rerank-top go with --hybrid")
    if text is not None and image is not None:
        raise click.UsageError("give TEXT or --image PATH, not both: one query at a time")
    if text is None and image is None:
        raise click.UsageError("give TEXT to search for, or --image PATH to search by an image")
    if image is not None and hybrid:
        raise click.UsageError("--hybrid takes TEXT: sparse weights are a text's, not an image's")


def _query(text: str | None, image: Path | None, max_bytes: int) -> str | bytes:
    """TEXT, or the bytes of the --image file: at most ``max_bytes`` of them
    (EMBEDFLEET_MAX_IMAGE_BYTES), else a bad parameter naming the file and why."""
    if image is None:
        return text or ""  # TEXT is there without --image (_check_query)
    try:
        return read_image(image, max_bytes)
    except ImageFileError as error:
        raise click.BadParameter(str(error), param_hint="'--image'") from None


def _hits_or_exit(
    work: Coroutine[Any, Any, list[Hit]],
    timeout: float,
    settings: Settings,
    image: Path | None = None,
) -> list[Hit]:
    """The search's hits, or the CLI's one-line error for each way it fails (``image``: the
    --image file, which a refusal of the query is about)."""
    try:
        return run_client(work)
    except TimeoutError as error:
        if isinstance(error.__cause__, RedisUnavailableError):
            raise click.ClickException(str(error)) from None  # it names the server
        raise click.ClickException(
            f"no worker embedded the query within {timeout:g} s: is `embedfleet worker` running "
            f"against {settings.effective_redis_url}?"
        ) from None
    except OptionError as error:
        # the served model's refusal (shared/options.py, a ProtocolError too, so before it):
        # --hybrid on a dense-only model, --image on a text-only one (its card's modalities).
        # Not the query's fault: a plain error, exit 1
        if image is not None and isinstance(error, ModalityError):
            raise click.ClickException(
                f"cannot search by --image {image}: {error}; a model lane that embeds images "
                "(CLIP, SigLIP) can"
            ) from None
        raise click.ClickException(str(error)) from None
    except ProtocolError as error:  # the protocol's refusal of TEXT: empty, not valid Unicode
        raise click.BadParameter(str(error), param_hint="'--image'" if image else "TEXT") from None
    except QueryFailedError as error:
        if image is not None:  # the worker's reason for the file: it does not decode, a bomb
            raise click.BadParameter(
                f"{image}: the worker could not embed it: {error.reason}", param_hint="'--image'"
            ) from None
        raise click.ClickException(str(error)) from None
    except (VectorDBError, MissingExtraError, ValueError) as error:
        # ValueError: the served model's refusal (its card)
        raise click.ClickException(str(error)) from None


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
