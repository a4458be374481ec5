"""Token rules that the worker's tokenizer and the torch-free one (gateway, splitter, a producer
making token ids) share: the counting head, the ids on the wire and the tokenizer's fingerprint.

A text this many characters per allowed token long certainly has more tokens than the model
takes, so only its head needs tokenizing: that keeps a 10 MB text from costing seconds of
tokenization, and both sides count the same tokens for it.
"""

from __future__ import annotations

import array
import hashlib
import json
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from embedfleet.shared.ascii_path import AsciiPath

CHARS_PER_TOKEN_CUT = 50


def counting_head_chars(max_length: int) -> int:
    """How many characters of a text are worth tokenizing for a model that takes
    ``max_length`` tokens."""
    return max_length * CHARS_PER_TOKEN_CUT


def counting_head(text: str, max_length: int) -> str:
    """The part of ``text`` worth tokenizing for a model that takes ``max_length`` tokens."""
    return text[: counting_head_chars(max_length)]


# --- token ids made by the producer (issue 53: tokenize where the CPUs are) -------------------
# A chunk may carry the token ids of ``prompt + text`` made with the model lane's published
# tokenizer (``Keys.tokenizer``: the worker's configured one, its cut at the model's maximum + 1
# included), so a GPU host spends no time tokenizing. On the wire: ``token_ids``, little-endian
# uint32 ids (any language packs them: ``struct.pack('<%dI' % n, *ids)``), and ``tokenizer``,
# the fingerprint of the tokenizer that made them, ``/p`` and the prompt's digest appended when
# a prompt was joined before the text.
TOKEN_ID_BYTES = 4
PROMPT_MARK = "/p"


def tokenizer_fingerprint(tokenizer_json: str | bytes) -> str:
    """The fingerprint of a tokenizer, from its ``tokenizer.json`` text (what the worker
    publishes and the model card names): a digest of the JSON with its keys sorted and no
    whitespace, so the same tokenizer written with other spacing or key order agrees."""
    parsed = json.loads(tokenizer_json)
    canonical = json.dumps(parsed, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return "t1-" + hashlib.blake2b(canonical.encode("utf-8"), digest_size=12).hexdigest()


def ids_fingerprint(tokenizer: str, prompt: str) -> str:
    """The ``tokenizer`` field of a chunk whose ids were made from ``prompt + text``."""
    if not prompt:
        return tokenizer
    digest = hashlib.blake2b(prompt.encode("utf-8"), digest_size=6).hexdigest()
    return f"{tokenizer}{PROMPT_MARK}{digest}"


def split_fingerprint(field: str) -> tuple[str, str]:
    """(the tokenizer's fingerprint, the prompt's digest or "") of a chunk's ``tokenizer``."""
    tokenizer, _, prompt = field.partition(PROMPT_MARK)
    return tokenizer, prompt


def foreign_ids_message(found: str, expected: str) -> str:
    """Why token ids of the tokenizer ``found`` are refused by a model whose tokenizer is
    ``expected``: the one message the worker's dead letter and the producer's check give."""
    return (
        f"token ids made by another tokenizer ({found!r}; this model's is {expected!r}): make "
        "them with the tokenizer the workers publish (Producer.enqueue(token_ids=True) reads "
        "it), or send the text alone"
    )


def pack_token_ids(ids: Sequence[int]) -> bytes:
    """Token ids on the wire: little-endian uint32."""
    packed = array.array("I", ids)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed.tobytes()


def unpack_token_ids(data: bytes) -> list[int]:
    """The ids of a chunk's ``token_ids`` (its length a multiple of 4: the protocol's check)."""
    return token_id_array(data).tolist()


def token_id_array(data: bytes) -> array.array[int]:
    """:func:`unpack_token_ids` as an ``array("I")``: a sequence of ints that numpy copies as
    one buffer (the worker's collation) without making a Python int per id."""
    packed = array.array("I")
    packed.frombytes(data)
    if sys.byteorder != "little":
        packed.byteswap()
    return packed


def encode_for_model(
    backend: Any, texts: Sequence[str], max_length: int, ascii_path: AsciiPath | None = None
) -> list[list[int]]:
    """Each text's ids as the worker tokenizes it (``backend``: the model's configured
    ``tokenizers.Tokenizer``, cutting at ``max_length + 1``): only the counting head of a long
    text is tokenized, and a text so sparse in tokens that the head lost some is tokenized
    whole. ``encode_batch_fast`` gives ``encode_batch``'s ids without computing offsets
    (docs/BENCHMARKS.md, "Stop 53"; loadtest/tokenizer_rates.py checks them id for id), and
    ``ascii_path`` (``AsciiPath.of(backend)``) the same ids for most ASCII texts without the
    normalizer's work (shared/ascii_path.py). The one place the worker and the producer make
    ids."""
    head = counting_head_chars(max_length)  # counting_head's cut, applied inline: one pass
    prepared = [text[:head] for text in texts]
    out: list[list[int]]
    if ascii_path is None:
        out = [encoding.ids for encoding in backend.encode_batch_fast(prepared)]
    elif ascii_path.configured is backend:
        out = ascii_path.encode(prepared)
    else:
        raise ValueError("ascii_path was made for another tokenizer: AsciiPath.of(backend)")
    for row in [row for row, text in enumerate(texts) if len(text) > head]:
        if len(out[row]) <= max_length:
            out[row] = backend.encode(texts[row]).ids  # rare: the cut lost tokens; do it properly
    return out
