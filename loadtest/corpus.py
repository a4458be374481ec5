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
"""

from __future__ import annotations

import ast
import json
import random
import statistics
import sys
import sysconfig
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
