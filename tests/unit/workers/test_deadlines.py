"""workers/deadlines.py: the chunks past their caller's deadline are set aside, the rest kept in
order; none is copied when nothing has expired."""

from __future__ import annotations

from embedfleet.shared.protocol import Chunk
from embedfleet.sinks import Delivery
from embedfleet.workers.deadlines import split_expired
from embedfleet.workers.decode import Accepted

NOW_MS = 1_700_000_000_000


def accepted(chunk_id: str, deadline_ms: int | None) -> Accepted:
    chunk = Chunk(id=chunk_id, text="t", deadline_ms=deadline_ms)
    return Accepted(chunk, Delivery("ingest", f"{chunk_id}-0", None))


def test_chunks_past_their_deadline_are_set_aside_and_the_rest_kept_in_order() -> None:
    read = [
        accepted("none", None),
        accepted("past", NOW_MS - 1),
        accepted("now", NOW_MS),  # not past yet: the deadline is the last moment to answer
        accepted("later", NOW_MS + 5_000),
    ]
    kept, expired = split_expired(read, NOW_MS)
    assert [a.chunk.id for a in kept] == ["none", "now", "later"]
    assert expired == [read[1].delivery]


def test_a_read_with_nothing_expired_is_handed_back_as_it_is() -> None:
    read = [accepted("a", None), accepted("b", NOW_MS + 1)]
    kept, expired = split_expired(read, NOW_MS)
    assert kept is read and expired == []
