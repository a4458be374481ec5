"""A RAG-like benchmark corpus built from text that ships with Python.

Retrieval corpora are skewed: most chunks are a sentence or a short paragraph (median around
46 tokens for this model) and a long tail of full chunks runs to the model's 256-token limit
and past it. That skew is what makes padding expensive, so the benchmark needs it; a corpus
of equal-length texts would hide the difference between the contenders.

Source text: ``pydoc_data.topics`` (the text ``help()`` shows) and the docstrings of the
standard library's own modules, read with ``ast`` (nothing is imported or executed). Both ship
with every CPython, so the corpus needs no download; it depends only on the Python version and
the seed. Token lengths are drawn from a fixed distribution and each text is cut from the
source at a word boundary to exactly that many tokens, so the length distribution does not
depend on how the source happens to be split into paragraphs.

    python -m loadtest.corpus --texts 2000 --out corpus.jsonl   # JSON Lines for `enqueue`

:class:`FreshCorpora` makes many such corpora whose texts never repeat, one per round and
contender of ``loadtest.bench``: the fleet's vector cache answers a text it has embedded before,
so a benchmark that repeats its texts measures the cache, not the model (issue 43).
"""

from __future__ import annotations

import ast
import bisect
import json
import random
import re
import statistics
import sys
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import click
from tokenizers import Tokenizer

from embedfleet.shared.settings import PACKAGED_MODEL

# The length distribution, in tokens including [CLS] and [SEP]. A log-normal body (median
# ~44, the sentence/short-paragraph chunks) plus a 6% tail of long chunks spread evenly
# between 128 and 400 tokens, of which about half pass the model's 256 and get truncated.
BODY_MEDIAN_TOKENS = 44
BODY_SIGMA = 0.55
TAIL_FRACTION = 0.06
TAIL_RANGE = (128, 400)
MIN_TOKENS = 6
SPECIAL_TOKENS = 2  # [CLS] ... [SEP]


@dataclass(frozen=True)
class CorpusText:
    id: str
    text: str
    source: str


def source_documents() -> list[tuple[str, str]]:
    """(name, text) pairs: pydoc topics, then stdlib module docstrings, in a fixed order."""
    from pydoc_data.topics import topics

    documents = [(f"topic:{name}", " ".join(text.split())) for name, text in sorted(topics.items())]
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(stdlib.glob("*.py")):
        try:
            tree = ast.parse(path.read_text(encoding="utf-8", errors="replace"))
        except (SyntaxError, ValueError):
            continue
        pieces = []
        for node in ast.walk(tree):
            if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                docstring = ast.get_docstring(node)
                if docstring and len(docstring) > 40:
                    pieces.append(" ".join(docstring.split()))
        if pieces:
            documents.append((f"stdlib:{path.stem}", " ".join(pieces)))
    return [(name, text) for name, text in documents if text]


def target_lengths(count: int, seed: int) -> list[int]:
    """Token lengths (with special tokens) drawn from the skewed RAG-like distribution."""
    rng = random.Random(seed)
    lengths = []
    for _ in range(count):
        if rng.random() < TAIL_FRACTION:
            length = rng.randint(*TAIL_RANGE)
        else:
            length = round(rng.lognormvariate(0.0, BODY_SIGMA) * BODY_MEDIAN_TOKENS)
        lengths.append(max(MIN_TOKENS, length))
    return lengths


def load_tokenizer(model: str = PACKAGED_MODEL) -> Tokenizer:
    from embedfleet.workers.model.encoder import resolve_model_path

    tokenizer = Tokenizer.from_file(str(resolve_model_path(model) / "tokenizer.json"))
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return tokenizer


def build_corpus(
    count: int, *, seed: int = 0, tokenizer: Tokenizer | None = None
) -> list[CorpusText]:
    """``count`` texts whose token lengths follow :func:`target_lengths`.

    Texts are cut one after another from a seeded shuffle of the source documents, each at
    word boundaries, so neighbouring texts are unrelated and every word is real text.
    """
    documents = source_documents()
    random.Random(seed).shuffle(documents)
    stream = _TokenStream(documents, tokenizer or load_tokenizer())
    texts = []
    for number, length in enumerate(target_lengths(count, seed)):
        name, text = stream.take(length - SPECIAL_TOKENS)
        texts.append(CorpusText(id=f"bench-{number:06d}", text=text, source=name))
    return texts


class _TokenStream:
    """Cuts consecutive pieces of N tokens from the documents, cycling when they run out."""

    def __init__(self, documents: list[tuple[str, str]], tokenizer: Tokenizer) -> None:
        self._documents = documents
        self._tokenizer = tokenizer
        self._next_document = 0
        self._open(0)

    def _open(self, index: int) -> None:
        # Encoded lazily, one document at a time: a corpus of a few thousand texts uses a
        # small part of the source.
        self._name, self._text = self._documents[index % len(self._documents)]
        encoding = self._tokenizer.encode(self._text, add_special_tokens=False)
        self._words, self._offsets = encoding.word_ids, encoding.offsets
        self._start = 0
        self._next_document = index + 1

    def take(self, tokens: int) -> tuple[str, str]:
        while True:
            end = min(self._start + tokens, len(self._words))
            # Extend to the end of the word so no word is cut in half (a few tokens more on a
            # word split into pieces; the measured lengths report it).
            while end < len(self._words) and self._words[end] == self._words[end - 1]:
                end += 1
            if end - self._start >= min(tokens, MIN_TOKENS) and end - self._start >= tokens // 2:
                text = self._text[self._offsets[self._start][0] : self._offsets[end - 1][1]]
                self._start = end
                return self._name, text
            # A document's leftover scrap: move on rather than emit a stub.
            self._open(self._next_document)


class FreshCorpora:
    """Corpora of one length list whose texts are all new: ``corpus(key)`` for each round and
    contender of a benchmark, so no contender (and no cache) ever sees a text twice.

    Every corpus has the token lengths of :func:`target_lengths` (``count``, ``seed``), text for
    text and exactly (special tokens included, before truncation), so every contender embeds the
    same amount of work. Each text is a window of the source at a random word-aligned start,
    drawn by a generator seeded with (``seed``, key); a window that is not exactly its length
    once tokenized alone, or whose text this object has handed out before (in any corpus), is
    drawn again. The source holds about 350,000 tokens, so the windows of different corpora may
    overlap, but no two texts are equal: the vector cache keys on the whole text.
    """

    MAX_DRAWS_PER_TEXT = 1000  # past this the source is too small for the lengths asked

    def __init__(
        self,
        count: int,
        *,
        seed: int = 0,
        tokenizer: Tokenizer | None = None,
        documents: Sequence[tuple[str, str]] | None = None,
    ) -> None:
        self.seed = seed
        self.lengths = tuple(target_lengths(count, seed))
        self._tokenizer = tokenizer or load_tokenizer()
        self._seen: set[str] = set()
        self._documents: list[_Windows] = []
        named = list(source_documents() if documents is None else documents)
        encodings = self._tokenizer.encode_batch(
            [text for _, text in named], add_special_tokens=False
        )
        for (name, text), encoding in zip(named, encodings, strict=True):
            if len(encoding.ids) >= MIN_TOKENS:
                self._documents.append(_Windows(name, text, encoding.word_ids, encoding.offsets))
        # documents drawn in proportion to their tokens: every token equally likely to start
        self._cumulative: list[int] = []
        total = 0
        for document in self._documents:
            total += document.tokens
            self._cumulative.append(total)

    def corpus(self, key: str, count: int | None = None) -> list[CorpusText]:
        """The first ``count`` (default: all) of :attr:`lengths`, as texts new to this object.
        The same key on a fresh object gives the same texts; ids are ``<key>-<number>``."""
        lengths = self.lengths[: len(self.lengths) if count is None else count]
        rng = random.Random(f"{self.seed}/{key}")  # a str seeds the same way in every process
        chosen: list[tuple[str, str] | None] = [None] * len(lengths)
        draws = 0
        while missing := [i for i, item in enumerate(chosen) if item is None]:
            draws += 1
            if draws > self.MAX_DRAWS_PER_TEXT:
                raise ValueError(
                    f"the source has too few new windows of {lengths[missing[0]]} tokens left "
                    f"after {len(self._seen)} texts"
                )
            candidates = {i: self._draw(rng, lengths[i] - SPECIAL_TOKENS) for i in missing}
            texts = [text for _, text in candidates.values()]
            # a window's tokens alone can differ from its tokens in the document (a cut that
            # splits what the tokenizer joins): measured, not assumed
            measured = token_lengths(texts, self._tokenizer)
            for (i, (name, text)), tokens in zip(candidates.items(), measured, strict=True):
                if text and tokens == lengths[i] and text not in self._seen:
                    self._seen.add(text)
                    chosen[i] = (name, text)
        slug = re.sub(r"[^A-Za-z0-9]+", "-", key).strip("-") or "corpus"
        return [
            CorpusText(id=f"{slug}-{number:06d}", text=text, source=name)
            for number, (name, text) in enumerate(item for item in chosen if item is not None)
        ]

    def _draw(self, rng: random.Random, tokens: int) -> tuple[str, str]:
        """A window of ``tokens`` tokens starting and ending on word boundaries ("" where the
        draw missed: the caller draws again)."""
        spot = rng.randrange(self._cumulative[-1])
        document = self._documents[bisect.bisect_right(self._cumulative, spot)]
        return document.name, document.window(rng, tokens)


@dataclass(frozen=True)
class _Windows:
    """One source document, tokenized once, for :class:`FreshCorpora`'s random windows."""

    name: str
    text: str
    words: list[int | None]
    offsets: list[tuple[int, int]]

    @property
    def tokens(self) -> int:
        return len(self.words)

    def window(self, rng: random.Random, tokens: int) -> str:
        """``tokens`` tokens from a random start, or "" where that start or its end falls inside
        a word, the start is punctuation (a chunk starts on a word), or the document is too
        short."""
        if tokens > self.tokens:
            return ""
        start = rng.randrange(self.tokens - tokens + 1)
        end = start + tokens
        first = self.offsets[start][0]
        if not (self._boundary(start) and self._boundary(end) and self.text[first].isalnum()):
            return ""
        return self.text[first : self.offsets[end - 1][1]]

    def _boundary(self, index: int) -> bool:
        """A word starts at token ``index`` (or the document ends there)."""
        if index in (0, len(self.words)):
            return True
        return self.words[index] != self.words[index - 1]


def token_lengths(texts: list[str], tokenizer: Tokenizer | None = None) -> list[int]:
    """Token counts with special tokens, before the model's truncation."""
    tokenizer = tokenizer or load_tokenizer()
    return [len(encoding.ids) for encoding in tokenizer.encode_batch(texts)]


def describe(lengths: list[int], max_length: int = 256) -> dict[str, float]:
    ordered = sorted(lengths)
    return {
        "texts": len(ordered),
        "median_tokens": statistics.median(ordered),
        "mean_tokens": statistics.fmean(ordered),
        "p90_tokens": ordered[int(0.9 * (len(ordered) - 1))],
        "p99_tokens": ordered[int(0.99 * (len(ordered) - 1))],
        "max_tokens": ordered[-1],
        "over_max_fraction": sum(length > max_length for length in ordered) / len(ordered),
    }


@click.command()
@click.option("--texts", type=int, default=2000, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None)
def main(texts: int, seed: int, out: Path | None) -> None:
    """Write the corpus as JSON Lines ({id, text, meta}) and print its length distribution."""
    tokenizer = load_tokenizer()
    corpus = build_corpus(texts, seed=seed, tokenizer=tokenizer)
    if out is not None:
        with out.open("w", encoding="utf-8") as handle:
            for item in corpus:
                line = {"id": item.id, "text": item.text, "meta": {"source": item.source}}
                handle.write(json.dumps(line) + "\n")
    summary = describe(token_lengths([item.text for item in corpus], tokenizer))
    json.dump(summary, sys.stderr, indent=2)
    sys.stderr.write("\n")


if __name__ == "__main__":
    main()
