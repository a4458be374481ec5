"""How fast, on one thread, can a worker turn texts into the model's token ids, and which faster
ways give exactly the same ids: ``python -m loadtest.tokenizer_rates --texts 20000``.

The reference is what the worker does (workers/model/tokenizer.py, ``TextTokenizer.tokenize``):
the model's fast tokenizer (Hugging Face ``tokenizers``, as the worker configures it: the
packaged all-MiniLM-L6-v2's BERT WordPiece, lower-casing, cut at max_length + 1 with [CLS] and
[SEP] kept), ``encode_batch`` on the texts as ``counting_head`` cuts them, in windows of 1024.
The backend is the one the benchmark stand-in encoder loads (loadtest/host_pipeline.py's
``tokenizer_floor``), so it is the worker's own, with its normalizer and truncation.

Candidates, each timed from texts to lists of ids (what the worker reads; the rows "call only"
time the bare ``encode_batch`` call, as ``tokenizer_floor`` does):

- ``encode_batch``: the reference;
- ``encode_batch_fast``: the same tokenizer without offsets;
- the ASCII path (shared/ascii_path.py, what the worker and the producer use since stop 71): an
  ASCII text without control characters or special-token literals lower-cased by Python and
  encoded by a copy of the tokenizer without its normalizer, any other text as configured;
- a Python word cache in front of the model's own normalizer, pre-tokenizer and WordPiece model
  (:class:`WordCache`), once with an empty cache per pass and once warm;
- ``flash-tokenizer`` (PyPI, C++), loaded from the model's vocab.txt with do_lower_case, when
  ``--candidates-path`` names a folder it is installed in (``pip install --no-deps --target
  DIR flash-tokenizer``; never a project dependency).

Rates are texts per CPU second of the measuring thread (``time.thread_time``, the figure a
shared machine's load changes least), median over ``--rounds`` interleaved rounds, with
TOKENIZERS_PARALLELISM=false and OMP_NUM_THREADS=1; a candidate whose process CPU time runs past
its thread's (work on other threads) is flagged. Tokens/s is texts/s times the reference's
tokens per text.

Identity: every candidate's ids are compared with ``encode_batch``'s, text for text, on every
text of the corpus (loadtest/corpus.py) and on a seeded Unicode fuzz (:func:`fuzz_texts`: one
list of texts per category of :data:`FUZZ_CATEGORIES`); the table gives the mismatching texts
and the report a few examples.
"""

from __future__ import annotations

import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import json
import platform
import random
import re
import statistics
import sys
import time
import unicodedata
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click

WINDOW = 1024
FUZZ_SEED = 20261205
EXAMPLES = 5

Encode = Callable[[list[str]], list[list[int]]]


# --- the worker's tokenizer -------------------------------------------------------------------
@dataclass
class WorkerTokenizer:
    """The worker's configured tokenizer backend and what the candidates need from the model."""

    backend: Any  # tokenizers.Tokenizer, truncating at max_length + 1
    max_length: int
    vocab: Path
    text: Any  # the worker's TextTokenizer, whose tokenize() the reference stands for

    def prepare(self, texts: Sequence[str]) -> list[str]:
        """The texts as ``TextTokenizer.tokenize`` hands them to the tokenizer."""
        from embedfleet.shared.tokens import counting_head

        return [counting_head(text, self.max_length) for text in texts]


def worker_tokenizer() -> WorkerTokenizer:
    """The packaged model's tokenizer as the worker sets it up (the benchmark stand-in encoder:
    the real Encoder's tokenizer and maximum, no forward pass)."""
    from embedfleet.workers.model.standin import StandInEncoder

    encoder = StandInEncoder()
    vocab = encoder.spec.transformer_dir / "vocab.txt"
    return WorkerTokenizer(encoder.text.backend, encoder.max_length, vocab, encoder.text)


def worker_differences(
    tokenizer: WorkerTokenizer, texts: list[str], reference: list[list[int]]
) -> dict[str, int]:
    """Texts whose ids from the worker's own ``TextTokenizer.tokenize`` differ from the
    reference's (``encode_batch`` on the texts as ``counting_head`` cuts them) once the worker's
    cut to max_length keeps [SEP] ("differ"), and how many of those the worker does not
    re-encode whole ("unexplained", 0 if the reference is the worker's batch call): a text so
    sparse in tokens that its head holds no more than max_length of them is encoded again
    whole, with ``backend.encode``, outside the batch call the candidates would replace."""
    worker = [item.ids for item in tokenizer.text.tokenize(texts, None)]
    fitted = [tokenizer.text._fit(ids).ids for ids in reference]
    prepared = tokenizer.prepare(texts)
    differ = [k for k, (a, b) in enumerate(zip(worker, fitted, strict=True)) if a != b]
    reencoded = [
        k
        for k in differ
        if len(prepared[k]) < len(texts[k]) and len(reference[k]) <= tokenizer.max_length
    ]
    return {"differ": len(differ), "unexplained": len(differ) - len(reencoded)}


def in_windows(encode: Encode, texts: list[str], window: int = WINDOW) -> list[list[int]]:
    out: list[list[int]] = []
    for start in range(0, len(texts), window):
        out.extend(encode(texts[start : start + window]))
    return out


# --- candidates --------------------------------------------------------------------------------
class WordCache:
    """The model's tokenizer rebuilt in Python around a dict of word -> ids: its special tokens
    (matched on the raw text, as ``tokenizers`` matches added tokens that are not normalized),
    its normalizer and pre-tokenizer (Rust, called per text), a cache in front of its WordPiece
    model, its post-processor's leading and trailing special tokens, and its truncation (the
    words' ids cut to the room the special tokens leave)."""

    def __init__(self, backend: Any) -> None:
        truncation = backend.truncation
        if truncation is None or truncation.get("direction", "right") != "right":
            raise ValueError("WordCache reproduces a right truncation only")
        probe = backend.encode("a")
        mask = probe.special_tokens_mask
        first = mask.index(0)
        last = len(mask) - 1 - mask[::-1].index(0)
        self.lead, self.trail = list(probe.ids[:first]), list(probe.ids[last + 1 :])
        self.room = int(truncation["max_length"]) - len(self.lead) - len(self.trail)
        self.normalize = backend.normalizer.normalize_str
        self.pre_tokenize = backend.pre_tokenizer.pre_tokenize_str
        self.model = backend.model
        added = backend.get_added_tokens_decoder()
        for token in added.values():
            if token.normalized or token.lstrip or token.rstrip or token.single_word:
                raise ValueError(f"WordCache does not reproduce the added token {token!r}")
        self.added = {token.content: token_id for token_id, token in added.items()}
        contents = sorted(self.added, key=len, reverse=True)
        self.added_pattern = re.compile("|".join(re.escape(c) for c in contents))
        self.cache: dict[str, list[int]] = {}

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.encode(text) for text in texts]

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        if self.added_pattern.search(text) is None:
            self._words(text, ids)
        else:
            start = 0
            for match in self.added_pattern.finditer(text):
                self._words(text[start : match.start()], ids)
                ids.append(self.added[match.group()])
                start = match.end()
            self._words(text[start:], ids)
        return [*self.lead, *ids[: self.room], *self.trail]

    def _words(self, text: str, ids: list[int]) -> None:
        if not text:
            return
        cache, room = self.cache, self.room
        for word, _ in self.pre_tokenize(self.normalize(text)):
            got = cache.get(word)
            if got is None:
                got = cache[word] = [token.id for token in self.model.tokenize(word)]
            ids += got
            if len(ids) >= room:
                return


def flash_tokenizer(tokenizer: WorkerTokenizer) -> Encode:
    """flash-tokenizer (PyPI) on the model's vocab.txt, lower-casing, Chinese characters split
    (the model's tokenizer_config.json), cut at the worker's max_length + 1, one thread, no
    padding ("longest" pads nothing in ``batch_encode``)."""
    from flash_tokenizer._core import FlashBertTokenizer  # type: ignore[import-not-found]

    limit = tokenizer.max_length + 1
    flash = FlashBertTokenizer(str(tokenizer.vocab), True, limit, True)

    def encode(texts: list[str]) -> list[list[int]]:
        return flash.batch_encode(texts, "longest", limit, False)

    return encode


@dataclass
class Candidate:
    name: str
    encode: Encode
    # a fresh encode function per timed pass (a cold cache), else ``encode`` itself
    fresh: Callable[[], Encode] | None = None
    # another row's identity figures hold for this one (same ids, timed differently)
    same_ids_as: str | None = None


def candidates(tokenizer: WorkerTokenizer) -> tuple[list[Candidate], dict[str, str]]:
    """The candidates that load here, and why the others did not."""
    backend = tokenizer.backend
    found = [
        Candidate("encode_batch", lambda texts: [e.ids for e in backend.encode_batch(texts)]),
        Candidate(
            "encode_batch (call only)",
            lambda texts: backend.encode_batch(texts),
            same_ids_as="encode_batch",
        ),
        Candidate(
            "encode_batch_fast", lambda texts: [e.ids for e in backend.encode_batch_fast(texts)]
        ),
        Candidate(
            "encode_batch_fast (call only)",
            lambda texts: backend.encode_batch_fast(texts),
            same_ids_as="encode_batch_fast",
        ),
    ]
    ascii_path = tokenizer.text.ascii_path
    if ascii_path is not None:
        found.append(
            Candidate(
                "ASCII path (shared/ascii_path.py)",
                ascii_path.encode,
            )
        )
    missing: dict[str, str] = {}
    try:
        warm = WordCache(backend)
        found.append(
            Candidate(
                "Python word cache (cold)",
                warm.encode_batch,
                fresh=lambda: WordCache(backend).encode_batch,
            )
        )
        found.append(
            Candidate(
                "Python word cache (warm)",
                warm.encode_batch,
                same_ids_as="Python word cache (cold)",
            )
        )
    except ValueError as error:
        missing["Python word cache"] = str(error)
    try:
        found.append(Candidate("flash-tokenizer", flash_tokenizer(tokenizer)))
    except ImportError as error:
        missing["flash-tokenizer"] = f"not importable ({error}); see --candidates-path"
    return found, missing


# --- the Unicode fuzz --------------------------------------------------------------------------
WORDS = [
    "the",
    "of",
    "and",
    "embedding",
    "vector",
    "retrieval",
    "token",
    "model",
    "worker",
    "stream",
    "batch",
    "query",
    "document",
    "passage",
    "tokenizer",
    "unicode",
    "naïve",
    "café",
    "résumé",
    "coöperate",
    "über",
    "straße",
    "internationalization",
    "unbelievable",
    "hello",
    "world",
    "don't",
    "it's",
    "e-mail",
    "3.14",
    "1,000",
    "$5",
    "#hashtag",
    "@user",
    "http://x.org/a?b=c",
]
SPECIAL_LITERALS = ("[CLS]", "[SEP]", "[MASK]", "[PAD]", "[UNK]", "[cls]", "[Sep]", "[ CLS ]")
COMBINING = [chr(c) for c in range(0x0300, 0x0370)] + ["\u20dd", "\u1ab0", "\u0e31"]
PRECOMPOSED = "éèêëàáâäãåæçñöøœüÿßÉÀÇÑÖØÜİıǅǈǋẞĳŉſﬁﬂΆΈάέήίόύώ"
EMOJI = (
    "😀",
    "👍🏽",
    "👨‍👩‍👧‍👦",
    "🏳️‍🌈",
    "🧑🏿‍🚀",
    "👩‍❤️‍💋‍👨",
    "🇫🇷",
    "🇯🇵",
    "1️⃣",
    "#️⃣",
    "❤️",
    "☺︎",
    "🫠",
    "🏴‍☠️",
    "🐈‍⬛",
)
# C0 and C1 controls (no tab, newline, carriage return or NUL: categories of their own) and DEL
CONTROLS = [
    chr(c) for c in (*range(0x01, 0x09), 0x0B, 0x0C, *range(0x0E, 0x20), *range(0x7F, 0xA0))
]
# format characters and friends: bidi marks and embeddings, soft hyphen, BOM, replacement char
FORMATS = ("\u200e", "\u200f", "\u202a", "\u202e", "\u2066", "\u2069", "\u00ad", "\ufeff", "\ufffd")
TAB_NEWLINE = ("\t", "\n", "\r\n", "\r", "\v", "\f", "\t\t", "\n\n")
WHITESPACE = (
    "\u00a0",
    "\u3000",
    "\u200b",
    "\u2000",
    "\u2003",
    "\u2009",
    "\u200a",
    "\u2028",
    "\u2029",
    "\u202f",
    "\u205f",
    "\u1680",
    "\u0085",
    "\u180e",
    "\u2060",
)
ARABIC = "مرحبا بالعالم، هذا نصٌّ عربيٌّ مُشَكَّل ١٢٣ ٤٥٦ ﷺ ﻻ"
HEBREW = "שָׁלוֹם עוֹלָם זה טקסט בעברית ‏ויש בו ניקוד"
THAI = "สวัสดีชาวโลก ภาษาไทยไม่มีช่องว่างระหว่างคำ กรุงเทพมหานคร ๑๒๓"
MIXED = ("привет", "мир", "κόσμε", "Ελληνικά", "नमस्ते", "দুনিয়া", "გამარჯობა", "Հայերեն", "ᚠᚢᚦ")
ASCII_PIECES = (
    *[chr(c) for c in range(128)],
    *(word.upper() for word in ("The", "Vector", "API")),
    *("Retrieval", "McDonald's", "iPhone", " ", " ", " "),
    *SPECIAL_LITERALS,
    *("[Cls]", "[mask]", "[PAD ]", "[UNK]x", "x[SEP]"),
)
SYMBOLS = "∑∫√∞≠≤≥±×÷°€£¥₹₿©®™§¶†‡•…‰′″‹›«»„“”‘’‚–—―‐‑‒−─│┌┐└┘█░▒▓𝐀𝐁𝒜𝔄𝕬𝖆𝟘𝟙"


def _cjk(rng: random.Random) -> str:
    ranges = [(0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0x20000, 0x2A6DF), (0x3040, 0x30FF)]
    ranges += [(0xAC00, 0xD7A3), (0xF900, 0xFAFF), (0x3100, 0x312F)]
    low, high = rng.choice(ranges)
    return "".join(chr(rng.randint(low, high)) for _ in range(rng.randint(1, 12)))


def _random_code_point(rng: random.Random, astral: bool = False) -> str:
    while True:
        code = rng.randint(0x10000 if astral else 0, 0x10FFFF)
        if not 0xD800 <= code <= 0xDFFF:  # a lone surrogate is no text (no UTF-8 for it)
            return chr(code)


def _letters(rng: random.Random, length: int) -> str:
    alphabet = "abcdefghijklmnopqrstuvwxyzé"
    if rng.random() < 0.3:  # a real word repeated: WordPiece could split it if not too long
        word = rng.choice(["un", "believ", "able", "token", "ization", "ing"])
        return (word * (length // len(word) + 1))[:length]
    return "".join(rng.choice(alphabet) for _ in range(length))


def _accents(rng: random.Random) -> str:
    pieces = [rng.choice(PRECOMPOSED) for _ in range(rng.randint(1, 4))]
    base = rng.choice("aeiouncAEIOU")
    marks = "".join(rng.choice(COMBINING) for _ in range(rng.randint(1, 5)))
    return rng.choice(WORDS) + "".join(pieces) + base + marks + rng.choice(WORDS)


def _in_ranges(text: str, *ranges: tuple[int, int]) -> bool:
    return any(low <= ord(c) <= high for c in text for low, high in ranges)


def _scripts(text: str) -> set[str]:
    """The first word of the Unicode names of the letters of ``text`` (LATIN, CYRILLIC, CJK...)."""
    return {unicodedata.name(c, "?").split()[0] for c in text if c.isalpha()}


def _longest_word(text: str) -> int:
    return max((len(word) for word in text.split()), default=0)


# category -> (a fragment maker, a check that a text of the category holds what it should)
FUZZ_CATEGORIES: dict[str, tuple[Callable[[random.Random], str], Callable[[str], bool]]] = {
    "accents_combining": (
        _accents,
        lambda t: (
            any(unicodedata.category(c).startswith("M") for c in t)
            and any(c in PRECOMPOSED for c in t)
        ),
    ),
    "cjk": (
        _cjk,
        lambda t: _in_ranges(
            t,
            (0x3040, 0x30FF),
            (0x3400, 0x9FFF),
            (0xAC00, 0xD7A3),
            (0xF900, 0xFAFF),
            (0x3100, 0x312F),
            (0x20000, 0x2A6DF),
        ),
    ),
    "emoji_zwj": (
        lambda rng: rng.choice(EMOJI) + "\u200d" + rng.choice(EMOJI),
        lambda t: "\u200d" in t,
    ),
    "control_chars": (
        lambda rng: (
            rng.choice(WORDS)
            + rng.choice(CONTROLS)
            + rng.choice(WORDS)
            + rng.choice(("", "", *FORMATS))
            + rng.choice(WORDS)
        ),
        lambda t: any(unicodedata.category(c) == "Cc" and c not in "\t\n\r\x00" for c in t),
    ),
    "nul": (
        lambda rng: rng.choice(WORDS) + "\x00" * rng.randint(1, 3) + rng.choice(WORDS),
        lambda t: "\x00" in t,
    ),
    "tabs_newlines": (
        lambda rng: rng.choice(WORDS) + rng.choice(TAB_NEWLINE) + rng.choice(WORDS),
        lambda t: any(c in "\t\n\r\v\f" for c in t),
    ),
    "long_word_100_to_400": (
        lambda rng: _letters(rng, rng.choice([100, 101, 102, 150, 400])),
        lambda t: _longest_word(t) >= 100,
    ),
    "long_word_over_1000": (
        lambda rng: _letters(rng, rng.randint(1001, 6000)),
        lambda t: _longest_word(t) > 1000,
    ),
    "mixed_scripts": (
        lambda rng: "hello" + rng.choice(MIXED) + rng.choice(MIXED) + _cjk(rng),
        lambda t: len(_scripts(t)) >= 3,
    ),
    "arabic_hebrew": (
        lambda rng: " ".join(rng.sample((ARABIC + " " + HEBREW).split(), 3)),
        lambda t: _in_ranges(t, (0x0590, 0x06FF)),
    ),
    "thai": (
        lambda rng: rng.choice(THAI.split()) + rng.choice(WORDS),
        lambda t: _in_ranges(t, (0x0E00, 0x0E7F)),
    ),
    "fullwidth": (
        lambda rng: "".join(chr(rng.randint(0xFF01, 0xFF9F)) for _ in range(rng.randint(1, 10))),
        lambda t: _in_ranges(t, (0xFF01, 0xFF9F)),
    ),
    "unusual_whitespace": (
        lambda rng: (
            rng.choice(WORDS) + rng.choice(WHITESPACE) * rng.randint(1, 3) + rng.choice(WORDS)
        ),
        lambda t: any(w in t for w in WHITESPACE),
    ),
    "random_code_points": (
        lambda rng: (
            _random_code_point(rng, astral=True)
            + "".join(_random_code_point(rng) for _ in range(rng.randint(0, 8)))
        ),
        lambda t: any(ord(c) > 0xFFFF for c in t),
    ),
    "special_token_literals": (
        lambda rng: (
            rng.choice(["", "x", " "]) + rng.choice(SPECIAL_LITERALS) + rng.choice(["", "y", " "])
        ),
        lambda t: any(s in t for s in SPECIAL_LITERALS),
    ),
    "symbols": (
        lambda rng: "".join(rng.sample(SYMBOLS, rng.randint(1, 6))),
        lambda t: any(c in SYMBOLS for c in t),
    ),
    # ASCII alone (shared/ascii_path.py's texts): every code point below 128, capitals, and the
    # special tokens' literals in several cases
    "ascii_any": (
        lambda rng: (
            rng.choice(("The", "ID", "Vector"))
            + "".join(rng.choice(ASCII_PIECES) for _ in range(rng.randint(1, 16)))
        ),
        lambda t: any(c.isascii() and c.isupper() for c in t),
    ),
}
# texts of every category past the model's maximum, so the cut (max_length + 1, [SEP] kept) is
# checked on each kind of text too
LONG_SHARE = 0.1


def fuzz_texts(per_category: int, seed: int = FUZZ_SEED) -> list[tuple[str, str]]:
    """(category, text) pairs, ``per_category`` of each category of :data:`FUZZ_CATEGORIES`:
    ordinary words around the category's fragments, joined with or without spaces; about one
    in ten texts runs past the model's maximum. Also a few edge texts (empty, blank, lone
    punctuation, WordPiece's own ``##``), under "edge"."""
    rng = random.Random(seed)
    out: list[tuple[str, str]] = []
    for category, (fragment, _) in FUZZ_CATEGORIES.items():
        for _ in range(per_category):
            long = rng.random() < LONG_SHARE
            pieces = [fragment(rng)]
            for _ in range(rng.randint(0, 8) + (300 if long else 0)):
                pieces.append(fragment(rng) if rng.random() < 0.3 else rng.choice(WORDS))
            rng.shuffle(pieces)
            # a long word stays one word; other pieces are glued or spaced
            glue = " " if category.startswith("long_word") else rng.choice([" ", " ", "", "  "])
            out.append((category, glue.join(pieces)))
    for text in ("", " ", "\n", "a", "A", "##", "##ing", "[", "]", "[]", ".", "'", "...", "\x00"):
        out.append(("edge", text))
    return out


# minimal texts, one trait each: where a candidate differs on the fuzz, the report says which of
# these it gets wrong (the model tokenizer's tokens against the candidate's)
PROBES: dict[str, str] = {
    "word of 100 chars": "a" * 100,
    "word of 101 chars": "a" * 101,
    "URL-like word of 150 chars": "token" * 30,
    "[SEP] in the text": "x [SEP] y",
    "NFD accent (e + U+0301)": "cafe\u0301",
    "combining overline": "o\u0305w",
    "Hebrew niqqud": "\u05e2\u05d5\u05b9\u05dc\u05b8\u05dd",
    "Arabic harakat": "\u0645\u064f\u0634",
    "soft hyphen U+00AD": "caf\u00ade",
    "BOM U+FEFF inside a word": "a\ufeffb",
    "private use U+E000": "\ue000x",
    "CJK compatibility ideograph U+F90A": "\uf90a",
    "full-width word": "\uff54\uff4f\uff4b\uff45\uff4e",
    "pilcrow U+00B6 (punctuation)": "x\u00b6y",
    "paragraph separator U+2029": "a\u2029b",
    "NBSP U+00A0": "a\u00a0b",
    "ideographic space U+3000": "a\u3000b",
    "zero-width space U+200B": "a\u200bb",
    "NUL": "a\x00b",
    "C1 control U+008C": "a\x8cb",
    "emoji ZWJ sequence": "\U0001f468\u200d\U0001f469",
    "precomposed accents": "na\u00efve caf\u00e9 stra\u00dfe",
    "empty": "",
}


def probe(encode: Encode, tokenizer: WorkerTokenizer) -> dict[str, dict[str, list[str]]]:
    """The :data:`PROBES` ``encode`` gets wrong: name -> the model tokenizer's tokens and the
    candidate's (special tokens left out)."""
    backend = tokenizer.backend
    texts = list(PROBES.values())
    expected = [e.ids for e in backend.encode_batch(texts)]
    got = _safe_encode(encode, texts)
    wrong: dict[str, dict[str, list[str]]] = {}
    for name, want, ids in zip(PROBES, expected, got, strict=True):
        if isinstance(ids, str) or list(ids) != want:
            shown = [ids] if isinstance(ids, str) else [backend.id_to_token(i) for i in ids][1:-1]
            wrong[name] = {"model": [backend.id_to_token(i) for i in want][1:-1], "got": shown}
    return wrong


# --- identity ----------------------------------------------------------------------------------
@dataclass
class Identity:
    texts: int
    mismatches: int = 0
    examples: list[dict[str, Any]] = field(default_factory=list)
    by_category: dict[str, int] = field(default_factory=dict)

    @property
    def cell(self) -> str:
        return f"{'yes' if self.mismatches == 0 else 'NO'} ({self.mismatches}/{self.texts})"


def _safe_encode(encode: Encode, texts: list[str]) -> list[list[int] | str]:
    """The candidate's ids per text; where a window raises, text by text, an exception's text
    standing for the ids of a text that raised."""
    try:
        return list(encode(texts))
    except Exception:
        out: list[list[int] | str] = []
        for text in texts:
            try:
                out.extend(encode([text]))
            except Exception as error:
                out.append(f"raised {type(error).__name__}: {error}")
        return out


def identity(
    encode: Encode,
    texts: list[str],
    reference: list[list[int]],
    categories: Sequence[str] | None = None,
    tokens: Callable[[list[int]], list[str]] | None = None,
) -> Identity:
    """How many of ``texts`` ``encode`` gives other ids than ``reference`` for, with examples."""
    got: list[list[int] | str] = []
    for start in range(0, len(texts), WINDOW):
        got.extend(_safe_encode(encode, texts[start : start + WINDOW]))
    result = Identity(texts=len(texts))
    for index, (text, expected, ids) in enumerate(zip(texts, reference, got, strict=True)):
        if isinstance(ids, str) or list(ids) != expected:
            result.mismatches += 1
            category = categories[index] if categories is not None else "corpus"
            result.by_category[category] = result.by_category.get(category, 0) + 1
            if len(result.examples) < EXAMPLES or (
                category not in {e["category"] for e in result.examples}
                and len(result.examples) < 3 * EXAMPLES
            ):
                result.examples.append(_example(category, text, expected, ids, tokens))
    return result


def _example(
    category: str,
    text: str,
    expected: list[int],
    ids: list[int] | str,
    tokens: Callable[[list[int]], list[str]] | None,
) -> dict[str, Any]:
    example: dict[str, Any] = {"category": category, "text": _short(text), "chars": len(text)}
    if isinstance(ids, str):
        example["error"] = ids
        return example
    ids = list(ids)
    at = next((i for i, (a, b) in enumerate(zip(expected, ids, strict=False)) if a != b), None)
    at = min(len(expected), len(ids)) if at is None else at
    window = slice(max(0, at - 2), at + 4)
    example.update(
        lengths=[len(expected), len(ids)],
        first_difference=at,
        expected=expected[window],
        got=ids[window],
    )
    if tokens is not None:
        example.update(expected_tokens=tokens(expected[window]), got_tokens=tokens(ids[window]))
    return example


def _short(text: str, limit: int = 120) -> str:
    shown = text if len(text) <= limit else text[: limit // 2] + " … " + text[-limit // 2 :]
    return ascii(shown)


# --- timing ------------------------------------------------------------------------------------
def timed_pass(encode: Encode, texts: list[str], window: int) -> tuple[float, float, float]:
    """(wall s, thread CPU s, process CPU s) of one pass over ``texts``."""
    wall, cpu, process = time.perf_counter(), time.thread_time(), time.process_time()
    for start in range(0, len(texts), window):
        encode(texts[start : start + window])
    return time.perf_counter() - wall, time.thread_time() - cpu, time.process_time() - process


def machine() -> str:
    model = platform.processor() or "?"
    flags: list[str] = []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and model in ("?", "x86_64", ""):
                model = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = sorted(
                    f for f in line.split(":", 1)[1].split() if f.startswith(("amx", "avx512"))
                )
                break
    except OSError:
        pass
    return f"{model}; {os.cpu_count()} CPUs; {' '.join(flags) or 'no AMX/AVX-512 flags'}"


def measure(count: int, rounds: int, per_category: int, window: int) -> dict[str, Any]:
    from loadtest.corpus import build_corpus, load_tokenizer

    tokenizer = worker_tokenizer()
    corpus = build_corpus(count, tokenizer=load_tokenizer())
    texts = tokenizer.prepare([item.text for item in corpus])
    fuzz = fuzz_texts(per_category)
    fuzz_prepared = tokenizer.prepare([text for _, text in fuzz])
    fuzz_categories = [category for category, _ in fuzz]
    found, missing = candidates(tokenizer)
    reference_encode = found[0].encode
    reference = in_windows(reference_encode, texts, window)
    fuzz_reference = in_windows(reference_encode, fuzz_prepared, window)
    tokens_per_text = sum(len(ids) for ids in reference) / len(texts)
    truncated = sum(len(ids) > tokenizer.max_length for ids in reference)
    # the reference is the worker's tokenize(), cut for cut (on the texts before counting_head)
    worker_corpus = worker_differences(tokenizer, [item.text for item in corpus], reference)
    worker_fuzz = worker_differences(tokenizer, [text for _, text in fuzz], fuzz_reference)

    def id_tokens(ids: list[int]) -> list[str]:
        return [str(tokenizer.backend.id_to_token(i)) for i in ids]

    checks: dict[str, dict[str, Identity]] = {}
    probes_wrong: dict[str, dict[str, dict[str, list[str]]]] = {}
    for candidate in found:
        if candidate.same_ids_as is not None:
            checks[candidate.name] = checks[candidate.same_ids_as]
            continue
        encode = candidate.fresh() if candidate.fresh is not None else candidate.encode
        checks[candidate.name] = {
            "corpus": identity(encode, texts, reference, tokens=id_tokens),
            "fuzz": identity(encode, fuzz_prepared, fuzz_reference, fuzz_categories, id_tokens),
        }
        probes_wrong[candidate.name] = probe(encode, tokenizer)
    for candidate in found:  # one pass untimed each; it fills the warm word cache
        in_windows(candidate.encode, texts, window)
    timings: dict[str, list[tuple[float, float, float]]] = {c.name: [] for c in found}
    for number in range(rounds):
        shift = number % len(found)
        for candidate in found[shift:] + found[:shift]:
            encode = candidate.fresh() if candidate.fresh is not None else candidate.encode
            timings[candidate.name].append(timed_pass(encode, texts, window))
        print(f"round {number + 1}/{rounds} done", file=sys.stderr)
    rows = []
    for candidate in found:
        runs = timings[candidate.name]
        cpu_rate = statistics.median(len(texts) / max(1e-9, cpu) for _, cpu, _ in runs)
        wall_rate = statistics.median(len(texts) / wall for wall, _, _ in runs)
        other_threads = statistics.median(
            (process - cpu) / max(1e-9, cpu) for _, cpu, process in runs
        )
        check = checks[candidate.name]
        rows.append(
            {
                "candidate": candidate.name,
                "texts_per_cpu_s": cpu_rate,
                "texts_per_wall_s": wall_rate,
                "tokens_per_cpu_s": cpu_rate * tokens_per_text,
                "rounds_texts_per_cpu_s": [len(texts) / max(1e-9, cpu) for _, cpu, _ in runs],
                # process CPU beyond the thread's, as a share of it: > 0.05 means other threads
                # worked, and the thread's rate flatters the candidate
                "other_threads_cpu_share": other_threads,
                "corpus": vars(check["corpus"]),
                "fuzz": vars(check["fuzz"]),
                "probes_wrong": probes_wrong.get(candidate.same_ids_as or candidate.name, {}),
            }
        )
    base = rows[0]["texts_per_cpu_s"]
    for row in rows:
        row["to_encode_batch"] = row["texts_per_cpu_s"] / base
    return {
        "machine": machine(),
        "python": sys.version.split()[0],
        "tokenizers": _version("tokenizers"),
        "flash_tokenizer": _version("flash-tokenizer"),
        "texts": len(texts),
        "tokens_per_text": tokens_per_text,
        "truncated_texts": truncated,
        # texts where the worker's TextTokenizer.tokenize differs from the reference (cut to
        # max_length): 0 and 0 say the reference is what the worker feeds the model
        "worker_differences": {"corpus": worker_corpus, "fuzz": worker_fuzz},
        "max_length": tokenizer.max_length,
        "window": window,
        "rounds": rounds,
        "fuzz_texts": len(fuzz),
        "fuzz_per_category": per_category,
        "fuzz_seed": FUZZ_SEED,
        "not_measured": missing,
        "rows": rows,
    }


def _version(distribution: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return None


def print_report(report: dict[str, Any]) -> None:
    print(f"machine: {report['machine']}")
    print(
        f"corpus: {report['texts']} texts, {report['tokens_per_text']:.1f} tokens per text after "
        f"the cut at max_length + 1 = {report['max_length'] + 1} ({report['truncated_texts']} "
        f"cut); fuzz: {report['fuzz_texts']} texts (seed {report['fuzz_seed']}); windows of "
        f"{report['window']}; median of {report['rounds']} interleaved rounds; one thread; "
        f"tokenizers {report['tokenizers']}, flash-tokenizer {report['flash_tokenizer']}"
    )
    differences = report["worker_differences"]
    print(
        f"reference = the worker's TextTokenizer.tokenize: texts that differ: "
        f"{differences['corpus']['differ']} of the corpus, {differences['fuzz']['differ']} of "
        f"the fuzz; of these, not texts the worker re-encodes whole (sparse heads cut by "
        f"counting_head): {differences['corpus']['unexplained']} and "
        f"{differences['fuzz']['unexplained']}"
    )
    print()
    print(
        "| candidate | texts/CPU-s | tokens/CPU-s | × encode_batch | identical on corpus "
        "(mismatches/N) | identical on fuzz (mismatches/N) |"
    )
    print("|---|---:|---:|---:|---|---|")
    for row in report["rows"]:
        flag = " ⚠ other threads" if row["other_threads_cpu_share"] > 0.05 else ""
        corpus, fuzz = Identity(**row["corpus"]), Identity(**row["fuzz"])
        print(
            f"| {row['candidate']}{flag} | {row['texts_per_cpu_s']:.0f} | "
            f"{row['tokens_per_cpu_s']:.0f} | {row['to_encode_batch']:.2f} | {corpus.cell} | "
            f"{fuzz.cell} |"
        )
    for name, why in report["not_measured"].items():
        print(f"| {name} | — | — | — | not measured: {why} | |")
    for row in report["rows"]:
        fuzz = row["fuzz"]
        if not (row["corpus"]["mismatches"] or fuzz["mismatches"]) or "(warm)" in row["candidate"]:
            continue
        if "call only" in row["candidate"]:
            continue
        print()
        print(f"{row['candidate']}: fuzz mismatches by category: {fuzz['by_category']}")
        print(f"{row['candidate']}: minimal texts it gets wrong (model's tokens → its tokens):")
        for name, tokens in row["probes_wrong"].items():
            print(f"  {name}: {_few(tokens['model'])} → {_few(tokens['got'])}")
        print(f"{row['candidate']}: examples:")
        for example in row["corpus"]["examples"] + fuzz["examples"]:
            print(f"  {json.dumps(example, ensure_ascii=True)}")


def _few(tokens: list[str], shown: int = 6) -> str:
    more = f" … (+{len(tokens) - shown})" if len(tokens) > shown else ""
    return " ".join(tokens[:shown]) + more


@click.command()
@click.option("--texts", "count", type=int, default=20000, show_default=True)
@click.option("--rounds", type=int, default=5, show_default=True)
@click.option("--fuzz-per-category", type=int, default=200, show_default=True)
@click.option("--window", type=int, default=WINDOW, show_default=True)
@click.option(
    "--candidates-path",
    "paths",
    multiple=True,
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="A folder holding extra candidates (pip install --no-deps --target DIR "
    "flash-tokenizer); appended to sys.path, after the project's own packages.",
)
@click.option("--json", "json_out", type=click.Path(dir_okay=False, path_type=Path))
def main(
    count: int,
    rounds: int,
    fuzz_per_category: int,
    window: int,
    paths: tuple[Path, ...],
    json_out: Path | None,
) -> None:
    """Texts per CPU second of the model's tokenizer and of candidates that might replace it,
    and whether each gives the same ids on the corpus and on a Unicode fuzz."""
    sys.path.extend(str(path) for path in paths)
    report = measure(count, rounds, fuzz_per_category, window)
    print_report(report)
    if json_out is not None:
        json_out.write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
