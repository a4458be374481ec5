"""shared/tokens.py: the producer's token ids on the wire, the tokenizer's fingerprint, and the
protocol's checks of the two fields (issue 53)."""

from __future__ import annotations

import json

import pytest

from embedfleet.shared.protocol import (
    MAX_TOKEN_IDS,
    Chunk,
    ProtocolError,
    chunk_from_mapping,
    decode_chunk,
    encode_chunk,
)
from embedfleet.shared.tokens import (
    ids_fingerprint,
    pack_token_ids,
    split_fingerprint,
    tokenizer_fingerprint,
    unpack_token_ids,
)


def test_ids_travel_as_little_endian_uint32() -> None:
    ids = [0, 101, 2**16 + 7, 2**32 - 1]
    packed = pack_token_ids(ids)
    assert packed[:8] == b"\x00\x00\x00\x00\x65\x00\x00\x00"
    assert unpack_token_ids(packed) == ids


def test_the_fingerprint_ignores_spacing_and_key_order_not_content() -> None:
    tokenizer = {"model": {"type": "WordPiece", "vocab": {"a": 0, "b": 1}}, "truncation": None}
    compact = json.dumps(tokenizer, separators=(",", ":"))
    spaced = json.dumps(dict(reversed(list(tokenizer.items()))), indent=2)
    assert tokenizer_fingerprint(compact) == tokenizer_fingerprint(spaced)
    other = {**tokenizer, "truncation": {"max_length": 257}}
    assert tokenizer_fingerprint(json.dumps(other)) != tokenizer_fingerprint(compact)


def test_a_prompt_is_named_in_the_ids_fingerprint() -> None:
    assert ids_fingerprint("t1-abc", "") == "t1-abc"
    with_prompt = ids_fingerprint("t1-abc", "query: ")
    assert with_prompt != ids_fingerprint("t1-abc", "passage: ")
    assert split_fingerprint(with_prompt)[0] == "t1-abc"
    assert split_fingerprint("t1-abc") == ("t1-abc", "")


def test_a_chunk_with_ids_survives_the_wire() -> None:
    chunk = Chunk("a", "hello", token_ids=pack_token_ids([101, 7592, 102]), tokenizer="t1-x")
    assert decode_chunk(encode_chunk(chunk)) == chunk


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"token_ids": pack_token_ids([1])}, "go together"),
        ({"tokenizer": "t1-x"}, "go together"),
        ({"token_ids": [101, 102], "tokenizer": "t1-x"}, "msgpack bin"),
        ({"token_ids": b"\x01\x02\x03", "tokenizer": "t1-x"}, "3 bytes"),
        ({"token_ids": b"", "tokenizer": "t1-x"}, "1 to"),
        ({"token_ids": b"\x00" * 4 * (MAX_TOKEN_IDS + 1), "tokenizer": "t1-x"}, "1 to"),
        ({"token_ids": pack_token_ids([1]), "tokenizer": ""}, "fingerprint"),
        ({"token_ids": pack_token_ids([1]), "tokenizer": 7}, "fingerprint"),
        ({"token_ids": pack_token_ids([1]), "tokenizer": "x" * 129}, "fingerprint"),
    ],
)
def test_malformed_ids_are_refused_with_the_reason(fields: dict[str, object], says: str) -> None:
    with pytest.raises(ProtocolError, match=says):
        chunk_from_mapping({"id": "a", "text": "hello", **fields})
