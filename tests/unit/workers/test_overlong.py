"""workers/overlong.py: without truncation, the rows cut to the model's maximum are set aside
as ``too_long`` with a reason that names the limit and the setting."""

from __future__ import annotations

from embedfleet.shared.dead_letters import DeadReason
from embedfleet.shared.protocol import Chunk
from embedfleet.sinks import Delivery
from embedfleet.workers.model.tokenizer import Tokenized
from embedfleet.workers.overlong import set_aside_overlong


def test_rows_cut_to_fit_are_rejected_and_the_others_kept() -> None:
    chunks = [Chunk(id=name, text=name, job="j") for name in ("short", "long", "fits")]
    deliveries = [Delivery("ingest", f"{i}-0", "j") for i in range(3)]
    tokens = [Tokenized([1, 2], False), Tokenized([1] * 8, True), Tokenized([1] * 8, False)]
    keep, rejected = set_aside_overlong(chunks, deliveries, tokens, max_length=8)
    assert keep == [0, 2]
    assert [(r.entry_id, r.reason, r.chunk_id) for r in rejected] == [
        ("1-0", DeadReason.TOO_LONG, "long")
    ]
    assert "model's 8 tokens" in rejected[0].detail
    assert "EMBEDFLEET_TRUNCATE=false" in rejected[0].detail


def test_nothing_cut_keeps_every_row() -> None:
    chunks = [Chunk(id="a", text="a")]
    keep, rejected = set_aside_overlong(
        chunks, [Delivery("ingest", "1-0", None)], [Tokenized([1], False)], max_length=8
    )
    assert keep == [0] and rejected == []
