"""The content key (shared/content_key.py): every field of the recipe, the text and the pair
change it; nothing else does. Pure logic: no server."""

from __future__ import annotations

import dataclasses
import hashlib
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest

from embedfleet.shared.content_key import VectorRecipe, content_key
from embedfleet.shared.modelcard import ModelCard
from embedfleet.shared.protocol import Chunk, Result, SparseVector, encode_result
from embedfleet.shared.vector_cache import CachedVector, pack_entry, unpack_entry
from embedfleet.workers.model.model_dir import directory_revision

RECIPE = VectorRecipe(
    model="all-MiniLM-L6-v2",
    revision="blake2b:00",
    representation="dense",
    pooling=("mean",),
    include_prompt=True,
    normalize=True,
    max_length=256,
    prompt="",
    dimensions=384,
    renormalize=False,
    dtype="float16",
    max_active_dims=None,
)

# one other value for each field: each must give another key
CHANGED: dict[str, Any] = {
    "model": "bge-small-en-v1.5",
    "revision": "blake2b:01",
    "representation": "sparse",
    "pooling": ("cls",),
    "include_prompt": False,
    "normalize": False,
    "max_length": 512,
    "prompt": "query: ",
    "dimensions": 128,
    "renormalize": True,
    "dtype": "float32",
    "max_active_dims": 64,
}


def test_every_recipe_field_is_tried() -> None:
    assert set(CHANGED) == {f.name for f in dataclasses.fields(VectorRecipe)}


@pytest.mark.parametrize("name", sorted(CHANGED))
def test_every_option_changes_the_key(name: str) -> None:
    other = dataclasses.replace(RECIPE, **{name: CHANGED[name]})
    assert content_key("a text", other) != content_key("a text", RECIPE)


def test_the_text_and_the_pair_change_the_key_and_nothing_else_does() -> None:
    key = content_key("a text", RECIPE)
    assert key == content_key("a text", dataclasses.replace(RECIPE))  # stable
    assert key.startswith("v1:") and len(key) == 3 + 32
    assert content_key("a text.", RECIPE) != key
    assert content_key("a text", RECIPE, pair="a document") != key
    assert content_key("a text", RECIPE, pair="a document") != content_key(
        "a text", RECIPE, pair="another document"
    )
    # the separation between fields holds: the prompt is not just glued to the text
    assert content_key("b", dataclasses.replace(RECIPE, prompt="a")) != content_key("ab", RECIPE)


@pytest.mark.parametrize("text", ["", "a text", "é" * 300, "x" * 70_000])
@pytest.mark.parametrize("pair", [None, "a document"])
def test_the_key_is_the_documented_digest(text: str, pair: str | None) -> None:
    # issue 43 hashes the recipe once and the text per chunk: the key stays the digest of the
    # whole [version, recipe, text, pair] array, so entries stored before it still answer
    packed = msgpack.packb(["v1", list(dataclasses.astuple(RECIPE)), text, pair], use_bin_type=True)
    expected = "v1:" + hashlib.blake2b(packed, digest_size=16).hexdigest()
    assert content_key(text, RECIPE, pair) == expected
    assert content_key(text, dataclasses.replace(RECIPE, prompt="q"), pair) != expected


def test_an_entry_is_the_result_without_its_row_fields() -> None:
    # issue 43 copies the result rather than dataclasses.replace: same bytes, result unchanged
    result = Result(
        id="c1",
        model="m",
        vector=np.arange(8, dtype=np.float16),
        job="j",
        meta={"a": 1},
        text="a text",
        truncated=True,
    )
    bare = dataclasses.replace(result, id="", job=None, meta=None, text=None)
    expected = msgpack.packb({"t": 5, "r": encode_result(bare)}, use_bin_type=True)
    assert pack_entry(result, 5) == expected
    assert (result.id, result.job, result.meta, result.text) == ("c1", "j", {"a": 1}, "a text")


def test_the_card_makes_the_recipe_with_its_revision() -> None:
    card = ModelCard(name="m", dim=8, max_length=32, normalize=True, revision="hf:" + "a" * 40)
    recipe = card.recipe(prompt="", dimensions=8, renormalize=False, dtype="float16")
    assert recipe.revision == "hf:" + "a" * 40 and recipe.model == "m"
    assert ModelCard.from_fields(card.to_fields()).revision == card.revision
    older = {k: v for k, v in card.to_fields().items() if k != "revision"}
    assert ModelCard.from_fields(older).revision == ""  # a card from before it existed


def test_directory_revision_follows_the_files(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(b"\x00" * 64)
    first = directory_revision(tmp_path)
    assert first.startswith("blake2b:") and directory_revision(tmp_path) == first
    weights.write_bytes(b"\x00" * 63 + b"\x01")  # a fine-tune: same names, same sizes
    assert directory_revision(tmp_path) != first
    snapshot = tmp_path / "models--x" / "snapshots" / ("b" * 40)
    snapshot.mkdir(parents=True)
    assert directory_revision(snapshot) == "hf:" + "b" * 40


def test_an_entry_keeps_the_result_and_gives_each_chunk_its_own_row() -> None:
    vector = np.arange(8, dtype=np.float16)
    result = Result(id="old", model="m", vector=vector, job="j1", truncated=True, meta={"a": 1})
    entry = unpack_entry(pack_entry(result, tokens=17))
    assert isinstance(entry, CachedVector) and entry.tokens == 17
    chunk = Chunk(id="new", text="t", job="j2", meta={"b": 2})
    row = entry.for_chunk(chunk)
    assert (row.id, row.job, row.meta, row.text) == ("new", "j2", {"b": 2}, "t")
    assert row.truncated
    assert row.dtype == "float16" and np.array_equal(row.vector, vector)
    assert unpack_entry(b"not an entry") is None


def test_a_sparse_or_rerank_entry_comes_back_whole() -> None:
    sparse = SparseVector(
        indices=np.array([3, 17], dtype=np.uint32), values=np.array([0.5, 1.25], np.float32), dim=30
    )
    weights = Result(
        id="s",
        model="splade",
        vector=np.zeros(0, np.float32),
        dtype="float32",
        dimension=0,
        sparse=sparse,
    )
    entry = unpack_entry(pack_entry(weights, tokens=5))
    assert entry is not None and entry.result.sparse is not None
    assert entry.result.sparse.indices.tolist() == [3, 17] and entry.result.sparse.dim == 30
    assert entry.result.sparse.values.tolist() == [0.5, 1.25]
    score = Result(
        id="r", model="ce", vector=np.array([2.5], np.float32), dtype="float32", score=2.5
    )
    scored = unpack_entry(pack_entry(score, tokens=9))
    assert scored is not None and scored.result.score == 2.5


def test_an_image_chunk_is_keyed_by_its_bytes() -> None:
    key = content_key("", RECIPE, image=b"\x89PNG one")
    assert key == content_key("", RECIPE, image=b"\x89PNG one")
    assert key != content_key("", RECIPE, image=b"\x89PNG two")
    # a text's key is as it was before images (the cache keeps its entries)
    assert content_key("a text", RECIPE, image=None) == content_key("a text", RECIPE)
