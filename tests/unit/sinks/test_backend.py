"""The backends' shared pure parts (embedfleet/sinks/backend.py): reciprocal-rank fusion and
a stored row's fields."""

from __future__ import annotations

import pytest

from embedfleet.sinks.backend import RRF_K, Hit, reciprocal_rank_fusion, row_fields


def _hit(chunk_id: str, score: float = 0.0) -> Hit:
    return Hit(id=chunk_id, job="j", model="m", truncated=False, meta=None, text=None, score=score)


def test_fusion_sums_the_reciprocal_ranks_best_first_ties_by_id() -> None:
    dense = [_hit("a", 0.9), _hit("b", 0.8), _hit("c", 0.7)]
    sparse = [_hit("c", 12.0), _hit("a", 3.0)]
    fused = reciprocal_rank_fusion([dense, sparse])
    assert [hit.id for hit in fused] == ["a", "c", "b"]
    assert fused[0].score == pytest.approx(1 / (RRF_K + 1) + 1 / (RRF_K + 2))
    assert fused[2].score == pytest.approx(1 / (RRF_K + 2))
    # one ranking each at rank 1: equal scores, ordered by id
    assert [h.id for h in reciprocal_rank_fusion([[_hit("z")], [_hit("y")]])] == ["y", "z"]


def test_row_fields_read_a_row_or_payload() -> None:
    record = {"id": 7, "job": "j", "model": "m", "truncated": 1, "text": "t", "other": "x"}
    assert row_fields(record, {"k": 1}) == {
        "id": "7",
        "job": "j",
        "model": "m",
        "truncated": True,
        "meta": {"k": 1},
        "text": "t",
    }
    assert row_fields({"id": "x"}, None)["text"] is None  # stored without text
    assert _hit("a", 0.1234567).as_dict()["score"] == 0.123457
