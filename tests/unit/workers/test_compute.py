"""workers/compute.py's accounting (issue 30): each delivery of a batch carries the model, its
text's tokens and its share of the batch's model time by tokens; the rest of the delivery is
kept. (The compute stage itself runs in the worker tests of tests/integration/workers/.)"""

from __future__ import annotations

import dataclasses

import pytest

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


def test_an_accounted_delivery_is_the_one_its_constructor_makes() -> None:
    """``Delivery.accounted`` copies the fields' dict instead of running the frozen
    dataclass's __init__: the same object (equal, same hash, still frozen), and nothing in
    the class that the copy would skip."""
    delivery = Delivery("ingest:t:acme", "3-0", "job", tenant="own", copy=True)
    made = delivery.accounted("minilm", 61, 1234)
    expected = Delivery("ingest:t:acme", "3-0", "job", "own", "minilm", 61, 1234, True)
    assert made == expected and hash(made) == hash(expected) and repr(made) == repr(expected)
    assert delivery == Delivery("ingest:t:acme", "3-0", "job", tenant="own", copy=True)
    assert not hasattr(Delivery, "__post_init__") and not hasattr(Delivery, "__slots__")
    with pytest.raises(dataclasses.FrozenInstanceError):
        made.tokens = 1  # type: ignore[misc]
