"""Packed batches give the vectors unpacked batches give (fp32, real texts), with less padding.

The CPU form of the same code the GPU runs: varlen (the worker's CUDA layout) with whichever
kernel is available here (nested-tensor SDPA or the per-text loop; torch's flash varlen or
flash-attn on CUDA), and the benchmark's rows with a block-diagonal mask (loadtest/packed_rows.py).
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import pytest

from embedfleet.workers.batcher import padding_waste, plan_batches, plan_packed_batches
from embedfleet.workers.model.encoder import Encoder, Tokenized
from embedfleet.workers.model.packing import (
    VARLEN_KERNELS,
    PackedEncoder,
    collate_varlen,
    preferred_layout,
)
from embedfleet.workers.model.precision import cosines
from loadtest.corpus import build_corpus, load_tokenizer
from loadtest.packed_rows import RowsEncoder, collate_rows, pack_rows, plan_rows, pool_rows
from tests.conftest import model_under_test
from tests.paths import REPO_ROOT

MIN_COSINE = 0.9999
TEXTS = 96


@pytest.fixture(scope="module")
def corpus_tokens(encoder: Encoder) -> tuple[list[str], list[Tokenized]]:
    # the encoder's own tokenizer: on the device check the model is a carried folder
    tokenizer = load_tokenizer(str(encoder.model_dir))
    texts = [item.text for item in build_corpus(TEXTS, seed=11, tokenizer=tokenizer)]
    return texts, encoder.tokenize(texts)


def unpacked(encoder: Encoder, tokens: list[Tokenized]) -> np.ndarray:
    """The reference: sorted, padded micro-batches through Encoder.embed."""
    vectors = np.zeros((len(tokens), encoder.dim), dtype=np.float32)
    for planned in plan_batches([t.length for t in tokens], token_budget=4096, max_batch=64):
        batch = encoder.collate([tokens[p] for p in planned.positions])
        vectors[planned.positions] = encoder.embed(batch)
    return vectors


def test_rows_match_unpacked(encoder: Encoder, corpus_tokens: tuple) -> None:
    _, tokens = corpus_tokens
    reference = unpacked(encoder, tokens)
    packer = RowsEncoder(encoder, width=256)
    vectors = np.zeros_like(reference)
    for positions in plan_rows([t.length for t in tokens], 2048, 256):
        batch = packer.collate([tokens[p] for p in positions])
        assert batch.size == len(positions)
        vectors[positions] = packer.embed(batch)
    assert cosines(reference, vectors).min() >= MIN_COSINE


def test_varlen_matches_unpacked_and_leaves_padded_path_alone(
    varlen_encoder: Encoder, encoder: Encoder, corpus_tokens: tuple
) -> None:
    _, tokens = corpus_tokens
    reference = unpacked(encoder, tokens)
    packer = PackedEncoder(varlen_encoder)
    assert packer.kernel in VARLEN_KERNELS
    vectors = np.zeros_like(reference)
    for planned in plan_packed_batches([t.length for t in tokens], 2048, 256):
        positions = planned.positions
        vectors[positions] = packer.embed(packer.collate([tokens[p] for p in positions]))
    assert cosines(reference, vectors).min() >= MIN_COSINE
    # The switched attention sends padded batches to stock SDPA: Encoder.embed is unchanged.
    assert cosines(reference, unpacked(varlen_encoder, tokens)).min() >= 0.999999


# On CPU nested tensors fall back to a strided prototype path that warns; expected here.
@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
@pytest.mark.parametrize("kernel", ["nested_sdpa", "loop_sdpa"])
def test_each_cpu_varlen_kernel_matches(
    varlen_encoder: Encoder, encoder: Encoder, corpus_tokens: tuple, kernel: str
) -> None:
    """Every fallback must be right, not just the one this machine happens to pick."""
    from embedfleet.workers.model.packing import install_varlen_attention

    _, tokens = corpus_tokens
    subset = tokens[:24]
    reference = unpacked(encoder, subset)
    packer = PackedEncoder(varlen_encoder)
    install_varlen_attention(varlen_encoder._model, kernel)
    vectors = packer.embed(collate_varlen(subset))
    assert cosines(reference, vectors).min() >= MIN_COSINE


def test_pooling_modes_match_unpacked(encoder: Encoder, corpus_tokens: tuple) -> None:
    """cls / max / last-token pooling read the right tokens of each packed text, in both packed
    layouts; varlen builds its token-to-text map on the device from cu_seqlens.

    Inputs go to the model's device and outputs come back to the host, so this runs on a CUDA
    encoder (the fixture picks CUDA when present) as it runs here.
    """
    import torch

    from embedfleet.workers.model.dense import pool
    from embedfleet.workers.model.packing import pool_packed, token_map

    _, tokens = corpus_tokens
    subset = tokens[:16]
    device = encoder.device
    padded = encoder.collate(subset)
    rows = collate_rows(subset, width=256)
    varlen = collate_varlen(subset)
    padded_mask = padded.attention_mask.to(device)
    with torch.inference_mode():
        hidden_padded = encoder._model(
            input_ids=padded.input_ids.to(device), attention_mask=padded_mask
        ).last_hidden_state.float()
        hidden_rows = encoder._model(
            input_ids=rows.input_ids.to(device),
            position_ids=rows.position_ids.to(device),
            attention_mask=rows.attention_mask.to(device),
        ).last_hidden_state.float()
    # varlen: the same hidden states laid end to end, text by text, mapped on the device
    laid_out = torch.cat([hidden_padded[r, : subset[r].length] for r in range(len(subset))])
    mapped = token_map(varlen.cu_seqlens.to(device), varlen.real_tokens)
    expected_owner = [r for r, item in enumerate(subset) for _ in range(item.length)]
    assert mapped.owner.tolist() == expected_owner
    assert mapped.position_ids.tolist() == [p for item in subset for p in range(item.length)]
    for mode in ("mean", "cls", "max", "lasttoken"):
        expected = pool(hidden_padded, padded_mask, mode).cpu().numpy()
        got_rows = pool_rows(hidden_rows, rows, mode).cpu().numpy()
        assert cosines(expected, got_rows).min() >= MIN_COSINE, ("rows", mode)
        got_varlen = pool_packed(laid_out, mapped.owner, mapped.first, mapped.lengths, mode)
        assert cosines(expected, got_varlen.cpu().numpy()).min() >= MIN_COSINE, ("varlen", mode)


def test_two_varlen_models_keep_their_own_kernels(
    varlen_encoder: Encoder, monkeypatch: pytest.MonkeyPatch, corpus_tokens: tuple
) -> None:
    """The attention registry is process-wide: installing a second model's kernel must not
    switch the first model (the bench's fp32 contender was sent to the bf16 model's flash-attn).
    """
    from embedfleet.workers.model import packing

    calls: list[str] = []

    def recording(name: str):
        kernel = packing.VARLEN_KERNELS[name]

        def run(*args: object):
            calls.append(name)
            return kernel(*args)

        return run

    for name in ("loop_sdpa", "nested_sdpa"):
        monkeypatch.setitem(packing.VARLEN_KERNELS, name, recording(name))
    other = Encoder(model_under_test())
    packers = {
        "loop_sdpa": PackedEncoder(varlen_encoder),
        "nested_sdpa": PackedEncoder(other),
    }
    # Installed one after the other, as the bench installs its fp32 and bf16 contenders.
    names = {
        kernel: packing.install_varlen_attention(packer.encoder._model, kernel)
        for kernel, packer in packers.items()
    }
    assert len(set(names.values())) == 2
    _, tokens = corpus_tokens
    batch = collate_varlen(tokens[:6])
    for kernel, packer in packers.items():
        calls.clear()
        packer.embed(batch)
        assert set(calls) == {kernel}, (kernel, calls)


@pytest.fixture(scope="module")
def spare_model() -> Any:
    """A model of its own whose attention the kernel tests may switch (the shared encoders'
    stay as they are)."""
    return Encoder(model_under_test())._model


@pytest.mark.parametrize("kernel", sorted(VARLEN_KERNELS))
def test_every_varlen_kernel_installs_under_a_name_transformers_accepts(
    kernel: str, spare_model: Any
) -> None:
    """Installing a kernel only registers it and switches the model's attention; the half-only
    kernels (CUDA's) install on a CPU too. Their first names held "flash", which transformers
    takes for a Hub flash-attention kernel: the CUDA bf16 varlen path failed at start."""
    from embedfleet.workers.model import packing

    name = packing.install_varlen_attention(spare_model, kernel)
    assert name == packing.varlen_attention_name(kernel) and "flash" not in name
    assert spare_model.config._attn_implementation == name


def test_packed_rows_wider_than_position_limit_get_token_types(
    varlen_encoder: Encoder, encoder: Encoder, corpus_tokens: tuple
) -> None:
    """A varlen row is every text of the batch end to end: far wider than the model's 512
    positions. The embeddings must be given token types of the row's shape (not the 512-wide
    buffer) and the vectors must still match."""
    _, tokens = corpus_tokens
    subset = [t for t in tokens if t.length > 40][:30]
    batch = collate_varlen(subset)
    limit = varlen_encoder._model.config.max_position_embeddings
    assert batch.real_tokens > limit
    seen: list[tuple[int, ...]] = []

    def record(_module: object, _args: object, kwargs: dict) -> None:
        token_types = kwargs.get("token_type_ids")
        seen.append(() if token_types is None else tuple(token_types.shape))

    packer = PackedEncoder(varlen_encoder)
    handle = varlen_encoder._model.embeddings.register_forward_pre_hook(record, with_kwargs=True)
    try:
        vectors = packer.embed(batch)
    finally:
        handle.remove()
    assert seen == [(1, batch.real_tokens)]
    assert cosines(unpacked(encoder, subset), vectors).min() >= MIN_COSINE


def test_transformers_floor_covers_the_varlen_interface(monkeypatch: pytest.MonkeyPatch) -> None:
    """pyproject's floor is the version the varlen path needs, and an older transformers gets
    an error that says what to do (and the padded layout on CUDA), not a crash mid-forward."""
    import re
    import tomllib

    import torch
    import transformers.masking_utils
    from packaging.version import Version

    from embedfleet.workers.model import packing

    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    (requirement,) = [
        r for r in pyproject["project"]["optional-dependencies"]["worker"] if "transformers" in r
    ]
    floor = re.search(r">=\s*([\d.]+)", requirement)
    assert floor and Version(floor.group(1)) >= Version(packing.MIN_TRANSFORMERS)

    monkeypatch.delattr(transformers.masking_utils, "AttentionMaskInterface")
    assert not packing.varlen_supported()
    assert preferred_layout(torch.device("cuda"), torch.bfloat16) == "padded"
    with pytest.raises(packing.VarlenUnavailableError, match="transformers>="):
        packing.install_varlen_attention(torch.nn.Linear(1, 1), "loop_sdpa")


def test_padding_waste_figures(corpus_tokens: tuple) -> None:
    """Arrival order (batches of 32) wastes a third or more; sorting, packing and varlen don't.

    Figures for the benchmark corpus (2,000 texts) are in docs/BENCHMARKS.md; printed with -s.
    """
    rng = random.Random(0)
    lengths = [min(t.length, 256) for t in corpus_tokens[1]]
    lengths = lengths + [rng.choice(lengths) for _ in range(900)]  # a worker-sized window
    naive = 1 - sum(lengths) / sum(
        max(lengths[i : i + 32]) * len(lengths[i : i + 32]) for i in range(0, len(lengths), 32)
    )
    sorted_waste = padding_waste(plan_batches(lengths, token_budget=4096, max_batch=128))
    rows = pack_rows(lengths, 256)
    rows_waste = 1 - sum(lengths) / (256 * len(rows))
    items = [Tokenized(ids=[1] * n, truncated=False) for n in lengths]
    varlen_waste = padding_waste(plan_packed_batches(lengths, 4096, 128))
    assert all(
        collate_varlen([items[p] for p in b.positions]).padded_tokens == b.real_tokens
        for b in plan_packed_batches(lengths, 4096, 128)
    )
    print(
        f"\npadding waste: arrival order {naive:.1%}, sorted {sorted_waste:.1%}, "
        f"rows(256) {rows_waste:.1%}, varlen {varlen_waste:.1%}"
    )
    assert naive > 0.3
    assert sorted_waste < 0.05 and rows_waste < 0.02 and varlen_waste == 0.0


def test_pack_rows_keeps_every_text_once_within_width() -> None:
    rng = random.Random(3)
    lengths = [rng.randint(1, 300) for _ in range(500)]
    rows = pack_rows(lengths, 256)
    assert sorted(p for row in rows for p in row) == list(range(500))
    for row in rows:
        assert len(row) == 1 or sum(lengths[p] for p in row) <= 256


def test_layout_choice_is_explicit() -> None:
    """varlen on CUDA; padded on CPU in every dtype (rows was measured against eager bf16, not
    the frozen bf16 bulk the worker runs now: it is a benchmark contender only)."""
    import torch

    assert preferred_layout(torch.device("cpu"), torch.float32) == "padded"
    assert preferred_layout(torch.device("cpu"), torch.bfloat16) == "padded"
    assert preferred_layout(torch.device("cuda"), torch.float32) == "varlen"
    assert preferred_layout(torch.device("cuda"), torch.bfloat16) == "varlen"


def test_plan_rows_batches_rows_within_budget() -> None:
    rng = random.Random(5)
    lengths = [rng.randint(3, 256) for _ in range(700)]
    batches = plan_rows(lengths, token_budget=4096, width=256)
    assert sorted(p for batch in batches for p in batch) == list(range(700))
    for batch in batches:
        assert sum(lengths[p] for p in batch) <= 4096  # 16 rows of at most 256 tokens
