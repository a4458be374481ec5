"""The generated gRPC modules' script (embedfleet/gateway/tei_grpc/generate.py): where each
proto's modules are committed, and its two modes. Whether they are fresh is checked by
tests/unit/gateway/tei_grpc/test_server.py (``stale()``)."""

from __future__ import annotations

import pytest

from embedfleet.gateway.tei_grpc.generate import PROTOS, main, modules_of


def test_each_protos_modules_are_committed_beside_it() -> None:
    assert [proto.name for proto in PROTOS] == ["tei.proto", "fleet.proto"]
    for proto in PROTOS:
        modules = modules_of(proto)
        assert [m.name for m in modules] == [
            f"{proto.stem}_pb2.py",
        ]
        assert all(m.parent == proto.parent and m.is_file() for m in modules)


def test_a_mode_is_required_and_only_one() -> None:
    for argv in ([], ["--write", "--check"]):
        with pytest.raises(SystemExit) as exited:
            main(argv)
        assert exited.value.code == 2
