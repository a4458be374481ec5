"""Token ids made by the producer (producer/token_ids.py): only against the tokenizer the
model card names, the prompt the worker would join in front, and chunks that must stay text
left as they are."""

from __future__ import annotations

import pytest

from embedfleet.producer.token_ids import TokenIdMaker, TokenIdsUnavailableError
from embedfleet.producer.tokens import load_tokenizer
from embedfleet.shared.model_path import resolve_model_path
from embedfleet.shared.modelcard import ModelCard
from embedfleet.shared.protocol import Chunk
from embedfleet.shared.tokens import ids_fingerprint, tokenizer_fingerprint, unpack_token_ids


@pytest.fixture(scope="module")
def tokenizer_json() -> str:
    # as a worker publishes it: its configured tokenizer (no padding), not the file's
    return str(load_tokenizer(resolve_model_path("all-MiniLM-L6-v2")).to_str())


def _card(fingerprint: str) -> ModelCard:
    return ModelCard(
        name="mini",
        dim=384,
        max_length=256,
        normalize=True,
        tokenizer_fingerprint=fingerprint,
        prompts={"query": "query: "},
    )


def test_no_ids_without_the_cards_tokenizer(tokenizer_json: str) -> None:
    with pytest.raises(TokenIdsUnavailableError, match="takes no token ids from producers"):
        TokenIdMaker(_card(""), tokenizer_json, {})
    with pytest.raises(TokenIdsUnavailableError, match="workers of two versions"):
        TokenIdMaker(_card("sha256:other"), tokenizer_json, {})


def test_ids_carry_the_prompt_and_its_fingerprint(tokenizer_json: str) -> None:
    fingerprint = tokenizer_fingerprint(tokenizer_json)
    maker = TokenIdMaker(_card(fingerprint), tokenizer_json, {"query": "query"})
    plain, queried, own = maker.attach(
        [
            Chunk(id="a", text="hello world"),
            Chunk(id="b", text="hello world", prompt_name="query"),
            Chunk(id="c", text="x", window_overlap=8),
        ]
    )
    assert plain.token_ids is not None and queried.token_ids is not None
    plain_ids = unpack_token_ids(plain.token_ids)
    query_ids = unpack_token_ids(queried.token_ids)
    assert plain_ids == [101, 7592, 2088, 102]  # [CLS] hello world [SEP]
    assert query_ids[1:-1][-2:] == [7592, 2088] and len(query_ids) == 6  # "query: " before
    assert plain.tokenizer == ids_fingerprint(fingerprint, "")
    assert queried.tokenizer == ids_fingerprint(fingerprint, "query: ")
    assert own.token_ids is None  # a long input for windows goes as text
    assert maker.prompt_for(Chunk(id="q", text="t"), "query") == "query: "


def test_an_image_goes_without_ids(tokenizer_json: str) -> None:
    maker = TokenIdMaker(_card(tokenizer_fingerprint(tokenizer_json)), tokenizer_json, {})
    image, text = maker.attach([Chunk(id="i", image=b"\x89PNG"), Chunk(id="t", text="hi")])
    assert image.token_ids is None and image.tokenizer is None  # no text to tokenize
    assert text.token_ids is not None
