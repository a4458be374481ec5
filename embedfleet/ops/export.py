"""Export vectors to .npz (arrays ``ids``, ``vectors``) or .jsonl (``{"id", "vector"}``), streamed.

The rows come from the results stream (the Redis sink) or from the vector database the workers
write (``VectorBackend.export_rows``): anything with an ``id`` and a float16 ``vector``. They are
written as they come, a page at a time, so the export holds one page in memory, not the job:

- .jsonl: one line per row; a page's lines go to the file in one write, flushed;
- .npz: the vectors go to a temporary raw file and the ids to another as they come; at the end
  the two are copied, in blocks, into the archive's ``vectors.npy`` and ``ids.npy`` members (an
  .npy header needs the row count and the longest id first). The archive appears under its name
  only once complete.

A consuming export (``resume``) deletes each page from Redis once it is written: the file is
then the page's only copy, so it is never destroyed (issue 40):

- each page is fsynced before the caller acknowledges it (``durable``);
- a .jsonl is added to, never truncated: a run after a crash (or any later run) appends after
  what is there. A page is one write, so a kill leaves whole lines, except when it lands inside
  that write (a page not yet acknowledged): the next run cuts that torn tail before adding;
- an .npz cannot be added to: a killed run's two ``.part`` files are taken up by the next run
  and the archive is assembled from all of them at its end; a finished archive under the name
  is refused (``ExportFileError``): give each run its own file;
- a page written whole but not acknowledged at a kill is in the file and still pending: the
  next run takes it back first, and would write it a second time (issue 54: 20,200 rows for
  20,000 ids after two kills). Before each page, its stream entries and where the file ended
  are recorded in ``FILE.page`` (fsynced); a page the next run reads that shares an entry with
  the recorded one is that page again, unacknowledged, so the file is cut back to where it
  began and the page written once more: each id once, whichever moment the kill came at;
- one export writes a file at a time (the file is locked): a second is refused.

An export that fails midway (Redis away for longer than EMBEDFLEET_REDIS_RETRY_S, Ctrl-C) still
finishes its file with the rows written so far: a consuming export has acknowledged them.
"""

from __future__ import annotations

import json
import os
import zipfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Protocol

import numpy as np

try:
    import fcntl
except ImportError:  # Windows: no advisory lock (and no directory fsync)
    fcntl = None  # type: ignore[assignment]

SUPPORTED_SUFFIXES = (".npz", ".jsonl")
COPY_BLOCK = 1 << 20


class ExportRow(Protocol):
    @property
    def id(self) -> str: ...

    @property
    def vector(self) -> np.ndarray: ...


@dataclass(frozen=True)
class PageMark:
    """The page being written, recorded before its rows (``FILE.page``): its stream entries, and
    where the file ended before it (rows, and bytes of the .jsonl or of the .npz's ids part)."""

    stream: str
    entries: frozenset[str]
    rows: int
    size: int

    def to_json(self) -> bytes:
        fields = {"stream": self.stream, "entries": sorted(self.entries)}
        return json.dumps({**fields, "rows": self.rows, "size": self.size}).encode()

    @classmethod
    def read(cls, path: Path) -> PageMark | None:
        """The mark a killed run left, or None: none, or torn (the kill came while it was
        written, before that page's rows: nothing to cut back)."""
        try:
            fields = json.loads(path.read_bytes())
            return cls(
                str(fields["stream"]),
                frozenset(map(str, fields["entries"])),
                int(fields["rows"]),
                int(fields["size"]),
            )
        except (OSError, ValueError, KeyError, TypeError):
            return None


class ExportFileError(Exception):
    """The output file cannot be written without destroying what is there (or another export
    is writing it); the message says what to do."""


class ExportWriter:
    """``with ExportWriter(out) as writer: writer.write(page)``; ``writer.count`` at the end.

    ``resume`` (a consuming export): keep what earlier runs wrote to ``out`` and add to it
    (``writer.earlier`` rows); without it the file is written from scratch."""

    def __init__(self, out: Path, *, resume: bool = False) -> None:
        suffix = out.suffix.lower()
        if suffix not in SUPPORTED_SUFFIXES:
            raise ValueError(f"--out must end in .npz or .jsonl, got {out.name!r}")
        out.parent.mkdir(parents=True, exist_ok=True)
        self.out = out
        self.npz = suffix == ".npz"
        self.count = 0  # rows this run wrote
        self.earlier = 0  # rows earlier runs wrote, kept (resume)
        self._dim: int | None = None
        self._longest_id = 1
        self._done = False
        # the page a killed run recorded before its rows (resume): cut back to if read again
        self._mark_path = Path(f"{out}.page")
        self._killed_page: PageMark | None = None
        self._mark_fd: int | None = None
        if self.npz:
            self._vectors_path = Path(f"{out}.vectors.part")
            self._ids_path = Path(f"{out}.ids.part")
            self._open_parts(resume)
        else:
            self._fd = _open_locked(out)
            if resume:
                self.earlier = _cut_torn_tail(self._fd)
            else:
                os.ftruncate(self._fd, 0)
        if resume:
            self._killed_page = PageMark.read(self._mark_path)
            _fsync_dir(out.parent)  # the file's name survives a crash of the machine too
        else:
            self._mark_path.unlink(missing_ok=True)  # written afresh: nothing to cut back to

    @property
    def total(self) -> int:
        """Rows the file holds: the earlier runs' and this one's."""
        return self.earlier + self.count

    def _open_parts(self, resume: bool) -> None:
        # pages a killed run left: a consuming export's only copy of them
        kept = self._ids_path.exists() and self._ids_path.stat().st_size > 0
        if kept and not resume:
            raise ExportFileError(
                f"{self._ids_path} and {self._vectors_path.name} hold the pages of an unfinished "
                f"export (a consuming export's only copy of them): finish it with `embedfleet "
                f"results --consume --out {self.out}`, or move them away"
            )
        if not kept and resume and self.out.exists():
            raise ExportFileError(
                f"{self.out} exists and an .npz cannot be added to: it holds results an earlier "
                "consuming export took from Redis (their only copy). Give this export another "
                "--out (or use .jsonl, which a consuming export appends to)"
            )
        self._ids_fd = _open_locked(self._ids_path)  # the lock: one export per file
        self._vectors_fd = os.open(
            self._vectors_path,
            os.O_RDWR | os.O_CREAT | os.O_APPEND | getattr(os, "O_BINARY", 0),
            0o644,
        )
        if kept:
            self._recover_parts()
        else:
            os.ftruncate(self._vectors_fd, 0)

    def _recover_parts(self) -> None:
        """Take up a killed run's pages: the rows both parts hold whole. A page's vectors are
        written before its ids, so a whole id line has its vector (unless the machine crashed
        before the page was synced: then it was not acknowledged either, and is read again)."""
        rows, offset = 0, 0
        with open(self._ids_path, "rb") as ids:
            header = ids.readline()  # {"dim": D}, written before the first id
            if header.endswith(b"\n"):
                self._dim = int(json.loads(header)["dim"])
                offset = len(header)
                whole_vectors = os.fstat(self._vectors_fd).st_size // (2 * self._dim)
                for line in ids:
                    if rows == whole_vectors or not line.endswith(b"\n"):
                        break  # the rest was being written at the kill: not acknowledged
                    rows += 1
                    offset += len(line)
                    self._longest_id = max(self._longest_id, len(json.loads(line)))
        if rows == 0:
            self._dim, offset = None, 0
        os.ftruncate(self._ids_fd, offset)
        os.ftruncate(self._vectors_fd, rows * 2 * (self._dim or 0))
        os.fsync(self._ids_fd)
        os.fsync(self._vectors_fd)
        self.earlier = rows

    def _release_parts(self) -> None:
        os.close(self._vectors_fd)
        os.close(self._ids_fd)

    def write(
        self,
        rows: Iterable[ExportRow],
        *,
        durable: bool = False,
        entries: tuple[str, Sequence[bytes | str]] | None = None,
    ) -> None:
        """Append one page of rows, in one write per file; ``durable`` (a consuming export,
        which acknowledges the page next): fsynced too, so an acknowledged page survives a
        crash of the machine. ``entries`` (a consuming export): the stream and entry ids the
        page was read from, recorded first, so that a run after a kill before the page's
        acknowledgement writes it once (the module's docstring)."""
        if entries is not None:
            stream, ids = entries
            taken = frozenset(i.decode() if isinstance(i, bytes) else i for i in ids)
            killed = self._killed_page
            if killed is not None and killed.stream == stream and killed.entries & taken:
                self._cut_back(killed)  # the killed run's page again: it is in the file
            self._killed_page = None  # only the first page a run reads can be that one
            self._mark(PageMark(stream, taken, self.total, self._size()))
        if self.npz:
            self._write_npz(rows, durable)
            return
        lines = [
            json.dumps({"id": row.id, "vector": np.asarray(row.vector, np.float32).tolist()})
            for row in rows
        ]
        if not lines:
            return
        # one write of whole lines: Python's own buffer would reach the file in 8 KiB pieces
        # while the page is being formatted, so a kill mid-page left a torn line
        _write_all(self._fd, ("\n".join(lines) + "\n").encode())
        self.count += len(lines)
        if durable:
            os.fsync(self._fd)

    def _size(self) -> int:
        """Bytes of the .jsonl, or of the .npz's ids part (its vectors follow from the rows)."""
        return os.fstat(self._ids_fd if self.npz else self._fd).st_size

    def _mark(self, mark: PageMark) -> None:
        """``mark`` in ``FILE.page``, on disk before the page's rows are written. Overwritten
        in place: a torn mark reads as none (it was being written before its page's rows)."""
        if self._mark_fd is None:
            self._mark_fd = os.open(self._mark_path, os.O_RDWR | os.O_CREAT, 0o644)
        os.ftruncate(self._mark_fd, 0)
        _write_at(self._mark_fd, mark.to_json())
        os.fsync(self._mark_fd)

    def _cut_back(self, mark: PageMark) -> None:
        """The file as it was before the killed run's unacknowledged page (the rows before it
        were acknowledged and stay; the page comes again)."""
        rows, size = min(mark.rows, self.total), min(mark.size, self._size())
        if self.npz:
            if rows == 0:
                self._dim, size = None, 0  # its header line goes too: the page writes it again
            os.ftruncate(self._ids_fd, size)
            os.ftruncate(self._vectors_fd, rows * 2 * (self._dim or 0))
            os.fsync(self._vectors_fd)
            os.fsync(self._ids_fd)
        else:
            os.ftruncate(self._fd, size)
            os.fsync(self._fd)
        self.earlier = rows - self.count  # a run's first page: this run wrote none yet

    def _release_mark(self, *, keep: bool) -> None:
        """Close ``FILE.page``; removed unless ``keep`` (an export that failed: its last page
        may be unacknowledged, and a run to the same .jsonl must know it)."""
        if self._mark_fd is not None:
            os.close(self._mark_fd)
            self._mark_fd = None
        if not keep:
            self._mark_path.unlink(missing_ok=True)

    def _write_npz(self, rows: Iterable[ExportRow], durable: bool) -> None:
        vectors: list[bytes] = []
        ids: list[bytes] = []
        header = self._dim is None  # the first page of the parts
        for row in rows:
            vector = np.ascontiguousarray(row.vector, np.float16)
            if self._dim is None:
                self._dim = int(vector.shape[0])
            elif vector.shape[0] != self._dim:
                raise ValueError(
                    f"result {row.id!r} has dimension {vector.shape[0]}, the export so far "
                    f"{self._dim}: export one model's (or one dimensions') results per file"
                )
            vectors.append(vector.tobytes())
            ids.append(json.dumps(row.id).encode() + b"\n")
            self._longest_id = max(self._longest_id, len(row.id))
        if not ids:
            return
        if header:  # the dimension, for a later run that takes up these parts
            ids.insert(0, json.dumps({"dim": self._dim}).encode() + b"\n")
        # the page's vectors before its ids: a whole id line always has its vector
        _write_all(self._vectors_fd, b"".join(vectors))
        _write_all(self._ids_fd, b"".join(ids))
        self.count += len(vectors)
        if durable:
            os.fsync(self._vectors_fd)
            os.fsync(self._ids_fd)

    def close(self) -> int:
        """Finish the file; returns how many rows it holds."""
        if self._done:
            return self.total
        return self._finish(keep_mark=False)

    def _finish(self, *, keep_mark: bool) -> int:
        self._done = True
        if not self.npz:
            self._release_mark(keep=keep_mark)
            os.close(self._fd)
            return self.total
        partial = Path(f"{self.out}.part")
        try:
            self._assemble(partial)
            os.replace(partial, self.out)
            _fsync_dir(self.out.parent)
        finally:
            self._release_parts()
            partial.unlink(missing_ok=True)
        # only once the archive is in place: the parts were the pages' only copy until then
        self._ids_path.unlink(missing_ok=True)
        self._vectors_path.unlink(missing_ok=True)
        # an archive is never resumed (a consuming run refuses it): its mark is of no use
        self._release_mark(keep=False)
        return self.total

    def abort(self) -> None:
        """After a failure: finish the file with the rows written so far (a consuming export
        has acknowledged them: they must not be lost), or remove it when there are none."""
        if self._done:
            return
        if self.total:
            # the last page may be unacknowledged (Redis away before its XACK): a .jsonl keeps
            # its mark, so a run after this one does not write that page twice
            self._finish(keep_mark=True)
            return
        self._done = True
        self._release_mark(keep=False)
        if self.npz:
            self._release_parts()
            self._vectors_path.unlink(missing_ok=True)
            self._ids_path.unlink(missing_ok=True)
        else:
            os.close(self._fd)
            self.out.unlink(missing_ok=True)

    def _assemble(self, target: Path) -> None:
        """The archive np.savez writes (stored members ``ids.npy``, ``vectors.npy``), from the
        temporary files, in blocks."""
        id_dtype = np.dtype(f"<U{self._longest_id}")
        shape = (self.total, self._dim or 0)
        with zipfile.ZipFile(target, "w", zipfile.ZIP_STORED, allowZip64=True) as archive:
            with archive.open("ids.npy", "w", force_zip64=True) as member:
                _header(member, id_dtype, (self.total,))
                with open(self._ids_path, "rb") as ids:
                    block: list[str] = []
                    for line in ids:
                        value = json.loads(line)
                        if isinstance(value, dict):  # the parts' header line
                            continue
                        block.append(value)
                        if len(block) >= 10_000:
                            member.write(np.array(block, dtype=id_dtype).tobytes())
                            block = []
                    if block:
                        member.write(np.array(block, dtype=id_dtype).tobytes())
            with archive.open("vectors.npy", "w", force_zip64=True) as member:
                _header(member, np.dtype(np.float16), shape)
                with open(self._vectors_path, "rb") as vectors:
                    while chunk := vectors.read(COPY_BLOCK):
                        member.write(chunk)
        with open(target, "rb") as archive_file:
            os.fsync(archive_file.fileno())  # whole on disk before it replaces anything

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


def _open_locked(path: Path) -> int:
    """``path`` open for writing at its end, created if missing, nothing truncated yet, and
    locked: two exports writing one file would interleave (and a consuming export's reader is
    named after its file, so they would also share one reader's pages)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_APPEND | getattr(os, "O_BINARY", 0), 0o644)
    if fcntl is None:
        return fd
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ExportFileError(
            f"another export is writing {path}: wait for it to end, or choose another --out"
        ) from None
    return fd


def _cut_torn_tail(fd: int) -> int:
    """Cut a partial last line (a page a killed run was writing, not acknowledged: it is read
    again) and return how many whole lines remain."""
    size = os.fstat(fd).st_size
    end = size
    while end > 0:
        start = max(0, end - COPY_BLOCK)
        block = os.pread(fd, end - start, start)
        newline = block.rfind(b"\n")
        if newline >= 0:
            end = start + newline + 1
            break
        end = start
    if end < size:
        os.ftruncate(fd, end)
        os.fsync(fd)
    lines, offset = 0, 0
    while offset < end:
        block = os.pread(fd, min(COPY_BLOCK, end - offset), offset)
        lines += block.count(b"\n")
        offset += len(block)
    return lines


def _write_at(fd: int, data: bytes, offset: int = 0) -> None:
    view, at = memoryview(data), offset
    while view:
        written = os.pwrite(fd, view, at)
        view, at = view[written:], at + written


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _fsync_dir(folder: Path) -> None:
    """The folder's entries on disk (a file's new name, an archive renamed into place)."""
    if fcntl is None:
        return
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
