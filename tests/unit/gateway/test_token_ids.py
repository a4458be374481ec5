"""OpenAI clients' token ids (embedfleet/gateway/token_ids.py): a ``.tiktoken`` file's ranks
read, a malformed line named, and the setting named when an encoding cannot be read. Decoding a
built encoding's ids is in tests/unit/gateway/test_drop_in_requests.py."""

from __future__ import annotations

import base64
from pathlib import Path

import pytest

from embedfleet.gateway.token_ids import TiktokenSettingError, read_ranks, tiktoken_ids_of


def _line(token: bytes, rank: int) -> bytes:
    return base64.b64encode(token) + b" " + str(rank).encode()


def test_ranks_are_read_line_by_line_blank_lines_skipped(tmp_path: Path) -> None:
    path = tmp_path / "tiny.tiktoken"
    path.write_bytes(b"\n".join([_line(b"a", 0), b"", _line(b"bc", 1)]) + b"\n")
    assert read_ranks(path) == {b"a": 0, b"bc": 1}


def test_a_malformed_line_is_named(tmp_path: Path) -> None:
    path = tmp_path / "bad.tiktoken"
    path.write_bytes(_line(b"a", 0) + b"\nnot-base64!! x\n")
    with pytest.raises(ValueError, match=r"bad\.tiktoken:2: not a tiktoken rank line"):
        read_ranks(path)
    with pytest.raises(TiktokenSettingError, match="EMBEDFLEET_GATEWAY_TIKTOKEN_ENCODING="):
        tiktoken_ids_of(str(path))


def test_unset_is_none() -> None:
    assert tiktoken_ids_of(None) is None and tiktoken_ids_of("") is None
