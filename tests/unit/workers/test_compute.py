"""workers/compute.py's accounting (issue 30): each delivery of a batch carries the model, its
text's tokens and its share of the batch's model time by tokens; the rest of the delivery is
kept. (The compute stage itself runs in the worker tests of tests/integration/workers/.)"""

from __future__ import annotations

from embedfleet.sinks import Delivery
from embedfleet.workers.compute import accounted
from embedfleet.workers.model.tokenizer import Tokenized


def test_model_time_is_shared_by_tokens_and_the_rest_kept() -> None:
    deliveries = [
        Delivery("ingest", "1-0", "job", tenant="acme"),
        Delivery("ingest", "2-0", None, copy=True),
    ]
    tokens = [Tokenized([101, 7, 8, 102], False), Tokenized([101, 102], False)]
    first, second = accounted(deliveries, tokens, "minilm", seconds=0.003)
    assert first == Delivery("ingest", "1-0", "job", "acme", "minilm", 4, 2000, False)
    assert second == Delivery("ingest", "2-0", None, None, "minilm", 2, 1000, True)


def test_an_empty_batch_accounts_nothing() -> None:
    assert accounted([], [], "minilm", seconds=0.5) == []
