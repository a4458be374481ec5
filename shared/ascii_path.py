"""ASCII texts tokenized without the normalizer's work where all it would do is lower-case them
(issue 53: faster tokenization, where the ids are identical).

A BERT tokenizer's normalizer (clean the text, space out CJK characters, strip accents,
lower-case) rewrites each text character by character and keeps an alignment for every one: on
RAG-like texts it costs about as much as the pre-tokenizer and the WordPiece model together
(docs/BENCHMARKS.md, "Stop 71"). On an ASCII text without control characters it can only
lower-case: NFD and the accent strip leave ASCII as it is, there are no CJK characters to space
out, and the clean-up turns tab, newline and return into spaces, which the pre-tokenizer splits
on alike. So such a text is lower-cased by Python (``str.lower`` is exact on ASCII) and encoded
by a copy of the tokenizer that has no normalizer; every other text, and every tokenizer whose
normalizer is not one of those below, goes through the tokenizer as configured.

Added tokens are the one catch: the special tokens match the text before it is normalized,
case and all, so ``[CLS]`` in a text is the special token for the tokenizer and ``[cls]`` once
Python lower-cased it. A text holding an added token's content, in any case, goes the
configured way. The ids are checked text for text against the configured tokenizer by
``tests/unit/shared/test_ascii_path.py`` (the cases above, a cased tokenizer) and by
``python -m loadtest.tokenizer_rates`` (a RAG-like corpus and a seeded Unicode fuzz).
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from typing import Any

# Normalizers whose output on an ASCII text without control characters is the text itself
# (Unicode forms, accent strips: ASCII has no accents or compatibility forms). Lowercase and
# BertNormalizer lower-case it (the latter's clean-up, CJK spacing and accent strip do nothing
# more there).
_IDENTITY_ON_ASCII = frozenset({"NFC", "NFD", "NFKC", "NFKD", "StripAccents"})
# ASCII control characters but tab, newline and return: BertNormalizer's clean-up removes them
_CONTROL = r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]"
# each text is searched for every added token's content: BERT's tokenizers add five
MAX_ADDED_TOKENS = 64


def ascii_lowercases(normalizer: dict[str, Any] | None) -> bool | None:
    """What a normalizer (its ``tokenizer.json`` entry) does to an ASCII text without control
    characters: True, lower-cases it; False, leaves it as it is; None, something this module
    does not model (no fast path)."""
    if normalizer is None:
        return False
    kind = normalizer.get("type")
    if kind == "Sequence":
        parts = [ascii_lowercases(part) for part in normalizer.get("normalizers", [])]
        return None if None in parts else any(parts)
    if kind == "BertNormalizer":
        return bool(normalizer.get("lowercase"))
    if kind == "Lowercase":
        return True
    if kind in _IDENTITY_ON_ASCII:
        return False
    return None


class AsciiPath:
    """A configured ``tokenizers.Tokenizer`` and its copy without a normalizer, for the texts
    on which the two give the same ids. Build it after the tokenizer is configured (cut,
    padding, normalizer): the copy is taken then."""

    def __init__(
        self, configured: Any, bare: Any, lowercase: bool, configured_way: re.Pattern[str]
    ) -> None:
        self.configured = configured
        self.bare = bare
        self.lowercase = lowercase
        self._configured_way = configured_way.search

    @classmethod
    def of(cls, backend: Any) -> AsciiPath | None:
        """The fast path for ``backend``, or None where it has no normalizer (nothing to
        skip) or one this module does not model (a SentencePiece model's, a replacement's), or
        so many added tokens that looking for them would cost more than it saves."""
        from tokenizers import Tokenizer

        published = backend.to_str()
        config = json.loads(published)
        normalizer = config.get("normalizer")
        lowercase = ascii_lowercases(normalizer)
        if normalizer is None or lowercase is None:
            return None
        contents = [
            re.escape(token["content"])
            for token in config.get("added_tokens", [])
            if token.get("content", "").isascii()  # a non-ASCII one cannot be in an ASCII text
        ]
        if len(contents) > MAX_ADDED_TOKENS:
            return None
        bare = Tokenizer.from_str(published)
        bare.normalizer = None
        pattern = re.compile("|".join([_CONTROL, *contents]), re.IGNORECASE)
        return cls(backend, bare, lowercase, pattern)

    def takes(self, text: str) -> bool:
        """Whether ``text`` gets the configured tokenizer's ids from the copy."""
        return text.isascii() and self._configured_way(text) is None

    def encode(self, texts: Sequence[str]) -> list[list[int]]:
        """Each text's ids, as the configured tokenizer's ``encode_batch_fast`` gives them."""
        takes = self.takes
        plain: list[int] = []
        others: list[int] = []
        for row, text in enumerate(texts):
            (plain if takes(text) else others).append(row)
        if not others:
            return self._bare_ids(texts)
        out: list[list[int]] = [[] for _ in texts]
        for row, ids in zip(plain, self._bare_ids([texts[row] for row in plain]), strict=True):
            out[row] = ids
        configured = self.configured.encode_batch_fast([texts[row] for row in others])
        for row, encoding in zip(others, configured, strict=True):
            out[row] = encoding.ids
        return out

    def _bare_ids(self, texts: Sequence[str]) -> list[list[int]]:
        if not texts:
            return []
        prepared = [text.lower() for text in texts] if self.lowercase else list(texts)
        return [encoding.ids for encoding in self.bare.encode_batch_fast(prepared)]
