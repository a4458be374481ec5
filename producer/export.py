"""Export vectors to .npz (arrays ``ids``, ``vectors``) or .jsonl (``{"id", "vector"}``), streamed.

The rows come from the results stream (the Redis sink) or from the vector database the workers
write (``VectorBackend.export_rows``): anything with an ``id`` and a float16 ``vector``. They are
written as they come, a page at a time, so the export holds one page in memory, not the job:

- .jsonl: one line per row, appended and flushed per page;
- .npz: the vectors go to a temporary raw file and the ids to another as they come; at the end
  the two are copied, in blocks, into the archive's ``vectors.npy`` and ``ids.npy`` members (an
  .npy header needs the row count and the longest id first). The archive appears under its name
  only once complete.

An export that fails midway (Redis away for longer than EMBEDFLEET_REDIS_RETRY_S, Ctrl-C) still
finishes its file with the rows written so far: a consuming export has acknowledged them. A
process killed outright leaves a .jsonl whole up to its last page, and an .npz's pages in its
two ``.part`` files (prefer .jsonl for a consuming export that must survive a kill).
"""

from __future__ import annotations

import json
import os
import zipfile
from collections.abc import Iterable
from pathlib import Path
from types import TracebackType
from typing import IO, Protocol

import numpy as np

SUPPORTED_SUFFIXES = (".npz", ".jsonl")
COPY_BLOCK = 1 << 20


class ExportRow(Protocol):
    @property
    def id(self) -> str: ...

    @property
    def vector(self) -> np.ndarray: ...


class ExportWriter:
    """``with ExportWriter(out) as writer: writer.write(page)``; ``writer.count`` at the end."""

    def __init__(self, out: Path) -> None:
        suffix = out.suffix.lower()
        if suffix not in SUPPORTED_SUFFIXES:
            raise ValueError(f"--out must end in .npz or .jsonl, got {out.name!r}")
        out.parent.mkdir(parents=True, exist_ok=True)
        self.out = out
        self.npz = suffix == ".npz"
        self.count = 0
        self._dim: int | None = None
        self._longest_id = 1
        self._done = False
        if self.npz:
            self._vectors: IO[bytes] = open(f"{out}.vectors.part", "wb")  # noqa: SIM115
            self._ids: IO[bytes] = open(f"{out}.ids.part", "wb")  # noqa: SIM115
        else:
            self._lines: IO[str] = out.open("w")

    def write(self, rows: Iterable[ExportRow], *, durable: bool = False) -> None:
        """Append one page of rows, flushed; ``durable`` (a consuming export, which acknowledges
        the page next): fsynced too, so an acknowledged page survives a crash of the machine."""
        self._write(rows)
        if durable:
            for handle in (self._vectors, self._ids) if self.npz else (self._lines,):
                os.fsync(handle.fileno())

    def _write(self, rows: Iterable[ExportRow]) -> None:
        if self.npz:
            for row in rows:
                vector = np.ascontiguousarray(row.vector, np.float16)
                if self._dim is None:
                    self._dim = int(vector.shape[0])
                elif vector.shape[0] != self._dim:
                    raise ValueError(
                        f"result {row.id!r} has dimension {vector.shape[0]}, the export so far "
                        f"{self._dim}: export one model's (or one dimensions') results per file"
                    )
                self._vectors.write(vector.tobytes())
                self._ids.write(json.dumps(row.id).encode() + b"\n")
                self._longest_id = max(self._longest_id, len(row.id))
                self.count += 1
            self._vectors.flush()
            self._ids.flush()
            return
        for row in rows:
            vector = np.asarray(row.vector, np.float32).tolist()
            self._lines.write(json.dumps({"id": row.id, "vector": vector}) + "\n")
            self.count += 1
        self._lines.flush()

    def close(self) -> int:
        """Finish the file; returns how many rows it holds."""
        if self._done:
            return self.count
        self._done = True
        if not self.npz:
            self._lines.close()
            return self.count
        self._vectors.close()
        self._ids.close()
        partial = Path(f"{self.out}.part")
        try:
            self._assemble(partial)
            os.replace(partial, self.out)
        finally:
            for name in (f"{self.out}.vectors.part", f"{self.out}.ids.part", str(partial)):
                Path(name).unlink(missing_ok=True)
        return self.count

    def abort(self) -> None:
        """After a failure: finish the file with the rows written so far (a consuming export
        has acknowledged them: they must not be lost), or remove it when there are none."""
        if self._done:
            return
        if self.count:
            self.close()
            return
        self._done = True
        if self.npz:
            self._vectors.close()
            self._ids.close()
            for name in (f"{self.out}.vectors.part", f"{self.out}.ids.part"):
                Path(name).unlink(missing_ok=True)
        else:
            self._lines.close()
            self.out.unlink(missing_ok=True)

    def _assemble(self, target: Path) -> None:
        """The archive np.savez writes (stored members ``ids.npy``, ``vectors.npy``), from the
        temporary files, in blocks."""
        id_dtype = np.dtype(f"<U{self._longest_id}")
        shape = (self.count, self._dim or 0)
        with zipfile.ZipFile(target, "w", zipfile.ZIP_STORED, allowZip64=True) as archive:
            with archive.open("ids.npy", "w", force_zip64=True) as member:
                _header(member, id_dtype, (self.count,))
                with open(f"{self.out}.ids.part", "rb") as ids:
                    block: list[str] = []
                    for line in ids:
                        block.append(json.loads(line))
                        if len(block) >= 10_000:
                            member.write(np.array(block, dtype=id_dtype).tobytes())
                            block = []
                    if block:
                        member.write(np.array(block, dtype=id_dtype).tobytes())
            with archive.open("vectors.npy", "w", force_zip64=True) as member:
                _header(member, np.dtype(np.float16), shape)
                with open(f"{self.out}.vectors.part", "rb") as vectors:
                    while chunk := vectors.read(COPY_BLOCK):
                        member.write(chunk)

    def __enter__(self) -> ExportWriter:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()


def _header(member: IO[bytes], dtype: np.dtype, shape: tuple[int, ...]) -> None:
    header = {"descr": np.lib.format.dtype_to_descr(dtype), "fortran_order": False, "shape": shape}
    np.lib.format.write_array_header_1_0(member, header)


def write_export(rows: Iterable[ExportRow], out: Path, page: int = 1000) -> int:
    """Write one vector per row, streamed a page at a time; returns how many."""
    with ExportWriter(out) as writer:
        batch: list[ExportRow] = []
        for row in rows:
            batch.append(row)
            if len(batch) >= page:
                writer.write(batch)
                batch = []
        writer.write(batch)
    return writer.count
