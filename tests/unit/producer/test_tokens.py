"""Token counts as the worker sees them (producer/tokens.py), on the packaged model's
tokenizer: special tokens included, capped at the card's maximum."""

from __future__ import annotations

from pathlib import Path

import pytest

from embedfleet.producer.tokens import ModelTokenizer, load_tokenizer
from embedfleet.shared.model_path import resolve_model_path


@pytest.fixture(scope="module")
def tokenizer() -> ModelTokenizer:
    return ModelTokenizer(resolve_model_path("all-MiniLM-L6-v2"))


def test_lengths_count_special_tokens_and_usage_caps_them(tokenizer: ModelTokenizer) -> None:
    assert tokenizer.special_tokens == 2  # BERT's [CLS] ... [SEP]
    assert tokenizer.lengths(["hello world", ""], 256) == [4, 2]
    long_text = "word " * 100
    assert tokenizer.lengths([long_text], 256) == [102]
    assert tokenizer.usage(["hello world", long_text], 50) == 4 + 50


def test_prompt_tokens_and_decode(tokenizer: ModelTokenizer) -> None:
    assert tokenizer.prompt_tokens("") == 0
    assert tokenizer.prompt_tokens("query: ") == 2  # "query" and ":", no specials
    ids = tokenizer.tokenizer.encode("hello world").ids
    assert tokenizer.decode(ids) == "hello world"  # [CLS]/[SEP] dropped


def test_the_published_json_gives_the_same_tokenizer(tokenizer: ModelTokenizer) -> None:
    published = ModelTokenizer.from_json(tokenizer.tokenizer.to_str())
    assert published.lengths(["a b c"], 256) == tokenizer.lengths(["a b c"], 256)
    assert published.vocab_size == tokenizer.vocab_size == 30522


def test_a_directory_without_tokenizer_json_is_named(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"has no tokenizer\.json"):
        load_tokenizer(tmp_path)
    with pytest.raises(ValueError, match=r"a model directory or a tokenizer\.json"):
        load_tokenizer(None)
