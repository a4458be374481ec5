"""The Python modules of TEI's proto (``tei.proto`` beside this file), made by grpcio-tools'
protoc: ``python -m embedfleet.gateway.tei_grpc.generate --write`` after the proto changes (a
new copy of TEI's); ``--check`` says whether the committed modules are what protoc makes now
(tests/unit/gateway/test_tei_grpc_stubs.py runs it).

They are committed rather than made at install so that the gateway needs only grpcio and
protobuf at run time, not the compiler (grpcio-tools, a dev dependency). protoc runs from the
repository root with the proto's path as its name, so the generated modules import each other
as ``embedfleet.gateway.tei_grpc.tei_pb2`` (a bare ``import tei_pb2`` would not resolve in the
package)."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
ROOT = PACKAGE_DIR.parents[2]  # the folder that holds embedfleet/: protoc's include path
PROTO = PACKAGE_DIR / "tei.proto"
GENERATED = ("tei_pb2.py", "tei_pb2.pyi", "tei_pb2_grpc.py")


def generate(out: Path) -> dict[str, str]:
    """Run protoc on the proto into ``out``; the generated modules' texts by file name."""
    try:
        from grpc_tools import protoc
    except ImportError:
        raise SystemExit(
            "generating the gRPC modules needs grpcio-tools: pip install 'embedfleet[dev]'"
        ) from None
    name = PROTO.relative_to(ROOT).as_posix()
    status = protoc.main(
        [
            "grpc_tools.protoc",
            f"-I{ROOT}",
            f"--python_out={out}",
            f"--pyi_out={out}",
            f"--grpc_python_out={out}",
            str(PROTO),  # its name in the modules: its path under ROOT
        ]
    )
    if status != 0:
        raise SystemExit(f"protoc failed on {name} (status {status}); its error is above")
    made = out / PROTO.parent.relative_to(ROOT)
    return {file: (made / file).read_text() for file in GENERATED}


def stale() -> list[str]:
    """The committed modules that differ from what protoc makes of the proto now."""
    with tempfile.TemporaryDirectory() as scratch:
        fresh = generate(Path(scratch))
    return [
        file
        for file, text in fresh.items()
        if not (PACKAGE_DIR / file).is_file() or (PACKAGE_DIR / file).read_text() != text
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="write the modules beside the proto")
    mode.add_argument("--check", action="store_true", help="exit 1 if a module is out of date")
    args = parser.parse_args(argv)
    if args.write:
        with tempfile.TemporaryDirectory() as scratch:
            for file, text in generate(Path(scratch)).items():
                (PACKAGE_DIR / file).write_text(text)
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
