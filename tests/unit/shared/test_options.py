"""shared/options.py, the options verifier: each rule raises its own error type (a
ProtocolError, so every door that catches that still works), and each rule's message is written
in one module of the source tree, the verifier's (issue 55)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from embedfleet.shared import options
from embedfleet.shared.dead_letters import DeadReason
from embedfleet.shared.modelcard import ModelCard
from embedfleet.shared.options import (
    DimensionsError,
    ForeignTokenIdsError,
    ModalityError,
    OptionError,
    PromptError,
    RepresentationError,
    TokenLimitError,
)
from embedfleet.shared.protocol import FULL_DIMENSIONS, Chunk, ProtocolError
from tests.cards import tiny_card
from tests.paths import REPO_ROOT

CARD = tiny_card(tokenizer_fingerprint="tok-a")
SPARSE = ModelCard(
    name="splade", dim=30522, max_length=128, normalize=False, representations=("sparse",)
)
# the folders that install as the embedfleet package (pyproject.toml's package-dir)
SOURCE = ("embedfleet", "shared", "workers", "producer")


def _verify(**fields: object) -> Callable[[], object]:
    return lambda: options.verify(Chunk(id="a", text="t", **fields), CARD)  # type: ignore[arg-type]


def _worker(card: ModelCard, **fields: object) -> Callable[[], object]:
    chunk = Chunk(id="a", text="t", **fields)  # type: ignore[arg-type]
    return lambda: options.check_representation(chunk, card.name, card.representations)


# (rule, what breaks it, its error type, the fixed part of its message)
RULES: list[tuple[str, Callable[[], object], type[OptionError], str]] = [
    ("dimensions at a door", _verify(dimensions=49), DimensionsError, "is more than the model"),
    (
        "dimensions in the worker",
        lambda: options.resolve_dimensions(49, 0, 48),
        DimensionsError,
        "is out of range for this model",
    ),
    (
        "EMBEDFLEET_DIMENSIONS",
        lambda: options.check_dimensions_setting(64, 48),
        DimensionsError,
        "dimensions; use 1..",
    ),
    ("prompt name at a door", _verify(prompt_name="nope"), PromptError, "pass a literal 'prompt'"),
    (
        "prompt name in the worker",
        lambda: options.resolve_prompt(CARD.named_prompts, None, "document", "nope", None, ""),
        PromptError,
        "is not one of the model's prompts",
    ),
    (
        "EMBEDFLEET_*_PROMPT_NAME",
        lambda: options.check_prompt_setting("query", "nope", CARD.named_prompts),
        PromptError,
        "_PROMPT_NAME=",
    ),
    (
        "a representation",
        _verify(representations=("sparse",)),
        RepresentationError,
        "serves dense, not sparse",
    ),
    (
        "token states at a door",
        lambda: options.verify(Chunk(id="a", text="t", token_states=True), SPARSE),
        RepresentationError,
        "a dense pipeline's token states",
    ),
    (
        "dense options on another model",
        _worker(SPARSE, dimensions=8),
        RepresentationError,
        "shape dense vectors",
    ),
    (
        "max_active_dims",
        _worker(CARD, max_active_dims=3),
        RepresentationError,
        "prunes sparse weights",
    ),
    (
        "raw_scores",
        _worker(CARD, raw_scores=True),
        RepresentationError,
        "answers a cross-encoder's logits",
    ),
    (
        "multivector_dtype",
        _worker(CARD, multivector_dtype="int8"),
        RepresentationError,
        "shapes per-token vectors",
    ),
    (
        "token states in the worker",
        _worker(SPARSE, token_states=True),
        RepresentationError,
        "answers the token states of a model",
    ),
    (
        "window_overlap",
        _worker(CARD, window_overlap=8, token_states=True),
        RepresentationError,
        "embeds a long input whole as one dense vector",
    ),
    (
        "token states on a packing lane",
        options.refuse_packed_token_states,
        RepresentationError,
        "are computed on padded batches",
    ),
    (
        "an input over the model's tokens",
        lambda: options.check_token_limit([3, 130, 130], 128),
        TokenLimitError,
        "over the model's maximum of",
    ),
    (
        "a prompt that fills the model",
        lambda: options.text_budget(8, 2, 6),
        TokenLimitError,
        "the prompt alone fills the model",
    ),
    (
        "an image for a text model",
        lambda: options.verify(Chunk(id="a", image=b"\x89PNG"), CARD),
        ModalityError,
        "only, not image input",
    ),
    (
        "a text for an image-only model",
        lambda: options.check_modality(False, ("image",)),
        ModalityError,
        "only, not text input",
    ),
]


@pytest.mark.parametrize(("rule", "breaks", "error", "fragment"), RULES, ids=[r[0] for r in RULES])
def test_each_rule_raises_its_own_error(
    rule: str, breaks: Callable[[], object], error: type[OptionError], fragment: str
) -> None:
    with pytest.raises(error) as raised:
        breaks()
    assert isinstance(raised.value, ProtocolError), "a door that catches ProtocolError still works"
    assert fragment in str(raised.value)


# where a message is made of its parts, what its source says in place of what it shows
WRITTEN = {
    "serves dense, not sparse": "}, not {wanted}",
    "only, not image input": "only, not {wanted} input",
    "only, not text input": "only, not {wanted} input",
}


def _modules_saying(fragment: str, root: Path = REPO_ROOT) -> list[str]:
    """The source modules (under SOURCE's folders of ``root``) whose text holds ``fragment``."""
    found = []
    for folder in SOURCE:
        for path in sorted((root / folder).rglob("*.py")):
            if fragment in path.read_text():
                found.append(path.relative_to(root).as_posix())
    return found


@pytest.mark.parametrize(("rule", "breaks", "error", "fragment"), RULES, ids=[r[0] for r in RULES])
def test_each_rule_has_one_owner_module(
    rule: str, breaks: Callable[[], object], error: type[OptionError], fragment: str
) -> None:
    assert _modules_saying(WRITTEN.get(fragment, fragment)) == ["shared/options.py"], (
        f"the message of {rule!r} ({fragment!r}) is written outside the verifier"
    )


def test_the_owner_search_finds_a_message_written_twice(tmp_path: Path) -> None:
    for module in ("shared/options.py", "workers/output.py", "producer/notes.txt"):
        (tmp_path / module).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / module).write_text('raise E("is out of range for this model")\n')
    assert _modules_saying("is out of range for this model", tmp_path) == [
        "shared/options.py",
        "workers/output.py",
    ]


def test_dimensions_within_the_model_pass_and_full_is_the_whole_vector() -> None:
    options.check_dimensions(48, CARD)
    options.verify(Chunk(id="a", text="t", dimensions=FULL_DIMENSIONS), CARD)
    assert options.resolve_dimensions(FULL_DIMENSIONS, 16, 48) == 48
    assert options.resolve_dimensions(None, 16, 48) == 16  # EMBEDFLEET_DIMENSIONS
    assert options.resolve_dimensions(None, 0, 48) == 48  # 0: all
    assert options.resolve_dimensions(8, 16, 48) == 8  # the chunk's own wins
    options.check_dimensions_setting(0, 48)


def test_prompts_resolve_as_sentence_transformers_chooses_them() -> None:
    prompts = CARD.named_prompts
    assert options.prompt_text(prompts, "query") == "q: "
    assert options.prompt_text(prompts, "document") == ""  # declared for every model
    # a literal prompt wins; else the name; else the setting; else the role's own name
    assert options.resolve_prompt(prompts, None, "query", "nope", "lit", "") == "lit"
    assert options.resolve_prompt(prompts, None, "document", "query", None, "") == "q: "
    assert options.resolve_prompt(prompts, None, "document", None, None, "passage") == "p: "
    assert options.resolve_prompt(prompts, None, "query", None, None, "") == "q: "
    assert options.resolve_prompt({"passage": "p: "}, None, "document", None, None, "") == "p: "
    assert options.resolve_prompt({"x": "x: "}, "x", "document", None, None, "") == "x: "
    assert options.resolve_prompt({}, None, "document", None, None, "") == ""
    options.check_prompt_setting("query", "", prompts)  # unset


def test_token_limit_names_the_first_longest_input() -> None:
    options.check_token_limit([128, 12], 128)
    options.check_token_limit([], 128)
    with pytest.raises(TokenLimitError) as raised:
        options.check_token_limit([3, 130, 130], 128)
    assert (raised.value.index, raised.value.tokens, raised.value.limit) == (1, 130, 128)
    assert raised.value.code is DeadReason.TOO_LONG
    assert options.text_budget(128, 2, 5) == 121


def test_a_door_refuses_token_ids_of_another_tokenizer() -> None:
    options.verify(Chunk(id="a", text="t", token_ids=b"\0\0\0\0", tokenizer="tok-a"), CARD)
    chunk = Chunk(id="a", text="t", token_ids=b"\0\0\0\0", tokenizer="tok-b")
    with pytest.raises(ForeignTokenIdsError, match="token ids made by another tokenizer") as raised:
        options.verify(chunk, CARD)
    assert raised.value.code is DeadReason.TOKENIZER


def test_the_errors_file_under_their_dead_letter_reason() -> None:
    with pytest.raises(OptionError) as raised:
        options.verify(Chunk(id="a", text="t", dimensions=49), CARD)
    assert raised.value.code is DeadReason.OPTIONS
    assert str(raised.value).startswith("chunk 'a': ")


def test_a_dual_encoder_takes_both_modalities() -> None:
    clip = ModelCard(
        name="clip", dim=16, max_length=32, normalize=False, modalities=("text", "image")
    )
    options.verify(Chunk(id="a", image=b"\x89PNG"), clip)
    options.verify(Chunk(id="a", text="a red bicycle"), clip)
    with pytest.raises(ModalityError, match="'a': this model embeds text only, not image"):
        options.verify(Chunk(id="a", image=b"\x89PNG"), CARD)


def test_what_a_model_gives_passes() -> None:
    options.require_representation(CARD, "dense")
    options.check_representation(Chunk(id="a", text="t", window_overlap=8), CARD.name, ("dense",))
    options.check_representation(
        Chunk(id="a", text="t", max_active_dims=3), SPARSE.name, SPARSE.representations
    )
    with pytest.raises(RepresentationError, match="'splade' serves sparse, not dense"):
        options.require_representation(SPARSE, "dense")
