"""loadtest/tokenizer_rates.py: its identity check and its Unicode fuzz. ``encode_batch_fast``
and the ASCII path (shared/ascii_path.py), the candidates that give the model tokenizer's ids
on everything, give exactly the worker's ``encode_batch`` ids, cut at max_length + 1 with
[CLS] and [SEP] kept, on corpus texts and on the whole fuzz; the fuzz holds every category it
names; a candidate that differs is caught. No rate is asserted (fast tier: no server, no worker
process; the packaged model's tokenizer, loaded as the benchmark stand-in encoder loads it)."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from loadtest.corpus import build_corpus, load_tokenizer
from loadtest.tokenizer_rates import (
    FUZZ_CATEGORIES,
    Encode,
    WorkerTokenizer,
    fuzz_texts,
    identity,
    in_windows,
    worker_tokenizer,
)

CORPUS_TEXTS = 200
PER_CATEGORY = 100
# what the fuzz must cover (the categories the identity claim is made on)
REQUIRED = {
    "accents_combining",
    "cjk",
    "emoji_zwj",
    "control_chars",
    "nul",
    "tabs_newlines",
    "long_word_100_to_400",
    "long_word_over_1000",
    "mixed_scripts",
    "arabic_hebrew",
    "thai",
    "fullwidth",
    "unusual_whitespace",
    "random_code_points",
    "special_token_literals",
}


@pytest.fixture(scope="module")
def tokenizer() -> WorkerTokenizer:
    return worker_tokenizer()


@pytest.fixture(scope="module")
def fuzz() -> list[tuple[str, str]]:
    return fuzz_texts(PER_CATEGORY)


def _reference(tokenizer: WorkerTokenizer, texts: list[str]) -> list[list[int]]:
    return in_windows(lambda batch: [e.ids for e in tokenizer.backend.encode_batch(batch)], texts)


def _fast(tokenizer: WorkerTokenizer) -> Encode:
    return lambda batch: [e.ids for e in tokenizer.backend.encode_batch_fast(batch)]


def _ascii_path(tokenizer: WorkerTokenizer) -> Encode:
    path = tokenizer.text.ascii_path
    assert path is not None  # the packaged model's BERT normalizer is one it models
    return path.encode


@pytest.mark.parametrize("candidate", [_fast, _ascii_path], ids=["encode_batch_fast", "ASCII path"])
def test_a_candidate_gives_the_worker_ids_on_corpus_and_fuzz(
    tokenizer: WorkerTokenizer,
    fuzz: list[tuple[str, str]],
    candidate: Callable[[WorkerTokenizer], Encode],
) -> None:
    corpus = build_corpus(CORPUS_TEXTS, tokenizer=load_tokenizer())
    texts = tokenizer.prepare([item.text for item in corpus])
    fuzzed = tokenizer.prepare([text for _, text in fuzz])
    reference, fuzz_reference = _reference(tokenizer, texts), _reference(tokenizer, fuzzed)
    # the cut is exercised: texts past the maximum end [SEP] at max_length + 1
    longest = max(fuzz_reference, key=len)
    assert len(longest) == tokenizer.max_length + 1 and longest[-1] == reference[0][-1]

    on_corpus = identity(candidate(tokenizer), texts, reference)
    on_fuzz = identity(
        candidate(tokenizer),
        fuzzed,
        fuzz_reference,
        [category for category, _ in fuzz],
    )
    assert (on_corpus.texts, on_corpus.mismatches) == (CORPUS_TEXTS, 0), on_corpus.examples
    assert (on_fuzz.texts, on_fuzz.mismatches) == (len(fuzz), 0), on_fuzz.examples


def test_a_candidate_that_differs_is_caught(tokenizer: WorkerTokenizer) -> None:
    texts = tokenizer.prepare(["hello world", "naïve café", "[SEP] x", "a b c"])
    reference = _reference(tokenizer, texts)

    def drops_a_token(batch: list[str]) -> list[list[int]]:
        return [
            ids if "a" not in text else ids[:-1]
            for text, ids in zip(batch, _reference(tokenizer, batch), strict=True)
        ]

    def raises(batch: list[str]) -> list[list[int]]:
        raise RuntimeError("boom")

    found = identity(drops_a_token, texts, reference)
    assert (found.mismatches, len(found.examples)) == (2, 2)
    assert found.examples[0]["lengths"] == [len(reference[1]), len(reference[1]) - 1]
    failed = identity(raises, texts, reference)
    assert failed.mismatches == len(texts) and "RuntimeError" in failed.examples[0]["error"]


def test_the_fuzz_covers_each_category(fuzz: list[tuple[str, str]]) -> None:
    assert set(FUZZ_CATEGORIES) >= REQUIRED
    by_category: dict[str, list[str]] = {}
    for category, text in fuzz:
        by_category.setdefault(category, []).append(text)
    for category, (_, holds) in FUZZ_CATEGORIES.items():
        texts = by_category[category]
        assert len(texts) == PER_CATEGORY
        assert all(holds(text) for text in texts), category
    everything = "".join(text for _, text in fuzz)
    for char in ("\u00a0", "\u3000", "\u200b", "\u200d", "\x00", "\t", "\n", "\u0301"):
        assert char in everything, ascii(char)
    words = [len(word) for _, text in fuzz for word in text.split()]
    assert any(100 < length <= 1000 for length in words) and max(words) > 1000
    assert any(ord(char) > 0xFFFF for char in everything)  # astral: emoji, CJK ext. B, random
    assert "" in by_category["edge"]
    assert fuzz_texts(PER_CATEGORY) == fuzz  # seeded: the same texts every run
