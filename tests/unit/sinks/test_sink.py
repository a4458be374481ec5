"""The sinks' shared parts (embedfleet/sinks/sink.py): one result per id in a batch, the last
written winning."""

from __future__ import annotations

import numpy as np

from embedfleet.shared.protocol import Result
from embedfleet.sinks.sink import latest_per_id


def _result(chunk_id: str, value: float) -> Result:
    return Result(id=chunk_id, model="m", vector=np.array([value], dtype=np.float16))


def test_an_id_written_twice_keeps_its_last_result() -> None:
    results = [_result("a", 1.0), _result("b", 2.0), _result("a", 3.0)]
    latest = latest_per_id(results)
    assert [(r.id, float(r.vector[0])) for r in latest] == [("a", 3.0), ("b", 2.0)]
    assert latest_per_id([]) == []
