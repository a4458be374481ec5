"""workers/recipes.py: a chunk's content-key recipe carries every option that changes what it
gets back, and ``Recipes`` makes each recipe once per set of options (pure logic, no model)."""

from __future__ import annotations

from embedfleet.shared.content_key import content_key
from embedfleet.shared.modelcard import ModelCard
from embedfleet.shared.protocol import Chunk
from embedfleet.workers.recipes import RECIPES_HELD, OutputSpec, Recipes, recipe_for

CARD = ModelCard(name="tiny", dim=48, max_length=128, normalize=True, revision="r1")
FULL = OutputSpec(dim=48, dtype="float16")


def _recipe(chunk: Chunk, spec: OutputSpec = FULL, *, renormalize: bool = True):
    return recipe_for(CARD, chunk, "q: ", spec, renormalize=renormalize, model_dim=48)


def test_a_plain_chunk_gets_the_models_own_recipe() -> None:
    recipe = _recipe(Chunk("a", "t"))
    assert (recipe.model, recipe.revision, recipe.representation) == ("tiny", "r1", "dense")
    assert (recipe.prompt, recipe.dimensions, recipe.dtype) == ("q: ", 48, "float16")
    assert recipe.normalize and not recipe.renormalize  # the whole vector: nothing to renormalise


def test_a_truncated_vector_is_renormalised_only_where_the_worker_renormalises() -> None:
    cut = OutputSpec(dim=16, dtype="float32")
    assert _recipe(Chunk("a", "t"), cut).renormalize
    assert not _recipe(Chunk("a", "t"), cut, renormalize=False).renormalize


def test_each_option_that_changes_the_answer_is_in_the_recipe() -> None:
    heads = _recipe(Chunk("a", "t", representations=("sparse", "multivector")))
    assert heads.representation == "multivector+sparse:float16"
    int8 = _recipe(Chunk("a", "t", representations=("multivector",), multivector_dtype="int8"))
    assert int8.representation == "multivector:int8"
    assert _recipe(Chunk("a", "t", raw_scores=True)).representation == "dense:raw"
    assert _recipe(Chunk("a", "t", token_states=True)).representation == "dense+token_states"
    assert _recipe(Chunk("a", "t", window_overlap=8)).representation == "dense:windows:8"
    assert not _recipe(Chunk("a", "t", normalize=False)).normalize
    assert _recipe(Chunk("a", "t", normalize=True)).normalize


def test_recipes_key_a_chunk_as_its_recipe_does_and_keep_each_recipe_once() -> None:
    recipes = Recipes(CARD, renormalize=True, model_dim=48)
    chunk = Chunk("a", "some text")
    assert recipes.key(chunk, "q: ", FULL) == content_key("some text", _recipe(chunk))
    assert recipes.key(Chunk("b", "some text"), "q: ", FULL) == recipes.key(chunk, "q: ", FULL)
    assert recipes.key(chunk, "", FULL) != recipes.key(chunk, "q: ", FULL)
    states = Chunk("a", "some text", token_states=True)
    assert recipes.key(states, "q: ", FULL) != recipes.key(chunk, "q: ", FULL)
    assert len(recipes._held) == 3


def test_the_recipes_held_are_bounded() -> None:
    recipes = Recipes(CARD, renormalize=True, model_dim=48)
    for n in range(RECIPES_HELD + 1):
        recipes.key(Chunk("a", "t"), f"prompt {n}: ", FULL)
    assert len(recipes._held) == 1  # cleared at the bound, then this one kept
