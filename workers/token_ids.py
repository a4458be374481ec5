"""Token ids made by the producer (issue 53: tokenize where the CPUs are).

A chunk may carry the ids of ``prompt + text`` made with the tokenizer this lane's workers
publish (shared/protocol.py ``Chunk.token_ids``), so a GPU host spends no time tokenizing it.
:func:`tokenize_chunks` is the reader's one call for a window's chunks: the ids a chunk brought
are used where they are this model's tokenizer's and the prompt's the worker resolves; ids of
another tokenizer (or out of the vocabulary) are refused with the reason, never embedded into a
wrong vector; every other chunk is tokenized here, in one batch call.
"""

from __future__ import annotations

import array
import functools
from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field

import numpy as np

from embedfleet.shared.options import ForeignTokenIdsError
from embedfleet.shared.protocol import Chunk
from embedfleet.shared.tokens import (
    foreign_ids_message,
    ids_fingerprint,
    split_fingerprint,
    token_id_array,
)
from embedfleet.workers.model.encoder import Encoder, Tokenized, pairs_of


@dataclass
class TokenizedChunks:
    """A window's chunks with their token ids: ``tokens[i]`` for ``kept[i]`` (a position in the
    chunks given), and the positions refused with their reason."""

    kept: list[int] = field(default_factory=list)
    tokens: list[Tokenized] = field(default_factory=list)
    refused: list[tuple[int, str]] = field(default_factory=list)
    # how many were tokenized here; the others brought their producer's ids
    tokenized_here: int = 0


def producer_ids(chunk: Chunk, prompt: str, encoder: Encoder) -> bytes | None:
    """The ids ``chunk`` brought (packed), where the worker can use them; None: tokenize its
    text (no ids, a cross-encoder's pair, or ids made with another prompt than ``prompt``,
    which are the right tokenizer's but not this chunk's input). ForeignTokenIdsError (the
    verifier's, a ValueError): ids of another tokenizer (the dead letter's reason). Their
    vocabulary is checked for a window at once (:func:`outside_vocabulary`)."""
    if chunk.token_ids is None or chunk.tokenizer is None or chunk.pair is not None:
        return None
    text = encoder.text
    if chunk.tokenizer != _expected(text.fingerprint, prompt):
        tokenizer, _ = split_fingerprint(chunk.tokenizer)
        if tokenizer != text.fingerprint:
            raise ForeignTokenIdsError(foreign_ids_message(tokenizer, text.fingerprint))
        return None  # this tokenizer's ids of another prompt
    return chunk.token_ids


def outside_vocabulary(packed: Sequence[bytes], vocab_size: int) -> list[str | None]:
    """For each chunk's packed ids, the reason they are refused (an id outside the
    vocabulary) or None. One numpy pass over the window's ids (per chunk, the Python ints it
    made cost more than the rest of its host path: issue 53); per chunk only where one is out."""
    if not packed or int(np.frombuffer(b"".join(packed), dtype="<u4").max()) < vocab_size:
        return [None] * len(packed)
    largest = [int(np.frombuffer(data, dtype="<u4").max()) for data in packed]
    return [
        f"token id {top} is outside the model's vocabulary of {vocab_size}"
        if top >= vocab_size
        else None
        for top in largest
    ]


@functools.lru_cache(maxsize=64)
def _expected(fingerprint: str, prompt: str) -> str:
    """The ``tokenizer`` field of ids made for ``prompt`` (a few prompts per model)."""
    return ids_fingerprint(fingerprint, prompt)


def tokenize_chunks(
    chunks: Sequence[Chunk],
    prompts: Sequence[str],
    encoder: Encoder,
    encode_on: Executor | None = None,
) -> TokenizedChunks:
    """Each chunk's tokens: its producer's ids where usable, else its text tokenized (one
    batch call for all of those, ``Encoder.tokenize``, on ``encode_on`` where given); refused
    chunks are left out."""
    if encoder.representation == "rerank" or all(c.token_ids is None for c in chunks):
        # none brought ids (or a cross-encoder, which tokenizes its pairs): all tokenized here,
        # none refused, in the chunks' order
        tokens = _tokenize(chunks, prompts, encoder, encode_on)
        return TokenizedChunks(list(range(len(chunks))), tokens, tokenized_here=len(chunks))
    out = TokenizedChunks()
    given: dict[int, Tokenized] = {}
    to_tokenize: list[int] = []
    brought: dict[int, bytes] = {}
    for position, (chunk, prompt) in enumerate(zip(chunks, prompts, strict=True)):
        try:
            packed = producer_ids(chunk, prompt, encoder)
        except ValueError as error:
            out.refused.append((position, str(error)))
            continue
        if packed is None:
            to_tokenize.append(position)
        else:
            brought[position] = packed
    reasons = outside_vocabulary(list(brought.values()), encoder.text.vocab_size)
    for (position, packed), reason in zip(brought.items(), reasons, strict=True):
        if reason is not None:
            out.refused.append((position, reason))
        else:
            ids: array.array[int] = token_id_array(packed)
            given[position] = encoder.text.from_ids(ids, prompts[position])
    if to_tokenize:
        made = _tokenize(
            [chunks[p] for p in to_tokenize], [prompts[p] for p in to_tokenize], encoder, encode_on
        )
        given.update(zip(to_tokenize, made, strict=True))
        out.tokenized_here = len(to_tokenize)
    out.kept = sorted(given)  # every position not refused, in order
    out.tokens = [given[position] for position in out.kept]
    return out


def _tokenize(
    chunks: Sequence[Chunk], prompts: Sequence[str], encoder: Encoder, encode_on: Executor | None
) -> list[Tokenized]:
    """The chunks' texts tokenized in one batch call (their prompts joined where any has one,
    a cross-encoder's pairs where any has one)."""
    return encoder.tokenize(
        [chunk.text for chunk in chunks],
        list(prompts) if any(prompts) else None,
        pairs=pairs_of(chunks),
        encode_on=encode_on,
    )
