"""One forward pass, several representations: a BGE-M3-shaped model's dense, sparse and
multi-vector (ColBERT) outputs, as FlagEmbedding's ``BGEM3FlagModel.encode`` computes them.

sentence-transformers has no BGE-M3 loader (its SparseEncoder reads SPLADE heads, not
``sparse_linear.pt``), so the reference here is FlagEmbedding's logic re-implemented on the same
weights (:class:`FlagReference`: its tokenizer call, ``_dense_embedding`` with CLS,
``_sparse_embedding`` + ``_process_token_weights``, ``_colbert_embedding`` +
``_process_colbert_vecs``), loaded independently of the worker (transformers' AutoModel, the
head files through ``torch.load``). The dense vector is also checked against
``SentenceTransformer.encode``, which reads the same directory's modules.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import numpy as np
import pytest
import redis.asyncio as aioredis
import torch

from embedfleet.producer import Producer
from embedfleet.shared.protocol import Chunk, MultiVector, Result, decode_result, encode_result
from embedfleet.shared.settings import Settings
from embedfleet.workers.batcher import plan_batches
from embedfleet.workers.calibration import CalibrationStore
from embedfleet.workers.model.encoder import Encoder
from embedfleet.workers.model.model_dir import read_model_spec
from embedfleet.workers.output import Outputs
from tests.conftest import WorkerLauncher
from tests.model_zoo import bge_m3_dir, sample_texts

WEIGHT_TOLERANCE = 1e-4
MIN_TOKEN_COSINE = 0.999
ALL = ("dense", "sparse", "multivector")


def texts() -> list[str]:
    return sample_texts(9, 350)


@pytest.fixture(scope="module")
def zoo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("zoo-bge-m3")


class FlagReference:
    """FlagEmbedding's BGEM3 inference on a directory's weights (no worker code)."""

    def __init__(self, model_dir: Path, max_length: int) -> None:
        from transformers import AutoModel, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModel.from_pretrained(model_dir).eval()
        self.max_length = max_length
        self.heads = {}
        for name in ("sparse_linear", "colbert_linear"):
            state = torch.load(model_dir / f"{name}.pt", weights_only=True)
            layer = torch.nn.Linear(state["weight"].shape[1], state["weight"].shape[0])
            layer.load_state_dict(state)
            self.heads[name] = layer.eval()
        self.unused = {
            self.tokenizer.convert_tokens_to_ids(self.tokenizer.special_tokens_map[token])
            for token in ("cls_token", "eos_token", "pad_token", "unk_token")
            if token in self.tokenizer.special_tokens_map
        }

    @torch.no_grad()
    def encode(
        self, inputs: list[str], batch_size: int = 4
    ) -> tuple[np.ndarray, list[dict[int, float]], list[np.ndarray]]:
        dense, lexical, colbert = [], [], []
        for start in range(0, len(inputs), batch_size):
            batch = self.tokenizer(
                inputs[start : start + batch_size],
                padding=True,
                truncation=True,
                max_length=self.max_length,
                return_tensors="pt",
            )
            hidden = self.model(**batch).last_hidden_state
            mask = batch["attention_mask"]
            dense.append(torch.nn.functional.normalize(hidden[:, 0], dim=-1).numpy())
            token_weights = torch.relu(self.heads["sparse_linear"](hidden))
            vectors = self.heads["colbert_linear"](hidden[:, 1:]) * mask[:, 1:][:, :, None].float()
            vectors = torch.nn.functional.normalize(vectors, dim=-1)
            for row in range(hidden.shape[0]):
                lexical.append(
                    self._process_token_weights(
                        token_weights[row].squeeze(-1).tolist(), batch["input_ids"][row].tolist()
                    )
                )
                tokens = int(mask[row].sum())
                colbert.append(vectors[row][: tokens - 1].numpy())
        return np.concatenate(dense), lexical, colbert

    def _process_token_weights(self, weights: list[float], ids: list[int]) -> dict[int, float]:
        result: dict[int, float] = defaultdict(int)
        for weight, idx in zip(weights, ids, strict=True):
            if idx not in self.unused and weight > 0 and weight > result[idx]:
                result[idx] = weight
        return dict(result)


def outputs(encoder: Encoder) -> Outputs:
    return Outputs(Settings(), encoder, CalibrationStore(None, None, encoder.name))  # type: ignore[arg-type]


def fleet_results(encoder: Encoder, chunks: list[Chunk], budget: int = 256) -> list[Result]:
    """The worker's path: length-sorted batches, each one forward pass with the heads its chunks
    want, results shaped by Outputs, through the wire and back; in chunk order."""
    out = outputs(encoder)
    tokens = encoder.tokenize([chunk.text for chunk in chunks])
    found: dict[int, Result] = {}
    for planned in plan_batches([t.length for t in tokens], token_budget=budget, max_batch=5):
        batch_chunks = [chunks[p] for p in planned.positions]
        batch = encoder.collate([tokens[p] for p in planned.positions])
        batch.heads = out.heads_for(batch_chunks)
        rows = encoder.embed(batch)
        results = out.results(batch_chunks, rows, [tokens[p].truncated for p in planned.positions])
        for position, result in zip(planned.positions, results, strict=True):
            found[position] = decode_result(encode_result(result))
    return [found[row] for row in range(len(chunks))]


def assert_sparse_matches(result: Result, expected: dict[int, float], text: str) -> None:
    assert result.sparse is not None
    indices = np.array(sorted(expected), dtype=np.int64)  # may be empty: relu of all < 0
    np.testing.assert_array_equal(result.sparse.indices, indices, err_msg=text)
    np.testing.assert_allclose(
        result.sparse.values,
        [expected[i] for i in indices.tolist()],
        rtol=WEIGHT_TOLERANCE,
        atol=1e-5,
    )


def token_cosines(multi: MultiVector, expected: np.ndarray) -> np.ndarray:
    ours = multi.floats()
    assert ours.shape == expected.shape
    return np.sum(ours * expected, axis=1) / (
        np.linalg.norm(ours, axis=1) * np.linalg.norm(expected, axis=1)
    )


def test_bge_m3_heads_match_flag_embedding(zoo: Path) -> None:
    """All three representations from one pass per batch: dense within 1e-5 of
    SentenceTransformer and FlagEmbedding, sparse the same ids and weights, every per-token
    vector at cosine >= 0.999 (fp16 on the wire) and the same count."""
    from sentence_transformers import SentenceTransformer

    model_dir = bge_m3_dir(zoo)
    spec = read_model_spec(model_dir)
    assert spec.token_heads is not None and spec.token_heads.representations == ALL[1:]
    encoder = Encoder(str(model_dir), device="cpu")
    assert encoder.card.representations == ALL
    inputs = texts()
    chunks = [Chunk(id=f"c{i}", text=t, representations=ALL) for i, t in enumerate(inputs)]
    results = fleet_results(encoder, chunks)
    dense, lexical, colbert = FlagReference(model_dir, encoder.max_length).encode(inputs)
    st_dense = SentenceTransformer(str(model_dir), device="cpu").encode(inputs)
    assert results[-1].truncated and not results[0].truncated
    ours = np.stack([r.vector.astype(np.float32) for r in results])
    np.testing.assert_allclose(ours, dense, atol=2e-3)  # fp16 on the wire
    np.testing.assert_allclose(dense, st_dense, atol=1e-5)
    worst = 1.0
    for row, result in enumerate(results):
        assert_sparse_matches(result, lexical[row], inputs[row])
        assert result.sparse is not None and result.sparse.dim == encoder.layout.vocab_size  # type: ignore[union-attr]
        assert result.multivector is not None and result.multivector.dtype == "float16"
        cosines = token_cosines(result.multivector, colbert[row])
        worst = min(worst, float(cosines.min()))
    assert worst >= MIN_TOKEN_COSINE
    assert sum(bool(row) for row in lexical) >= len(lexical) - 2  # the weights are exercised
    print(f"BGE-M3 one pass: min token cosine {worst:.6f}")


def test_each_chunk_gets_what_it_asked_for_in_one_batch(zoo: Path) -> None:
    """Chunks asking for different representations share a batch (one forward pass); each
    result carries exactly its own: max_active_dims prunes, int8 per-token vectors keep
    cosine >= 0.999, a default chunk gets the dense vector alone."""
    model_dir = bge_m3_dir(zoo)
    encoder = Encoder(str(model_dir), device="cpu")
    inputs = texts()[:6]
    asks = [
        Chunk(id="a", text=inputs[0]),
        Chunk(id="b", text=inputs[1], representations=("sparse",), max_active_dims=3),
        Chunk(id="c", text=inputs[2], representations=("multivector",), multivector_dtype="int8"),
        Chunk(id="d", text=inputs[3], representations=("dense", "sparse")),
        Chunk(id="e", text=inputs[4], representations=("dense", "multivector")),
        Chunk(id="f", text=inputs[5], representations=ALL, multivector_dtype="int8"),
    ]
    calls = []
    handle = encoder._model.register_forward_hook(lambda *_: calls.append(1))
    try:
        results = fleet_results(encoder, asks, budget=10_000)
    finally:
        handle.remove()
    assert len(calls) == 2  # max_batch=5: six chunks, two forward passes, every head on each
    dense, lexical, colbert = FlagReference(model_dir, encoder.max_length).encode(inputs)
    by_id = {r.id: (r, row) for row, r in enumerate(results)}
    for chunk in asks:
        result, row = by_id[chunk.id]
        wanted = chunk.representations or ("dense",)
        assert (result.dim > 0) == ("dense" in wanted), chunk.id
        assert (result.sparse is not None) == ("sparse" in wanted), chunk.id
        assert (result.multivector is not None) == ("multivector" in wanted), chunk.id
        if "dense" in wanted:
            np.testing.assert_allclose(result.vector.astype(np.float32), dense[row], atol=2e-3)
        if result.multivector is not None:
            assert result.multivector.dtype == (chunk.multivector_dtype or "float16")
            assert token_cosines(result.multivector, colbert[row]).min() >= MIN_TOKEN_COSINE
    pruned = by_id["b"][0].sparse
    assert pruned is not None and pruned.indices.size == 3
    top = sorted(lexical[1].items(), key=lambda item: (-item[1], item[0]))[:3]
    np.testing.assert_array_equal(pruned.indices, sorted(i for i, _ in top))
    assert_sparse_matches(by_id["d"][0], lexical[3], inputs[3])


def test_the_dense_path_is_unchanged_without_heads_asked(zoo: Path) -> None:
    """A batch whose chunks want the dense vector alone runs as on any dense model: plain
    (batch, dim) rows, float16 cast allowed."""
    encoder = Encoder(str(bge_m3_dir(zoo)), device="cpu")
    out = outputs(encoder)
    plain = [Chunk(id="a", text="x"), Chunk(id="b", text="y", representations=("dense",))]
    assert out.heads_for(plain) is None and out.full_float16(plain)
    assert encoder.embed_texts(["x", "y"]).shape == (2, encoder.dim)
    mixed = [*plain, Chunk(id="c", text="z", representations=("sparse",))]
    assert out.heads_for(mixed) == ("dense", "sparse") and not out.full_float16(mixed)


def test_what_a_chunk_asks_for_is_part_of_its_content_key(zoo: Path) -> None:
    """The re-ingestion cache (issue 31) keys a vector by the text and every option that
    changes the result: an entry stored for a dense-only chunk must not answer one that asks
    for the per-token vectors, nor an fp16 multivector an int8 one."""
    out = outputs(Encoder(str(bge_m3_dir(zoo)), device="cpu"))
    asks = [
        Chunk(id="a", text="same"),
        Chunk(id="b", text="same", representations=("sparse",)),
        Chunk(id="c", text="same", representations=("dense", "multivector")),
        Chunk(
            id="d", text="same", representations=("dense", "multivector"), multivector_dtype="int8"
        ),
        Chunk(id="e", text="same", representations=ALL),
    ]
    keys = [out.content_key(chunk, "") for chunk in asks]
    assert None not in keys and len(set(keys)) == len(asks)
    # the order a chunk names them in is not an option
    reordered = Chunk(id="f", text="same", representations=("multivector", "dense"))
    assert out.content_key(reordered, "") == keys[2]


async def test_all_three_through_a_worker(
    workers: WorkerLauncher, settings: Settings, client: aioredis.Redis, zoo: Path
) -> None:
    """The query stream, the interactive stream and bulk give FlagEmbedding's three outputs."""
    model_dir = bge_m3_dir(zoo)
    encoder = Encoder(str(model_dir), device="cpu")
    inputs = texts()
    async with Producer(settings, client) as producer, workers.run(settings, encoder=encoder):
        card = await producer.model_card()
        queried = await producer.embed_representations(inputs[:3], ALL, timeout=30)
        interactive = await producer.embed_representations(
            inputs, ALL, timeout=60, lane="texts", multivector_dtype="int8"
        )
        chunks = [Chunk(id=f"d{i}", text=t, representations=ALL) for i, t in enumerate(inputs)]
        await producer.enqueue(chunks, job="m3-job")
        await producer.wait_for_job("m3-job", timeout=120)
        bulk = {r.id: r async for r in producer.results(job="m3-job")}
    assert card is not None and card.representations == ALL
    dense, lexical, colbert = FlagReference(model_dir, encoder.max_length).encode(inputs)
    answered = [
        *enumerate(queried),
        *enumerate(interactive),
        *((i, bulk[f"d{i}"]) for i in range(len(inputs))),
    ]
    for row, result in answered:
        np.testing.assert_allclose(result.vector.astype(np.float32), dense[row], atol=2e-3)
        assert_sparse_matches(result, lexical[row], inputs[row])
        assert result.multivector is not None
        assert token_cosines(result.multivector, colbert[row]).min() >= MIN_TOKEN_COSINE
