"""workers/decode.py: stream entries become accepted chunks with their delivery, or rejections
with the protocol's reason code, the detail a person reads, and the payload to replay."""

from __future__ import annotations

import msgpack

from embedfleet.shared.dead_letters import DeadReason
from embedfleet.shared.migrations import COPIED_FROM
from embedfleet.shared.protocol import PAYLOAD_FIELD, Chunk, encode_chunk
from embedfleet.shared.settings import Settings
from embedfleet.workers.consumer import StreamEntry
from embedfleet.workers.decode import decode_entries


def entry(
    entry_id: str, payload: bytes | None, extra: dict[bytes, bytes] | None = None
) -> StreamEntry:
    fields = dict(extra or {})
    if payload is not None:
        fields[PAYLOAD_FIELD] = payload
    return StreamEntry("ingest", entry_id, payload, fields)


def test_valid_chunks_are_accepted_in_order_with_their_delivery() -> None:
    first = Chunk(id="a", text="one", job="j1", tenant="acme")
    second = Chunk(id="b", text="two")
    copied = {COPIED_FROM: b"old-ingest"}
    accepted, rejected = decode_entries(
        [entry("1-0", encode_chunk(first)), entry("2-0", encode_chunk(second), copied)],
        Settings(),
    )
    assert rejected == []
    assert [a.chunk for a in accepted] == [first, second]
    one, two = (a.delivery for a in accepted)
    assert (one.stream, one.entry_id, one.job, one.tenant, one.copy) == (
        "ingest",
        "1-0",
        "j1",
        "acme",
        False,
    )
    assert two.copy, "an entry a migration copied says so"


def test_an_entry_without_a_payload_names_the_fields_it_has() -> None:
    _, rejected = decode_entries([entry("1-0", None, {b"text": b"hello", b"id": b"x"})], Settings())
    (item,) = rejected
    assert (item.stream, item.entry_id, item.reason) == ("ingest", "1-0", DeadReason.NO_PAYLOAD)
    assert item.detail.endswith("it has: text, id")
    assert item.payload is None


def test_an_invalid_chunk_keeps_its_payload_and_what_it_could_read() -> None:
    payload = msgpack.packb({"v": 1, "id": "c1", "text": "", "job": "j"}, use_bin_type=True)
    accepted, rejected = decode_entries([entry("3-0", payload)], Settings())
    assert accepted == []
    (item,) = rejected
    assert item.reason is DeadReason.INVALID
    assert item.payload == payload, "kept whole, for a replay once fixed"
    assert item.chunk_id == "c1"


def test_a_payload_that_is_not_msgpack_is_refused_as_such() -> None:
    _, rejected = decode_entries([entry("4-0", b"\xc1 not msgpack")], Settings())
    assert [item.reason for item in rejected] == [DeadReason.NOT_MSGPACK]
