"""The Python modules of the gateway's gRPC protos (TEI's ``tei.proto`` beside this file, the
fleet's own ``fleet_grpc/fleet.proto``), made by grpcio-tools' protoc:
``python -m embedfleet.gateway.tei_grpc.generate --write`` after a proto changes (a new copy of
TEI's, a field of the fleet's); ``--check`` says whether the committed modules are what protoc
makes now (tests/unit/gateway/tei_grpc/test_server.py runs it).

They are committed rather than made at install so that the gateway needs only grpcio and
protobuf at run time, not the compiler (grpcio-tools, a dev dependency). protoc runs from the
repository root with each proto's path as its name, so the generated modules import each other
as ``embedfleet.gateway.tei_grpc.tei_pb2`` (a bare ``import tei_pb2`` would not resolve in the
package).

Only the messages are generated (``_pb2.py``), not protoc's grpc plugin's ``_pb2_grpc.py``: the
services' servers and client stubs are read off the descriptors in the ``_pb2`` modules by one
module, gateway/grpc_services.py, rather than written out again for each method. Nor a ``.pyi``:
the type checker takes the messages' names as Any, as it does protobuf's and grpc's
(pyproject.toml's [tool.mypy])."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
ROOT = PACKAGE_DIR.parents[2]  # the folder that holds embedfleet/: protoc's include path
# every proto the gateway serves; each one's modules are written beside it
PROTOS = (PACKAGE_DIR / "tei.proto", PACKAGE_DIR.parent / "fleet_grpc" / "fleet.proto")


def modules_of(proto: Path) -> tuple[Path, ...]:
    """The modules protoc makes of ``proto``, where they are committed (beside it)."""
    stem = proto.parent / proto.stem
    return (Path(f"{stem}_pb2.py"),)


def generate(out: Path) -> dict[Path, str]:
    """Run protoc on the protos into ``out``; the generated modules' texts by the path each is
    committed at."""
    try:
        from grpc_tools import protoc
    except ImportError:
        raise SystemExit(
            "generating the gRPC modules needs grpcio-tools: pip install 'embedfleet[dev]'"
        ) from None
    names = " and ".join(proto.relative_to(ROOT).as_posix() for proto in PROTOS)
    status = protoc.main(
        [
            "grpc_tools.protoc",
            f"-I{ROOT}",
            f"--python_out={out}",
            # each one's name in the modules: its path under ROOT
            *(str(proto) for proto in PROTOS),
        ]
    )
    if status != 0:
        raise SystemExit(f"protoc failed on {names} (status {status}); its error is above")
    return {
        module: (out / module.relative_to(ROOT)).read_text()
        for proto in PROTOS
        for module in modules_of(proto)
    }


def stale() -> list[str]:
    """The committed modules that differ from what protoc makes of the proto now."""
    with tempfile.TemporaryDirectory() as scratch:
        fresh = generate(Path(scratch))
    return [
        module.relative_to(ROOT).as_posix()
        for module, text in fresh.items()
        if not module.is_file() or module.read_text() != text
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="write the modules beside each proto")
    mode.add_argument("--check", action="store_true", help="exit 1 if a module is out of date")
    args = parser.parse_args(argv)
    if args.write:
        with tempfile.TemporaryDirectory() as scratch:
            for module, text in generate(Path(scratch)).items():
                module.write_text(text)
        return 0
    out_of_date = stale()
    if out_of_date:
        print(
            f"out of date: {', '.join(out_of_date)}; run "
            "python -m embedfleet.gateway.tei_grpc.generate --write",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
