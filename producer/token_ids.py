"""Token ids made where the producer runs (issue 53: tokenize where the CPUs are).

With EMBEDFLEET_PRODUCER_TOKEN_IDS (``Producer(..., settings)``) or ``token_ids=True`` on
``Producer.enqueue``, each chunk carries the ids of its prompt and text, made with the tokenizer
the lane's workers publish (``Keys.tokenizer``: theirs as configured, its cut at the model's
maximum + 1 included), and that tokenizer's fingerprint from the model card. The worker then
embeds those ids without tokenizing (workers/token_ids.py): a GPU host's cores feed the GPU,
and the ingestion service's own CPUs, which scale out, do the tokenizing. The ids are made by
shared/tokens.py ``encode_for_model``, the function the worker tokenizes with, so a vector from
the producer's ids is the vector of the text.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING

from embedfleet.shared.ascii_path import AsciiPath
from embedfleet.shared.modelcard import ModelCard, resolve_prompt
from embedfleet.shared.protocol import Chunk
from embedfleet.shared.tokens import (
    encode_for_model,
    ids_fingerprint,
    pack_token_ids,
    tokenizer_fingerprint,
)

if TYPE_CHECKING:
    from tokenizers import Tokenizer


class TokenIdsUnavailableError(RuntimeError):
    """The producer was asked for token ids it cannot make; the message says what to do."""


class TokenIdMaker:
    """Token ids for chunks of one model lane, from its card and published tokenizer."""

    def __init__(
        self, card: ModelCard, tokenizer_json: str, role_prompt_names: dict[str, str]
    ) -> None:
        if not card.tokenizer_fingerprint:
            raise TokenIdsUnavailableError(
                f"the model {card.name!r} takes no token ids from producers (its workers "
                "publish no tokenizer fingerprint: a cross-encoder, or workers older than "
                "this client): enqueue without token ids"
            )
        found = tokenizer_fingerprint(tokenizer_json)
        if found != card.tokenizer_fingerprint:
            raise TokenIdsUnavailableError(
                f"the published tokenizer ({found}) is not the model card's "
                f"({card.tokenizer_fingerprint}): workers of two versions are starting; "
                "try again once they agree, or enqueue without token ids"
            )
        from tokenizers import Tokenizer  # the [documents] extra; checked by the caller

        self.card = card
        self.tokenizer: Tokenizer = Tokenizer.from_str(tokenizer_json)
        self.ascii_path = AsciiPath.of(self.tokenizer)
        # EMBEDFLEET_QUERY_PROMPT_NAME / EMBEDFLEET_DOCUMENT_PROMPT_NAME, as the workers read them
        self.role_prompt_names = role_prompt_names

    def prompt_for(self, chunk: Chunk, role: str = "document") -> str:
        """The prompt the worker joins before this chunk's text, by its prompt role: ``document``
        on the ingest and interactive streams, ``query`` on the query stream."""
        return resolve_prompt(
            self.card.named_prompts,
            self.card.default_prompt_name,
            role,
            chunk.prompt_name,
            chunk.prompt,
            self.role_prompt_names.get(role, ""),
        )

    def attach(self, chunks: Sequence[Chunk], role: str = "document") -> list[Chunk]:
        """``chunks`` with their token ids, in one batch call of the tokenizer (Rust: releases
        the GIL, so callers put it on a thread). A chunk that already has ids, a
        cross-encoder's pair, a long input for windows (whose whole ids the worker needs) and an
        image (no text to tokenize) are left as they are."""
        wanted = [
            i
            for i, chunk in enumerate(chunks)
            if chunk.token_ids is None
            and chunk.pair is None
            and chunk.window_overlap is None
            and not chunk.is_image
        ]
        if not wanted:
            return list(chunks)
        prompts = [self.prompt_for(chunks[i], role) for i in wanted]
        ids = encode_for_model(
            self.tokenizer,
            [prompt + chunks[i].text for prompt, i in zip(prompts, wanted, strict=True)],
            self.card.max_length,
            self.ascii_path,
        )
        out = list(chunks)
        fingerprint = self.card.tokenizer_fingerprint
        for i, prompt, made in zip(wanted, prompts, ids, strict=True):
            out[i] = dataclasses.replace(
                chunks[i],
                token_ids=pack_token_ids(made),
                tokenizer=ids_fingerprint(fingerprint, prompt),
            )
        return out
