"""Token-count rules that the worker's tokenizer and the torch-free one (gateway, splitter) share.

A text this many characters per allowed token long certainly has more tokens than the model
takes, so only its head needs tokenizing: that keeps a 10 MB text from costing seconds of
tokenization, and both sides count the same tokens for it.
"""

from __future__ import annotations

CHARS_PER_TOKEN_CUT = 50


def counting_head(text: str, max_length: int) -> str:
    """The part of ``text`` worth tokenizing for a model that takes ``max_length`` tokens."""
    return text[: max_length * CHARS_PER_TOKEN_CUT]
