"""Qdrant's pure parts (embedfleet/sinks/qdrant.py); the database side is in
tests/integration/sinks/test_sinks.py."""

from __future__ import annotations

import uuid

from embedfleet.sinks.qdrant import point_id


def test_a_chunk_id_maps_to_the_same_uuid_every_time() -> None:
    first = point_id("doc#1")
    assert first == point_id("doc#1") != point_id("doc#2")
    assert uuid.UUID(first).version == 5
    assert first == str(uuid.uuid5(uuid.NAMESPACE_URL, "doc#1"))
