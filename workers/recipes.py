"""A chunk's content-key recipe as its worker resolves its options (shared/content_key.py).

The recipe depends on a chunk's options, not its text, so ``Recipes`` makes it once per set of
options and keeps it (issue 43: rebuilt per chunk it cost more than the text's hash). What a
chunk asks beyond the model's plain vector (its representations, raw scores, token states, the
vector before Normalize, a long input in windows) is part of its recipe, so a stored vector
never answers a chunk that asks for another.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from embedfleet.shared.content_key import VectorRecipe, content_key
from embedfleet.shared.modelcard import ModelCard
from embedfleet.shared.protocol import Chunk
from embedfleet.workers.model.heads import TOKEN_STATES

# recipes a Recipes keeps, by options (a few in practice: one per prompt and shape)
RECIPES_HELD = 1024


@dataclass(frozen=True)
class OutputSpec:
    """What one chunk's vector becomes: its dimension and stored precision."""

    dim: int
    dtype: str


def recipe_for(
    card: ModelCard,
    chunk: Chunk,
    prompt: str,
    spec: OutputSpec,
    *,
    renormalize: bool,
    model_dim: int,
) -> VectorRecipe:
    """``chunk``'s recipe for the model of ``card``, its prompt and shape resolved (``spec``);
    ``renormalize``: whether a vector truncated below ``model_dim`` is renormalised."""
    recipe = card.recipe(
        prompt=prompt,
        dimensions=spec.dim,
        renormalize=renormalize and spec.dim < model_dim,
        dtype=spec.dtype,
        max_active_dims=chunk.max_active_dims,
    )
    representation = recipe.representation
    if chunk.representations:
        # what the chunk asks of a multi-head model (BGE-M3: dense, sparse, multivector from
        # one pass) is part of what it gets back, so of its key: an entry stored for a
        # dense-only chunk must not answer one that wants the per-token vectors too
        representation = "+".join(sorted(chunk.representations))
        if "multivector" in chunk.representations:
            representation += f":{chunk.multivector_dtype or 'float16'}"
    if chunk.raw_scores:
        # a cross-encoder's logits (TEI's raw_scores) are another answer than its scores
        representation += ":raw"
    if chunk.token_states:
        # the token states travel beside the pooled vector: an entry stored without them
        # must never answer a chunk that asks for them, nor theirs one that does not
        representation += f"+{TOKEN_STATES}"
    if chunk.window_overlap is not None:
        # a long input embedded whole is another vector than the same text cut
        representation += f":windows:{chunk.window_overlap}"
    # the vector before the model's Normalize (TEI's normalize=false) is another vector
    normalize = recipe.normalize and chunk.normalize is not False
    return dataclasses.replace(recipe, representation=representation, normalize=normalize)


class Recipes:
    """One worker's recipes, kept by options: ``key`` gives a chunk's content key."""

    def __init__(self, card: ModelCard, *, renormalize: bool, model_dim: int) -> None:
        self.card = card
        self.renormalize = renormalize
        self.model_dim = model_dim
        self._held: dict[tuple[object, ...], VectorRecipe] = {}

    def key(self, chunk: Chunk, prompt: str, spec: OutputSpec) -> str:
        """``chunk``'s content key, its recipe made once per set of options."""
        options = (
            prompt,
            spec,
            chunk.max_active_dims,
            chunk.representations,
            chunk.multivector_dtype,
            chunk.normalize,
            chunk.window_overlap,
            chunk.raw_scores,
            chunk.token_states,
        )
        recipe = self._held.get(options)
        if recipe is None:
            if len(self._held) >= RECIPES_HELD:  # (literal prompts are the callers': bounded)
                self._held.clear()
            recipe = self._held[options] = recipe_for(
                self.card,
                chunk,
                prompt,
                spec,
                renormalize=self.renormalize,
                model_dim=self.model_dim,
            )
        return content_key(chunk.text, recipe, chunk.pair, chunk.image)
