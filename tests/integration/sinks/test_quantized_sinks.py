"""Quantized vectors stored natively (LanceDB fixed-size int8/uint8 lists and packed bits,
pgvector ``bit``), refused where the database has no such type, and searched the way
sentence-transformers searches them (binary: Hamming, then rescoring with the float query)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest

from embedfleet.shared.postprocess import quantize
from embedfleet.shared.protocol import Result
from embedfleet.sinks import SinkSetupError, open_backend, parse_sink_url
from embedfleet.sinks.backend import rescore_binary, rescore_codes

# the slow tier (make test-full, CI): starts processes or servers, or compiles a model
pytestmark = pytest.mark.slow

DIM = 40
ROWS = 60


def corpus() -> tuple[np.ndarray, np.ndarray]:
    """Unit vectors, and the int8/uint8 calibration ranges of them."""
    vectors = np.random.default_rng(3).standard_normal((ROWS, DIM)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    return vectors, np.vstack((vectors.min(axis=0), vectors.max(axis=0)))


def results(dtype: str) -> list[Result]:
    vectors, ranges = corpus()
    stored = quantize(vectors, dtype, ranges)
    return [
        Result(id=f"r{i:03d}", model="m", vector=stored[i], dtype=dtype, dimension=DIM, text=str(i))
        for i in range(ROWS)
    ]


def store(target, dtype: str) -> None:
    """The corpus, quantized to ``dtype``, written through a backend that is closed again."""
    with open_backend(target) as backend:
        backend.setup("m", DIM, dtype)
        backend.upsert(results(dtype))


def lancedb_target(tmp_path: Path, name: str):
    return parse_sink_url(f"lancedb://{tmp_path / 'lance'}", name)


@pytest.mark.parametrize("dtype", ["int8", "uint8", "binary", "ubinary"])
def test_lancedb_stores_quantized_natively(tmp_path: Path, dtype: str) -> None:
    import lancedb
    import pyarrow as pa

    target = lancedb_target(tmp_path, f"t_{dtype}")
    store(target, dtype)
    table = lancedb.connect(target.location).open_table(target.table)
    field_type = table.schema.field("vector").type
    expected = pa.int8() if dtype == "int8" else pa.uint8()
    assert field_type.value_type == expected
    assert field_type.list_size == (DIM + 7) // 8 if "binary" in dtype else DIM
    with open_backend(target) as backend:
        assert backend.vector_format() == (dtype, DIM)
        exported = {row.id: row.vector for row in backend.export_rows()}
        query, _ = corpus()
        hits = backend.nearest(query[7], k=5)
    written = {r.id: r.vector for r in results(dtype)}
    for row_id, vector in exported.items():
        want = written[row_id]
        if dtype == "binary":  # stored as the same bits, ubinary bytes
            want = (want.astype(np.int16) + 128).astype(np.uint8)
        assert vector.tobytes() == want.tobytes()
    # the same ranking as scoring every row with the float query (exact rescoring)
    stored = np.stack([written[f"r{i:03d}"] for i in range(ROWS)])
    if "binary" in dtype:
        packed = stored if dtype == "ubinary" else (stored.astype(np.int16) + 128).astype(np.uint8)
        scores = rescore_binary(query[7], packed, DIM)
    else:
        scores = rescore_codes(query[7], stored)
    assert hits[0].id == "r007" and hits[0].id == f"r{int(np.argmax(scores)):03d}"
    assert [h.score for h in hits] == sorted((h.score for h in hits), reverse=True)


def refused_at_setup(target, dtype: str) -> str:
    """The message DatabaseSink.setup raises for ``dtype`` (the worker's start)."""
    from embedfleet.sinks.sink import DatabaseSink

    with open_backend(target) as backend:
        sink = DatabaseSink(None, None, backend, dtype=dtype)  # type: ignore[arg-type]
        with pytest.raises(SinkSetupError) as refused:
            asyncio.run(sink.setup("m", DIM))
    return str(refused.value)


def test_pgvector_stores_bits_and_refuses_int8(pg_server) -> None:
    url = pg_server.get_uri()
    target = parse_sink_url(url, "bits_table")
    store(target, "binary")
    query, _ = corpus()
    with open_backend(target) as backend:
        assert backend.vector_format() == ("ubinary", DIM)
        before = [hit.id for hit in backend.nearest(query[11], k=3)]
        assert "bit_hamming_ops" in backend.build_index()[0]
        after = [hit.id for hit in backend.nearest(query[11], k=3)]
        exported = {row.id: row.vector for row in backend.export_rows()}
    assert before[0] == after[0] == "r011"
    assert exported["r005"].tobytes() == quantize(corpus()[0], "ubinary")[5].tobytes()
    message = refused_at_setup(parse_sink_url(url, "int8_table"), "int8")
    assert "EMBEDFLEET_OUTPUT_DTYPE=int8" in message and "binary" in message


def test_qdrant_stores_uint8_and_refuses_what_it_cannot_hold(tmp_path: Path) -> None:
    target = parse_sink_url(f"qdrant+local://{tmp_path / 'q'}", "codes")
    store(target, "uint8")
    query, _ = corpus()
    with open_backend(target) as backend:
        assert backend.vector_format() == ("uint8", DIM)
        hits = backend.nearest(query[9], k=3)
        exported = {row.id: row.vector for row in backend.export_rows()}
    assert hits[0].id == "r009"
    assert exported["r004"].tobytes() == results("uint8")[4].vector.tobytes()
    for dtype in ("int8", "binary", "ubinary"):
        other = parse_sink_url(f"qdrant+local://{tmp_path / dtype}", "c")
        assert f"EMBEDFLEET_OUTPUT_DTYPE={dtype}" in refused_at_setup(other, dtype)
