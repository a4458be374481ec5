"""JSONL input (producer/jsonl.py): valid lines become chunks; each bad line is recorded with
its number and why, and the file goes on."""

from __future__ import annotations

import io

from embedfleet.producer.jsonl import JSON_BYTES_PER_BYTE, BadLine, line_cap, read_chunks
from embedfleet.shared.protocol import DEFAULT_LIMITS, Chunk


def test_bad_lines_are_named_and_the_rest_read() -> None:
    data = (
        b'{"id": "a", "text": "one"}\n'
        b"\n"
        b"not json\n"
        b"[1, 2]\n"
        b'{"id": "b", "text": "\xff"}\n'
        b'{"id": "c", "text": "three"}'
    )
    rejected: list[BadLine] = []
    chunks = list(read_chunks(io.BytesIO(data), "j", rejected))
    assert [(c.id, c.text, c.job) for c in chunks] == [("a", "one", "j"), ("c", "three", "j")]
    assert [bad.line_number for bad in rejected] == [3, 4, 5]
    assert rejected[0].reason.startswith("not JSON")
    assert rejected[1].reason == "expected a JSON object"
    assert rejected[2].reason.startswith("not UTF-8: byte 0xff")


def test_a_line_over_the_cap_is_skipped_and_the_next_read() -> None:
    cap = line_cap(DEFAULT_LIMITS)
    assert cap == JSON_BYTES_PER_BYTE * DEFAULT_LIMITS.max_message_bytes
    data = b"x" * (cap + 10) + b"\n" + b'{"id": "after", "text": "t"}\n'
    rejected: list[BadLine] = []
    assert [c.id for c in read_chunks(io.BytesIO(data), None, rejected)] == ["after"]
    assert rejected[0].line_number == 1 and f"longer than {cap} bytes" in rejected[0].reason


def test_the_check_makes_a_refused_chunk_a_bad_line() -> None:
    def check(chunk: Chunk) -> None:
        if chunk.id == "no":
            raise ValueError("the model has no such prompt")

    data = b'{"id": "no", "text": "t"}\n{"id": "yes", "text": "t"}\n'
    rejected: list[BadLine] = []
    assert [c.id for c in read_chunks(io.BytesIO(data), None, rejected, check=check)] == ["yes"]
    assert rejected == [BadLine(1, "the model has no such prompt")]
