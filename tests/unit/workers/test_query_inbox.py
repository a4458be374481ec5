"""workers/query_inbox.py, the pure parts of a queued query: the rows it puts through the
model, its reply key, and when it was enqueued (the read, the expiry and the queueing against a
real Redis and model: tests/integration/workers/test_queries.py)."""

from __future__ import annotations

from embedfleet.shared.protocol import Chunk
from embedfleet.sinks import Delivery
from embedfleet.workers.model.tokenizer import Tokenized
from embedfleet.workers.query_inbox import PendingQuery


def pending(windows: list[Tokenized] | None = None) -> PendingQuery:
    chunk = Chunk(id="q", text="a question", reply="replies:1")
    delivery = Delivery("query", "1700000000123-4", None)
    return PendingQuery(chunk, delivery, Tokenized([1, 2, 3], False), 1.0, 2.0, windows=windows)


def test_a_query_is_one_row_or_its_token_windows() -> None:
    assert [row.ids for row in pending().rows] == [[1, 2, 3]]
    windows = [Tokenized([1, 2], False), Tokenized([2, 3], False)]
    assert pending(windows).rows == windows


def test_a_query_replies_on_its_key_and_was_enqueued_when_its_entry_id_says() -> None:
    query = pending()
    assert query.reply == "replies:1"
    assert query.enqueued_at == 1_700_000_000.123
