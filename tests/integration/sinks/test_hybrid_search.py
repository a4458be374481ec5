"""Sparse and per-token vectors in the database sinks, and `embedfleet search --hybrid`.

A BGE-M3-shaped model (tests/model_zoo.py) embeds a corpus into Qdrant (local mode) and
PostgreSQL + pgvector with dense, sparse and multivector asked for in one pass; the rows are
read back with each database's own client and checked against FlagEmbedding's reference
(tests/integration/workers/test_multi_representations.py ``FlagReference``). Then `embedfleet
search --hybrid`, as a
user runs it, must print the reciprocal-rank fusion of the dense and the sparse rankings that
the test computes from the reference model alone (numpy over the corpus); on Qdrant also with
`--rerank-lane`, a cross-encoder on its own model lane, whose order must be
``CrossEncoder.predict``'s.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis.asyncio as aioredis

from embedfleet.producer import Producer
from embedfleet.shared.protocol import Chunk
from embedfleet.shared.settings import Settings
from embedfleet.sinks import build_sink, local_sink_url, parse_sink_url
from embedfleet.workers.model.encoder import Encoder
from tests.conftest import WorkerLauncher, cli_env, running_pg, start_cli
from tests.integration.workers.test_multi_representations import FlagReference
from tests.model_zoo import bge_m3_dir, corpus_lines, cross_encoder_dir

# the slow tier (make test-full, CI): starts processes or servers, or compiles a model
pytestmark = pytest.mark.slow

ALL = ("dense", "sparse", "multivector")
CANDIDATES = 12
K = 8
RRF = 60
QUERY = "How do I raise an exception when a value is wrong?"


def corpus() -> list[str]:
    lines = corpus_lines()
    return [" ".join(lines[i : i + 2]) for i in range(40, 40 + 30 * 37, 37)]


@pytest.fixture(scope="module")
def zoo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("zoo-hybrid")


def expected_fusion(model_dir: Path, max_length: int, texts: list[str]) -> list[str]:
    """The fused order from the reference model: dense by cosine (stored as float32, so the
    databases' scores are the reference's to float precision),
    sparse by dot product (rows sharing no token left out), each cut to CANDIDATES, then
    sum of 1 / (RRF + rank), ties by id."""
    reference = FlagReference(model_dir, max_length)
    dense, lexical, _ = reference.encode(texts)
    query_dense, query_lexical, _ = reference.encode([QUERY])
    cosine = dense @ query_dense[0] / np.linalg.norm(dense, axis=1)
    dot = np.array(
        [sum(w * query_lexical[0].get(t, 0.0) for t, w in row.items()) for row in lexical]
    )
    dense_order = list(np.argsort(-cosine, kind="stable")[:CANDIDATES])
    sparse_order = [i for i in np.argsort(-dot, kind="stable") if dot[i] > 0][:CANDIDATES]
    # the rankings are well posed: no two neighbours the databases' precision could swap
    for scores, order in ((cosine, dense_order), (dot, sparse_order)):
        gaps = -np.diff(scores[order])
        assert gaps.min() > 2e-5 * max(1.0, float(np.abs(scores).max())), "near tie: change QUERY"
    fused: dict[str, float] = {}
    for order in (dense_order, sparse_order):
        for rank, row in enumerate(order, start=1):
            fused[f"doc{row:02d}"] = fused.get(f"doc{row:02d}", 0.0) + 1.0 / (RRF + rank)
    assert len(sparse_order) >= K  # the sparse side takes part
    return sorted(fused, key=lambda chunk_id: (-fused[chunk_id], chunk_id))


def stored_extras(target: Any, chunk_id: str) -> tuple[dict[int, float], np.ndarray]:
    """One row's sparse weights and per-token vectors, read with the database's own client."""
    if target.kind == "pgvector":
        import psycopg

        with psycopg.connect(target.location) as conn:
            row = conn.execute(
                f"SELECT sparse::text, multivector::text FROM {target.table} WHERE id = %s",
                (chunk_id,),
            ).fetchone()
        assert row is not None
        pairs, _, _ = row[0].strip("{").partition("}/")
        sparse = {int(i) - 1: float(v) for i, v in (p.split(":") for p in pairs.split(","))}
        vectors = [json.loads(v.strip('"')) for v in row[1].strip("{}").split('","')]
        return sparse, np.array(vectors, dtype=np.float32)
    from qdrant_client import QdrantClient

    from embedfleet.sinks.qdrant import point_id

    qdrant = QdrantClient(path=target.location)
    try:
        (point,) = qdrant.retrieve(target.table, [point_id(chunk_id)], with_vectors=True)
    finally:
        qdrant.close()
    named: Any = point.vector
    sparse = dict(zip(named["sparse"].indices, named["sparse"].values, strict=True))
    return sparse, np.array(named["multivector"], dtype=np.float32)


async def run_search(env: dict[str, str], *args: str) -> list[dict[str, Any]]:
    process = await start_cli(env, "search", QUERY, "--json", *args)
    out, err = await process.communicate()
    assert process.returncode == 0, err.decode()[-3000:]
    return [json.loads(line) for line in out.decode().splitlines()]


@pytest.mark.parametrize("backend", ["qdrant-local", "pgvector"])
async def test_hybrid_search_returns_the_fused_order(
    backend: str,
    workers: WorkerLauncher,
    settings: Settings,
    client: aioredis.Redis,
    zoo: Path,
    tmp_path: Path,
    request: pytest.FixtureRequest,
) -> None:
    from sentence_transformers import CrossEncoder

    pg = None
    if backend == "pgvector":
        pg = running_pg(request.getfixturevalue("pg_session_server")).get_uri()
    sink = {
        "sink": local_sink_url(backend, tmp_path, pg),
        "sink_table": f"h{uuid.uuid4().hex[:8]}",
        "output_dtype": "float32",  # exact scores: the ranking test needs no fp16 margin
    }
    stored = settings.model_copy(update=sink)
    model_dir = bge_m3_dir(zoo)
    encoder = Encoder(str(model_dir), device="cpu")
    texts = corpus()
    chunks = [Chunk(id=f"doc{i:02d}", text=t, representations=ALL) for i, t in enumerate(texts)]
    async with (
        Producer(settings, client) as producer,
        workers.run(stored, sink=build_sink(stored, client), encoder=encoder),
    ):
        await producer.enqueue(chunks, job="corpus")
        progress = await producer.wait_for_job("corpus", timeout=120)
    assert progress.done == len(chunks)
    target = parse_sink_url(stored.sink, stored.sink_table)
    _, lexical, colbert = FlagReference(model_dir, encoder.max_length).encode(texts[:1])
    sparse, vectors = stored_extras(target, "doc00")
    assert sorted(sparse) == sorted(lexical[0])
    np.testing.assert_allclose(
        [sparse[i] for i in sorted(sparse)], [lexical[0][i] for i in sorted(sparse)], rtol=1e-4
    )
    cosines = np.sum(vectors * colbert[0], axis=1) / np.linalg.norm(vectors, axis=1)
    assert vectors.shape == colbert[0].shape and cosines.min() >= 0.999

    expected = expected_fusion(model_dir, encoder.max_length, texts)
    env = cli_env(settings, EMBEDFLEET_SINK=stored.sink, EMBEDFLEET_SINK_TABLE=stored.sink_table)
    reranker_dir = cross_encoder_dir(zoo)
    rerank_settings = settings.model_copy(update={"model_lane": "rerank"})
    async with workers.run(settings, encoder=encoder):  # the query stage: dense + sparse, one pass
        hits = await run_search(env, "--hybrid", "--k", str(K), "--candidates", str(CANDIDATES))
        reranked = None
        if backend == "qdrant-local":
            async with workers.run(
                rerank_settings, encoder=Encoder(str(reranker_dir), device="cpu")
            ):
                reranked = await run_search(
                    env,
                    "--hybrid",
                    "--k",
                    "5",
                    "--candidates",
                    str(CANDIDATES),
                    "--rerank-lane",
                    "rerank",
                    "--rerank-top",
                    "6",
                )
    assert [hit["id"] for hit in hits] == expected[:K]
    assert hits[0]["text"] in texts and hits[0]["score"] > hits[-1]["score"]
    if reranked is not None:
        top = expected[:6]
        scores = CrossEncoder(str(reranker_dir), device="cpu").predict(
            [(QUERY, texts[int(chunk_id[3:])]) for chunk_id in top]
        )
        order = [top[i] for i in np.argsort(-scores, kind="stable")][:5]
        assert [hit["id"] for hit in reranked] == order
        np.testing.assert_allclose(
            [hit["score"] for hit in reranked], np.sort(scores)[::-1][:5], atol=1e-4
        )


@pytest.mark.parametrize("backend", ["lancedb", "parquet"])
def test_lancedb_and_parquet_keep_sparse_and_per_token_columns(
    backend: str, tmp_path: Path
) -> None:
    """Rows upserted with sparse weights and per-token vectors (and one without either) read
    back with LanceDB's and pyarrow's own readers: sparse_indices / sparse_values lists and a
    list of fixed-size float16 lists; a table made without those columns is refused."""
    import pyarrow.dataset as ds

    from embedfleet.shared.protocol import MultiVector, Result, SparseVector
    from embedfleet.sinks import Extras, SinkSetupError, open_backend

    rng = np.random.default_rng(5)
    tokens = rng.normal(size=(3, 4)).astype(np.float32)
    sparse = SparseVector(
        indices=np.array([2, 7, 9], np.uint32),
        values=np.array([0.5, 1.25, 2.0], np.float32),
        dim=10,
    )
    rows = [
        Result(
            id="a",
            model="m",
            vector=np.ones(8, np.float16),
            sparse=sparse,
            multivector=MultiVector.of(tokens),
        ),
        Result(id="b", model="m", vector=np.ones(8, np.float16)),
    ]
    target = parse_sink_url(local_sink_url(backend, tmp_path), "extras")
    extras = Extras(sparse_dim=10, multivector_dim=4)
    with open_backend(target) as writer:
        writer.setup("m", 8, None, extras)
        writer.upsert(rows)
    if backend == "lancedb":
        import lancedb

        table = lancedb.connect(target.location).open_table("extras").to_arrow()
    else:
        table = ds.dataset(target.location, format="parquet").to_table()
    read = {row["id"]: row for row in table.to_pylist()}
    assert read["a"]["sparse_indices"] == [2, 7, 9]
    assert read["a"]["sparse_values"] == [0.5, 1.25, 2.0]
    np.testing.assert_allclose(np.array(read["a"]["multivector"]), tokens, atol=2e-3)
    assert read["b"]["sparse_indices"] is None and read["b"]["multivector"] is None
    with open_backend(target) as writer, pytest.raises(ValueError, match="no dense vector"):
        writer.setup("m", 8, None, extras)
        writer.upsert([Result(id="c", model="m", vector=np.zeros(0), dimension=0, sparse=sparse)])
    kind = table.schema.field("multivector").type.value_type  # a list of these
    assert (kind.list_size, str(kind.value_type)) == (4, "halffloat")
    if backend == "lancedb":
        with open_backend(parse_sink_url(local_sink_url(backend, tmp_path), "plain")) as plain:
            plain.setup("m", 8)
        with (
            open_backend(parse_sink_url(local_sink_url(backend, tmp_path), "plain")) as again,
            pytest.raises(SinkSetupError, match="sparse_indices"),
        ):
            again.setup("m", 8, None, extras)
