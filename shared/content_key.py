"""A chunk's content key: the one digest that says "this vector was already made" (issue 31).

Two chunks get the same key exactly when the fleet would compute the same stored vector for
them: the same text (and, for a cross-encoder, the same ``pair``) through the same model, with
the same options. So the key is a digest of the text and of everything else that changes the
vector, gathered in one :class:`VectorRecipe`:

- the model: its served ``name`` and its ``revision`` (the model card's digest of the model's
  files, or ``EMBEDFLEET_MODEL_REVISION``), and what the card says of its shape: the
  representation (dense, sparse, rerank), pooling modes, whether prompt tokens are pooled,
  normalisation and the longest input (a longer limit cuts a long text elsewhere);
- the chunk's options, resolved as the worker applies them: the prompt text (a literal or the
  one a prompt name stands for, so two names for one text share vectors), the dimensions after
  ``EMBEDFLEET_DIMENSIONS``, whether a truncated vector is renormalised, the output precision,
  and a sparse vector's ``max_active_dims``.

What is not in it, and why: the forward path (bf16, the frozen graph, an int8 copy, CUDA) is
held to parity with float32 by the worker's gates, so its vectors are the same vector for every
use the fleet makes of them; a key that named it would make a CPU and a GPU fleet re-embed
each other's corpus. The chunk's id, job and meta change the row, not the vector.

The key is ``v1:`` and 32 hex digits of BLAKE2b-128 over a canonical msgpack encoding of the
recipe and the text; the version prefix changes if the recipe ever gains a field, so old
entries can never be mistaken for new ones.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from dataclasses import dataclass

import msgpack

KEY_VERSION = "v1"


@dataclass(frozen=True)
class VectorRecipe:
    """Everything but the text that decides a stored vector. Every field is in the key."""

    model: str
    revision: str
    representation: str
    pooling: tuple[str, ...]
    include_prompt: bool
    normalize: bool
    max_length: int
    prompt: str
    dimensions: int
    renormalize: bool
    dtype: str
    max_active_dims: int | None = None


def content_key(
    text: str, recipe: VectorRecipe, pair: str | None = None, image: bytes | None = None
) -> str:
    """The content key of ``text`` (and a cross-encoder's ``pair``, or an image chunk's
    ``image`` bytes) made with ``recipe``."""
    # the digest of [KEY_VERSION, recipe, text, pair] as one msgpack array: the array's head,
    # the version and the recipe are hashed once per recipe (issue 43: the recipe's tuple and
    # packing cost more than the text's hash), the text and the pair per chunk; same bytes
    digest = _recipe_digest(recipe).copy()
    digest.update(msgpack.packb(text, use_bin_type=True))
    digest.update(msgpack.packb(pair, use_bin_type=True))
    if image is not None:
        # an image chunk's bytes after its empty text: no text chunk has an empty text, so
        # no text's key can equal an image's, and every text's key is as it was before images
        digest.update(msgpack.packb(image, use_bin_type=True))
    return f"{KEY_VERSION}:{digest.hexdigest()}"


@functools.lru_cache(maxsize=256)
def _recipe_digest(recipe: VectorRecipe) -> hashlib.blake2b:
    """BLAKE2b-128 fed the key's first three parts (a fixarray of four: 0x94)."""
    head = b"\x94" + msgpack.packb(KEY_VERSION, use_bin_type=True)
    fields = msgpack.packb(list(dataclasses.astuple(recipe)), use_bin_type=True)
    return hashlib.blake2b(head + fields, digest_size=16)
