"""A query request checked before anything is sent (producer/queries.py): what no worker could
answer is a ValueError at once, not a wait."""

from __future__ import annotations

import pytest

from embedfleet.producer.queries import _check_request, _raw


def test_a_request_no_worker_could_answer_is_refused_at_once() -> None:
    _check_request("queries", ["a", "b"], 1.0, None)
    _check_request("pairs", ["q"], 0.5, ["doc"])
    refused = [
        (("queries", [], 1.0, None), "embedding queries needs at least one text"),
        (("queries", ["a", 3], 1.0, None), "every one of the queries must be a string"),
        (("queries", ["a"], 0, None), "timeout must be a positive number of seconds, not 0"),
        (("pairs", ["a", "b"], 1.0, ["d"]), "one document per query"),
    ]
    for args, message in refused:
        with pytest.raises(ValueError, match=message):
            _check_request(*args)  # type: ignore[arg-type]


def test_raw_scores_only_when_asked() -> None:
    assert _raw(True) == {"raw_scores": True}
    assert _raw(False) is None
