"""loadtest/corpus.py's FreshCorpora, the texts of loadtest.bench (issue 43): every round and
contender gets texts of the same token lengths, text for text, and no text twice, so the vector
cache (on by default) never answers a benchmark's text from an earlier round or contender.

Pure logic (fast tier: no server, no model; the packaged model's tokenizer file only)."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer

from loadtest.corpus import (
    MIN_TOKENS,
    FreshCorpora,
    load_tokenizer,
    source_documents,
    target_lengths,
    token_lengths,
)

TEXTS = 300
KEYS = [f"round {r}/{name}" for r in (1, 2, 3) for name in ("fleet auto", "infinity torch bf16")]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer()


@pytest.fixture(scope="module")
def documents() -> list[tuple[str, str]]:
    return source_documents()


def test_rounds_and_contenders_get_disjoint_texts_of_the_same_lengths(
    tokenizer: Tokenizer, documents: list[tuple[str, str]]
) -> None:
    corpora = FreshCorpora(TEXTS, seed=3, tokenizer=tokenizer, documents=documents)
    assert list(corpora.lengths) == target_lengths(TEXTS, 3)  # the bench's distribution
    seen: set[str] = set()
    for key in [*KEYS, "warm-up/fleet auto"]:
        count = 64 if key.startswith("warm-up") else None
        texts = [item.text for item in corpora.corpus(key, count)]
        # exactly the lengths asked for, text for text, measured as the model tokenizes them
        assert token_lengths(texts, tokenizer) == list(corpora.lengths[: len(texts)])
        assert len(set(texts)) == len(texts), key
        assert not seen & set(texts), f"{key} repeats a text of an earlier corpus"
        seen |= set(texts)
    # the skew the benchmark needs: a long tail past the model's 256 tokens, truncated
    assert max(corpora.lengths) > 256 > min(corpora.lengths) >= MIN_TOKENS


def test_a_key_gives_the_same_texts_on_a_fresh_generator_and_ids_name_it(
    tokenizer: Tokenizer, documents: list[tuple[str, str]]
) -> None:
    def corpus(key: str) -> list[tuple[str, str]]:
        fresh = FreshCorpora(50, seed=1, tokenizer=tokenizer, documents=documents[:40])
        return [(item.id, item.text) for item in fresh.corpus(key)]

    first = corpus("round 1/fleet auto cache off")
    assert first == corpus("round 1/fleet auto cache off")
    assert first[0][0] == "round-1-fleet-auto-cache-off-000000"
    assert {text for _, text in first}.isdisjoint(text for _, text in corpus("round 2/x"))


def test_texts_start_on_a_word_and_cut_no_word(
    tokenizer: Tokenizer, documents: list[tuple[str, str]]
) -> None:
    source = dict(documents)
    fresh = FreshCorpora(200, seed=0, tokenizer=tokenizer, documents=documents)
    for item in fresh.corpus("any"):
        assert item.text[0].isalnum(), item.text
        assert any(
            cut_on_words(source[item.source], start, item.text)
            for start in occurrences(source[item.source], item.text)
        ), item.text


def occurrences(text: str, part: str) -> list[int]:
    found, start = [], text.find(part)
    while start >= 0:
        found.append(start)
        start = text.find(part, start + 1)
    return found


def cut_on_words(text: str, start: int, part: str) -> bool:
    """``part`` at ``start`` in ``text`` is glued to no letter or digit around it."""
    before, after = text[start - 1 : start], text[start + len(part) : start + len(part) + 1]
    return not (before.isalnum() and part[0].isalnum()) and not (
        after.isalnum() and part[-1].isalnum()
    )


def test_a_source_too_small_for_new_texts_is_an_error_not_a_repeat(
    tokenizer: Tokenizer,
) -> None:
    # 900 tokens in words of 1 and 2 tokens: a few hundred windows of any one length, which
    # run out within a few hundred corpora of 5 texts
    words = " ".join(f"word{n} and" for n in range(300))
    fresh = FreshCorpora(5, seed=0, tokenizer=tokenizer, documents=[("small", words)])
    fresh.MAX_DRAWS_PER_TEXT = 50
    drawn: set[str] = set()
    with pytest.raises(ValueError, match="too few new windows"):
        for round_number in range(1000):
            texts = [item.text for item in fresh.corpus(f"round {round_number}")]
            assert drawn.isdisjoint(texts)
            drawn |= set(texts)
    assert len(drawn) > 10 * 5  # it ran out after many corpora, not at once
