"""pgvector's pure parts (embedfleet/sinks/pgvector.py); the database side is in
tests/integration/sinks/test_sinks.py."""

from __future__ import annotations

from embedfleet.sinks.pgvector import vector_type_for


def test_halfvec_from_pgvector_0_7_on() -> None:
    assert vector_type_for("0.6.2") == "vector"
    assert vector_type_for("0.7.0") == "halfvec"
    assert vector_type_for("0.8.2") == "halfvec"
    assert vector_type_for("1.0") == "halfvec"
