"""The Batch API's bitmap of request lines refused on their own (gateway/batch/lines.py): which
lines the slices skip and the output step answers in the error file, kept in the batch's hash."""

from __future__ import annotations

from embedfleet.gateway.batch.lines import Refused


def test_refused_lines_round_trip_through_their_stored_form_and_count() -> None:
    refused = Refused()
    assert 0 not in refused and refused.count() == 0 and refused.count(below=100) == 0
    for number in (0, 7, 8, 19, 1000):
        refused.add(number)
    refused.add(19)  # twice: once
    stored = Refused.of(bytes(refused.bits))  # as the batch's hash gives it back
    assert [n for n in range(1100) if n in stored] == [0, 7, 8, 19, 1000]
    assert stored.count() == 5
    assert [stored.count(below=n) for n in (0, 1, 7, 8, 9, 19, 20, 1000, 1001, 5000)] == [
        0,
        1,
        1,
        2,
        3,
        3,
        4,
        4,
        5,
        5,
    ]
    assert len(stored.bits) == 1000 // 8 + 1  # a bit per line up to the last refused
    assert Refused.of(None).count() == 0 and 3 not in Refused.of(b"")
