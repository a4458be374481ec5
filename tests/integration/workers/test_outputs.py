"""Matryoshka dimensions, output precisions and prompts, through the worker (issue 15).

Against sentence-transformers: ``truncate_dim`` (+ normalize) for dimensions,
``quantize_embeddings`` with the same ranges for int8/uint8/binary/ubinary (byte for byte), and
the worker's calibration shared through Redis.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import redis.asyncio as aioredis

from embedfleet.producer.client import EmbeddingOptions, Producer
from embedfleet.shared.postprocess import quantize
from embedfleet.shared.protocol import Chunk
from embedfleet.shared.settings import Settings
from embedfleet.workers.calibration import CalibrationError, CalibrationStore
from embedfleet.workers.model.encoder import Encoder
from embedfleet.workers.model.precision import cosines
from embedfleet.workers.output import OutputOptionError, Outputs
from tests import forks, model_zoo
from tests.conftest import WorkerLauncher, worker_env
from tests.integration.workers.test_model_families import (
    MIN_COSINE,
    assert_parity,
    fleet_vectors,
    texts,
)

# the slow tier (make test-full, CI): starts processes or servers, or compiles a model
pytestmark = pytest.mark.slow

QUANTIZED_DTYPES = ("int8", "uint8", "binary", "ubinary")
PROMPTS = {"query": "query: ", "document": "document: "}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A normalising model with a Dense projection (48 dims) and lane prompts."""
    root = tmp_path_factory.mktemp("outputs")
    return model_zoo.sentence_transformers_dir(
        "bert", root, dense=48, prompts=PROMPTS, name="st-bert-outputs"
    )


@pytest.fixture(scope="module")
def tiny_encoder(model_dir: Path) -> Encoder:
    return Encoder(str(model_dir), device="cpu")


def outputs_for(settings: Settings, encoder: Encoder, client=None) -> Outputs:
    return Outputs(settings, encoder, CalibrationStore(client, settings.keys, encoder.name))


# --- Matryoshka -------------------------------------------------------------------------------
@pytest.mark.parametrize("dim", [8, 24, 48])
@pytest.mark.parametrize("renormalize", [True, False])
def test_dimensions_match_truncate_dim(
    model_dir: Path, tiny_encoder: Encoder, dim: int, renormalize: bool
) -> None:
    """renormalize=false is ST's truncate_dim exactly; true is truncate_dim + normalize."""
    from sentence_transformers import SentenceTransformer

    settings = Settings(renormalize=renormalize)
    outputs = outputs_for(settings, tiny_encoder)
    chunks = [
        Chunk(id=str(i), text=t, dimensions=dim, dtype="float32") for i, t in enumerate(texts())
    ]
    prompt = tiny_encoder.resolve_prompt("document")
    results = outputs.results(chunks, fleet_vectors(tiny_encoder, texts(), prompt), [False] * 13)
    ours = np.stack([r.vector for r in results])
    assert all(r.dim == dim and r.dtype == "float32" for r in results)
    model = SentenceTransformer(str(model_dir), device="cpu", truncate_dim=dim)
    theirs = model.encode_document(texts(), normalize_embeddings=renormalize)
    assert_parity(ours, theirs, f"bert dense48 dimensions={dim} renormalize={renormalize}")
    if renormalize or dim == 48:
        assert np.allclose(np.linalg.norm(ours, axis=1), 1.0, atol=1e-5)


def test_dimensions_out_of_range_are_refused(tiny_encoder: Encoder) -> None:
    outputs = outputs_for(Settings(), tiny_encoder)
    with pytest.raises(OutputOptionError, match=r"dimensions=49 is out of range.*1\.\.48"):
        outputs.prompt_for(Chunk(id="a", text="t", dimensions=49), "document")
    with pytest.raises(OutputOptionError, match="EMBEDFLEET_DIMENSIONS=64"):
        outputs_for(Settings(dimensions=64), tiny_encoder).check_settings()


# --- precisions -------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", QUANTIZED_DTYPES)
def test_quantized_bytes_are_quantize_embeddings_bytes(tiny_encoder: Encoder, dtype: str) -> None:
    """Same float input and ranges: the same bytes as sentence-transformers (and as its own
    encode, end to end, up to a code that sits on a bucket edge)."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.util import quantize_embeddings

    vectors = fleet_vectors(tiny_encoder, texts())
    calibration = fleet_vectors(tiny_encoder, model_zoo.corpus_lines()[:200])
    ranges = np.vstack((calibration.min(axis=0), calibration.max(axis=0)))
    ours = quantize(vectors, dtype, ranges)
    expected = quantize_embeddings(vectors, precision=dtype, ranges=ranges)
    assert ours.dtype == expected.dtype and ours.tobytes() == expected.tobytes()
    model = SentenceTransformer(str(tiny_encoder.model_dir), device="cpu")
    theirs = quantize_embeddings(model.encode(texts()), precision=dtype, ranges=ranges)
    same = float(np.mean(ours == theirs))
    print(f"QUANTIZED {dtype}: identical to ST encode + quantize_embeddings: {same:.4f}")
    assert same >= 0.99


async def test_results_carry_dtype_and_dimension_through_redis(
    workers: WorkerLauncher, settings: Settings, client: aioredis.Redis, tiny_encoder: Encoder
) -> None:
    """Every precision and a Matryoshka dimension, per chunk, through a worker; int8 uses the
    calibration the worker stored in Redis, the same bytes a second reader computes from it."""
    chunks = [
        {"id": f"{dtype}-{dim}", "text": "the garbage collector", "dtype": dtype, "dimensions": dim}
        for dtype in ("float16", "float32", *QUANTIZED_DTYPES)
        for dim in (13, 48)
    ]
    async with Producer(settings, client) as producer:
        async with workers.run(settings, encoder=tiny_encoder):
            await producer.enqueue(chunks, job="dtypes")
            progress = await producer.wait_for_job("dtypes", timeout=120)
            assert progress.done == len(chunks)
        results = {r.id: r async for r in producer.results()}
    reference = fleet_vectors(tiny_encoder, ["the garbage collector"], "document: ")[0]
    store = CalibrationStore(client, settings.keys, tiny_encoder.name)
    for chunk in chunks:
        result = results[chunk["id"]]
        dim, dtype = chunk["dimensions"], chunk["dtype"]
        assert (result.dtype, result.dim) == (dtype, dim)
        floats = reference[:dim] / np.linalg.norm(reference[:dim])
        ranges = None
        if dtype in ("int8", "uint8"):
            stored = await store.stored(str(dim) if dim < 48 else "48")
            assert stored is not None and stored.ranges.shape == (2, dim)
            ranges = stored.ranges
        if dtype.startswith("float"):
            expected = quantize(floats[None, :].astype(np.float32), dtype, ranges)[0]
            assert cosines(result.vector[None].astype(np.float32), expected[None]).min() > 0.9999
        else:
            assert_codes_of(result.vector, floats, dtype, ranges, chunk["id"])


# The worker computes the vector in a batch of 12 (another GEMM shape than the reference's batch
# of one), so its floats may differ in the last bits: an element that close to a code boundary
# (or to zero, for a sign bit) may land on either side of it. Anything further is a wrong code.
FLOAT_NOISE = 1e-5


def assert_codes_of(
    stored: np.ndarray, floats: np.ndarray, dtype: str, ranges: np.ndarray | None, chunk_id: str
) -> None:
    """``stored`` is ``quantize(floats)`` up to float noise: integer codes between those of
    floats -/+ FLOAT_NOISE, sign bits equal wherever the float is further than that from 0."""
    if dtype in ("binary", "ubinary"):
        packed = np.asarray(stored).astype(np.int16) + (128 if dtype == "binary" else 0)
        bits = np.unpackbits(packed.astype(np.uint8))[: floats.size].astype(bool)
        clear = np.abs(floats) > FLOAT_NOISE
        assert clear.sum() >= floats.size - 1, "the reference itself sits on zero"
        assert np.array_equal(bits[clear], floats[clear] > 0), chunk_id
        return
    low, high = (
        quantize((floats + shift)[None, :].astype(np.float32), dtype, ranges)[0].astype(np.int16)
        for shift in (-FLOAT_NOISE, FLOAT_NOISE)
    )
    codes = np.asarray(stored).astype(np.int16)
    assert ((low <= codes) & (codes <= high)).all(), (chunk_id, codes, low, high)
    # the check means something only where most codes are fixed (a code boundary lies within
    # the noise of a few elements, by chance: 4 of 48 once)
    assert (low != high).mean() <= 0.5, "the reference sits on code boundaries"


async def test_calibration_is_fixed_once_for_the_fleet(
    settings: Settings, client: aioredis.Redis, tiny_encoder: Encoder, tmp_path: Path
) -> None:
    """The first writer wins (SET NX); a user's file is stored the same way; a file that
    disagrees with Redis stops the worker with what to do."""
    from embedfleet.workers.calibration import Calibration

    def made(value: float) -> Calibration:
        ranges = np.array([[-value] * 4, [value] * 4], dtype=np.float32)
        return Calibration(tiny_encoder.name, "4", ranges, 10, "test")

    async def first() -> Calibration:
        return made(1.0)

    async def second() -> Calibration:
        return made(2.0)

    one = CalibrationStore(client, settings.keys, tiny_encoder.name)
    two = CalibrationStore(client, settings.keys, tiny_encoder.name)
    assert np.array_equal((await one.get("4", first)).ranges, made(1.0).ranges)
    assert np.array_equal((await two.get("4", second)).ranges, made(1.0).ranges)
    supplied = tmp_path / "calibration.json"
    supplied.write_text(json.dumps([json.loads(made(3.0).to_json())]))
    three = CalibrationStore(client, settings.keys, tiny_encoder.name, str(supplied))
    with pytest.raises(CalibrationError, match="differs from EMBEDFLEET_CALIBRATION_FILE"):
        await three.get("4")
    await client.delete(settings.keys.calibration(tiny_encoder.name, "4"))
    assert np.array_equal((await three.get("4")).ranges, made(3.0).ranges)
    shown = forks.run(["calibration", "--json"], env=worker_env(settings), text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr
    assert json.loads(shown.stdout)[0]["max"] == [3.0] * 4


# --- prompts and options through the lanes ---------------------------------------------------
async def test_lanes_use_query_and_document_prompts(
    workers: WorkerLauncher,
    settings: Settings,
    client: aioredis.Redis,
    tiny_encoder: Encoder,
    model_dir: Path,
) -> None:
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(model_dir), device="cpu")
    text = "how do I open a file?"
    options = EmbeddingOptions(dtype="float32")
    async with Producer(settings, client) as producer:
        async with workers.run(settings, encoder=tiny_encoder):
            query = await producer.embed_query(text, timeout=60, options=options)
            named = await producer.embed_query(
                text, timeout=60, options=EmbeddingOptions(prompt_name="document", dtype="float32")
            )
            await producer.enqueue([{"id": "d", "text": text}], job="docs", options=options)
            await producer.wait_for_job("docs", timeout=60)
            with pytest.raises(ValueError, match="prompt_name='nope' is not one of"):
                await producer.enqueue([{"id": "x", "text": text, "prompt_name": "nope"}])
            with pytest.raises(ValueError, match="dimensions=49 is more than"):
                await producer.enqueue([{"id": "x", "text": text, "dimensions": 49}])
        (document,) = [r.vector async for r in producer.results(job="docs")]
    assert_parity(query[None], model.encode_query([text]), "bert query stream via Redis")
    assert_parity(document[None], model.encode_document([text]), "bert bulk path via Redis")
    assert cosines(named[None], document[None]).min() >= MIN_COSINE


def test_worker_refuses_an_unsupported_module_at_start(
    workers: WorkerLauncher, settings: Settings, model_dir: Path, tmp_path: Path
) -> None:
    broken = model_zoo.with_extra_module(
        model_dir, tmp_path / "broken", "sentence_transformers.models.WeightedLayerPooling"
    )
    worker = workers.process("broken", settings, EMBEDFLEET_MODEL=str(broken))
    assert worker.wait(timeout=300) == 1
    assert "cannot run a WeightedLayerPooling module" in worker.log()
