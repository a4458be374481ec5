"""shared/ascii_path.py: ASCII texts tokenized without the normalizer give the configured
tokenizer's ids, text for text: the packaged model's (BERT, lower-casing), a cased variant and
the ``do_lower_case`` sequence the worker builds; the texts that must go the configured way (a
special token's literal in any case, control characters, anything not ASCII) do; a normalizer
it does not model gets no fast path. Fast tier: the packaged model's tokenizer, no server."""

from __future__ import annotations

import json
import random
from typing import Any

import pytest
from tokenizers import Tokenizer

from embedfleet.shared.ascii_path import MAX_ADDED_TOKENS, AsciiPath, ascii_lowercases
from embedfleet.shared.tokens import encode_for_model
from embedfleet.workers.model.standin import StandInEncoder

SEED = 20261208
# texts the copy must tokenize as the configured tokenizer does
PLAIN = [
    "Hello World",
    "UPPER lower MiXeD case",
    "tab\there\r\nnew line\rreturn",
    "don't stop-believing (ok?) {x}",
    "a" * 150 + " long word",
    "",
    "   ",
    "McDonald's iPhone 3.14 e=mc^2 #hash @user ~tilde `code`",
    "x [not special] <mask> [ CLS ]",
]
# texts that must go the configured way, and why
WHY_CONFIGURED = {
    "[CLS] the special token's literal": "a special token matches before normalizing",
    "x[SEP]y": "the same, glued to words",
    "a [Mask] in another case": "any case of a literal is taken as one",
    "[cls] and [Sep]: the same ids either way": "lower case too: the check ignores case",
    "vertical\x0btab": "a control character the clean-up removes",
    "nul\x00byte": "NUL, removed",
    "delete\x7fchar": "DEL, removed",
    "café": "not ASCII: accents are stripped",
    "naïve CJK 中文": "not ASCII: CJK characters are spaced out",
    "\ufffd replacement": "not ASCII: U+FFFD is removed",
}
CONFIGURED_WAY = list(WHY_CONFIGURED)


@pytest.fixture(scope="module")
def backend() -> Any:
    return StandInEncoder().text.backend


def _variant(backend: Any, normalizer: dict[str, Any] | None) -> Any:
    config = json.loads(backend.to_str())
    config["normalizer"] = normalizer
    return Tokenizer.from_str(json.dumps(config))


def _reference(tokenizer: Any, texts: list[str]) -> list[list[int]]:
    return [encoding.ids for encoding in tokenizer.encode_batch_fast(texts)]


def _ascii_fuzz(count: int) -> list[str]:
    rng = random.Random(SEED)
    pieces = [chr(c) for c in range(128)] + ["[CLS]", "[sep]", "[Mask]", "WORD", "Word", " "]
    return ["".join(rng.choice(pieces) for _ in range(rng.randint(1, 24))) for _ in range(count)]


def test_the_packaged_tokenizer_lowercases_and_its_copy_gives_the_same_ids(backend: Any) -> None:
    path = AsciiPath.of(backend)
    assert path is not None and path.lowercase and path.bare.normalizer is None
    assert [path.takes(text) for text in PLAIN] == [True] * len(PLAIN)
    assert [path.takes(text) for text in CONFIGURED_WAY] == [False] * len(CONFIGURED_WAY)
    texts = PLAIN + CONFIGURED_WAY + _ascii_fuzz(3000)
    assert path.encode(texts) == _reference(backend, texts)
    # the configured tokenizer is left as it was: its normalizer and its published form
    assert json.loads(backend.to_str())["normalizer"]["type"] == "BertNormalizer"


def test_the_copy_alone_would_differ_where_the_configured_way_is_taken(backend: Any) -> None:
    """The fall-backs are needed: the bare copy on lower-cased text gets these wrong."""
    path = AsciiPath.of(backend)
    assert path is not None
    wrong = [
        text
        for text in CONFIGURED_WAY
        if path.bare.encode(text.lower()).ids != backend.encode(text).ids
    ]
    assert {"[CLS] the special token's literal", "vertical\x0btab", "café"} <= set(wrong)


def test_order_is_kept_when_the_two_ways_are_mixed(backend: Any) -> None:
    path = AsciiPath.of(backend)
    assert path is not None
    texts = [text for pair in zip(PLAIN, CONFIGURED_WAY, strict=False) for text in pair]
    assert path.encode(texts) == _reference(backend, texts)
    assert path.encode(CONFIGURED_WAY) == _reference(backend, CONFIGURED_WAY)
    assert path.encode([]) == []


def test_encode_for_model_gives_the_same_ids_with_and_without_the_path(backend: Any) -> None:
    """Long texts included: the counting head's cut, the tokenizer's at max_length + 1, and
    a text so sparse in tokens that the head lost some (tokenized whole)."""
    max_length = 256
    path = AsciiPath.of(backend)
    texts = [
        *PLAIN,
        *CONFIGURED_WAY,
        "word " * 2000,
        "Long " * 400 + "[CLS]",
        " " * 20000 + "sparse Tail",
    ]
    with_path = encode_for_model(backend, texts, max_length, path)
    assert with_path == encode_for_model(backend, texts, max_length)
    other = Tokenizer.from_str(backend.to_str())
    with pytest.raises(ValueError, match="another tokenizer"):
        encode_for_model(other, texts, max_length, path)
    assert len(with_path[-3]) == max_length + 1 and with_path[-1][1:-1]  # the tail was found


@pytest.mark.parametrize(
    ("normalizer", "lowercase"),
    [
        (
            {
                "type": "BertNormalizer",
                "clean_text": True,
                "handle_chinese_chars": True,
                "strip_accents": False,
                "lowercase": False,
            },
            False,
        ),
        (
            {
                "type": "Sequence",
                "normalizers": [
                    {"type": "Lowercase"},
                    {
                        "type": "BertNormalizer",
                        "clean_text": True,
                        "handle_chinese_chars": True,
                        "strip_accents": None,
                        "lowercase": False,
                    },
                ],
            },
            True,
        ),
        ({"type": "Sequence", "normalizers": [{"type": "NFKC"}, {"type": "StripAccents"}]}, False),
    ],
    ids=["cased BERT", "do_lower_case sequence", "NFKC and accent strip"],
)
def test_other_normalizers_it_models(
    backend: Any, normalizer: dict[str, Any], lowercase: bool
) -> None:
    variant = _variant(backend, normalizer)
    path = AsciiPath.of(variant)
    assert path is not None and path.lowercase is lowercase
    texts = PLAIN + CONFIGURED_WAY + _ascii_fuzz(1000)
    assert path.encode(texts) == _reference(variant, texts)


def test_a_normalizer_it_does_not_model_gets_no_fast_path(backend: Any) -> None:
    replace = {"type": "Replace", "pattern": {"String": "a"}, "content": "b"}
    assert ascii_lowercases(replace) is None
    assert ascii_lowercases({"type": "Sequence", "normalizers": [{"type": "NFC"}, replace]}) is None
    assert AsciiPath.of(_variant(backend, replace)) is None
    # no normalizer: nothing to skip, so no copy and no search
    assert ascii_lowercases(None) is False
    assert AsciiPath.of(_variant(backend, None)) is None


def test_a_tokenizer_with_many_added_tokens_gets_no_fast_path(backend: Any) -> None:
    many = Tokenizer.from_str(backend.to_str())
    many.add_tokens([f"<extra_{index}>" for index in range(MAX_ADDED_TOKENS)])
    assert AsciiPath.of(many) is None
    few = Tokenizer.from_str(backend.to_str())
    few.add_tokens(["<extra_0>"])
    path = AsciiPath.of(few)
    assert path is not None and not path.takes("an <EXTRA_0> in another case")
    texts = ["an <extra_0> here", "an <EXTRA_0> in another case", "plain"]
    assert path.encode(texts) == _reference(few, texts)
