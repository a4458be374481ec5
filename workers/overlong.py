"""The over-long set-aside: without truncation (EMBEDFLEET_TRUNCATE=false), a text longer than
the model's maximum is dead-lettered (``too_long``) instead of embedded cut.

The tokenizer cuts every text to the model's maximum and says so (``Tokenized.truncated``);
the bulk reader (``Intake``) asks this module, once per window, which rows to keep.
"""

from __future__ import annotations

from collections.abc import Sequence

from embedfleet.shared.dead_letters import DeadReason
from embedfleet.shared.protocol import Chunk
from embedfleet.sinks import Delivery
from embedfleet.workers.dead_letter_writer import Rejected
from embedfleet.workers.model.encoder import Tokenized


def set_aside_overlong(
    chunks: Sequence[Chunk],
    deliveries: Sequence[Delivery],
    tokens: Sequence[Tokenized],
    max_length: int,
) -> tuple[list[int], list[Rejected]]:
    """The positions to keep (those not cut) and the rejections of the others, each with the
    reason a caller reads in the dead letter."""
    reason = f"text is longer than the model's {max_length} tokens (EMBEDFLEET_TRUNCATE=false)"
    rejected = [
        Rejected.chunk(delivery, chunk, DeadReason.TOO_LONG, reason)
        for chunk, delivery, tokenized in zip(chunks, deliveries, tokens, strict=True)
        if tokenized.truncated
    ]
    keep = [i for i, tokenized in enumerate(tokens) if not tokenized.truncated]
    return keep, rejected
