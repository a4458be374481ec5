"""The generated gRPC modules' script (embedfleet/gateway/tei_grpc/generate.py): where each
proto and its module stand, what a module holds, and the script's two modes. Whether the
committed modules are fresh is checked by tests/unit/gateway/tei_grpc/test_server.py
(``stale()``)."""

from __future__ import annotations

import pytest

from embedfleet.gateway.fleet_grpc import fleet_pb2
from embedfleet.gateway.tei_grpc import tei_pb2
from embedfleet.gateway.tei_grpc.generate import PACKAGE_DIR, PROTOS, main, module_text


def test_teis_proto_is_vendored_apart_and_each_module_is_committed() -> None:
    third_party = PACKAGE_DIR / "third_party"
    assert {proto.name: module.name for proto, module in PROTOS.items()} == {
        "tei.proto": "tei_pb2.py",
        "fleet.proto": "fleet_pb2.py",
    }
    tei, fleet = PROTOS
    # only TEI's proto (and its licence note) is third-party: the module is ours, beside it
    assert tei.parent == third_party and (third_party / "NOTICE").is_file()
    assert PROTOS[tei].parent == PACKAGE_DIR and fleet.parent == PROTOS[fleet].parent
    assert all(path.is_file() for pair in PROTOS.items() for path in pair)


def test_a_module_is_its_protos_descriptor_made_into_messages() -> None:
    for module in (tei_pb2, fleet_pb2):
        text = module_text(module.DESCRIPTOR.serialized_pb)
        assert f"from {module.DESCRIPTOR.name}." in text
        # the same module made again: the descriptor round-trips through the module's text
        namespace: dict[str, object] = {"__name__": module.__name__}
        exec(compile(text, module.__file__, "exec"), namespace)
        assert namespace["DESCRIPTOR"] is module.DESCRIPTOR


def test_a_mode_is_required_and_only_one() -> None:
    for argv in ([], ["--write", "--check"]):
        with pytest.raises(SystemExit) as exited:
            main(argv)
        assert exited.value.code == 2
