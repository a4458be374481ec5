"""The Batch API's files, in EMBEDFLEET_FILES_DIR: ``<id>.data`` and its ``<id>.json`` record.

Every write goes to a temporary name first and is renamed into place, so a reader (another
replica on the shared volume, or this one after a restart) sees a whole file or none.

A file with an ``expires_at`` in the past is gone for every reader at once (404, left out of
the list); ``sweep`` then frees its disk space, and that of temporary files a crashed writer
left behind.

Every file has an owner (gateway/auth.py: a hash of the API key that uploaded it, or of the key
whose batch wrote it). Given an ``owner``, ``get``, ``list`` and ``delete`` see only that owner's
files, and another owner's file is a 404 like a missing one, so its existence is not revealed.
A record written before owners existed belongs to ``ANONYMOUS``.

Every gateway of a namespace must share one files folder (one volume): the batches are in Redis,
so any replica runs any batch and answers for any file. Each folder has a tag of its own (made
once, kept in the folder: ``FOLDER_TAG_FILE``), and every file id carries the tag of the folder
that stored it, so a gateway asked for a file of another folder says that the folders are not
shared (``file_in_another_folder``), rather than that the file is missing, and its batch runner
leaves that file's batches to a gateway that has it (gateway/batch/runner.py).
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import IO, Any, Literal

from embedfleet.gateway.auth import ANONYMOUS
from embedfleet.gateway.errors import APIError

TEMP_PREFIX = ".tmp-"
# a temporary file nobody has written for this long belongs to a writer that died (a live
# writer touches its file as it goes; a whole batch output is written in one go)
STALE_TEMP_S = 3600
ID_PREFIX = "file-"
# ids sort by creation time: a list cursor (``after``) stays meaningful once its file is gone
_TIME_HEX = 16  # nanoseconds since the epoch, zero-padded hex
_TAG_HEX = 8  # the folder's tag, after the time (ids made before tags existed have none)
_RANDOM_HEX = 16
FOLDER_TAG_FILE = ".folder-tag"  # in the folder: its tag, made by the first gateway to use it


@dataclass(frozen=True)
class StoredFile:
    """OpenAI's File object."""

    id: str
    bytes: int
    created_at: int
    filename: str
    purpose: str
    object: str = "file"
    status: str = "processed"
    expires_at: int | None = None
    status_details: str | None = None
    owner: str = ANONYMOUS  # in the record, not in the API's File object

    def as_dict(self) -> dict[str, Any]:
        """The File object as the API shows it (without its owner)."""
        fields = asdict(self)
        del fields["owner"]
        return fields

    def record(self) -> dict[str, Any]:
        return asdict(self)

    def expired(self, now: float) -> bool:
        return self.expires_at is not None and self.expires_at <= now

    @property
    def order_key(self) -> tuple[int, str]:
        return (self.created_at, self.id)


def new_file_id(created_ns: int, folder_tag: str) -> str:
    return f"{ID_PREFIX}{created_ns:0{_TIME_HEX}x}{folder_tag}{uuid.uuid4().hex[:_RANDOM_HEX]}"


def folder_tag_of(file_id: str) -> str | None:
    """The tag of the folder that stored ``file_id``; None for an id without one (made before
    tags existed, or not by this store)."""
    rest = file_id.removeprefix(ID_PREFIX)
    if not file_id.startswith(ID_PREFIX) or len(rest) != _TIME_HEX + _TAG_HEX + _RANDOM_HEX:
        return None
    return rest[_TIME_HEX : _TIME_HEX + _TAG_HEX]


def order_key_of(file_id: str) -> tuple[int, str] | None:
    """Where ``file_id`` sits in the list without its record (it may have been deleted);
    None for an id this store did not make."""
    stamp = file_id.removeprefix(ID_PREFIX)[:_TIME_HEX]
    if not file_id.startswith(ID_PREFIX) or len(stamp) != _TIME_HEX:
        return None
    try:
        return (int(stamp, 16) // 1_000_000_000, file_id)
    except ValueError:
        return None


class FileStore:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    @functools.cached_property
    def folder_tag(self) -> str:
        """This folder's tag: read, or made by the first gateway to store a file in the folder
        (made under a temporary name and linked into place, so replicas agree on one)."""
        marker = self.root / FOLDER_TAG_FILE
        if not marker.is_file():
            with self.scratch("tag") as temp:
                temp.write_text(uuid.uuid4().hex[:_TAG_HEX])
                with contextlib.suppress(FileExistsError):  # another replica made it first
                    os.link(temp, marker)
        return marker.read_text().strip()

    def new_id(self) -> str:
        """A new file id of this folder (``publish`` under it, now or later)."""
        return new_file_id(time.time_ns(), self.folder_tag)

    def in_another_folder(self, file_id: str) -> bool:
        """Whether ``file_id`` was stored by a gateway whose files folder is not this one."""
        tag = folder_tag_of(file_id)
        return tag is not None and tag != self.folder_tag

    def another_folders_file(self, file_id: str, param: str = "file_id") -> APIError:
        """The answer for a file of another folder: 404, as for a missing file, saying why."""
        return APIError(
            404,
            f"the file {file_id!r} was stored by a gateway whose files folder is not this one's "
            f"({self.root}): every gateway of a namespace must share one files folder "
            "(EMBEDFLEET_FILES_DIR on one volume every replica mounts, ReadWriteMany; the "
            "chart's gateway.files.*), or the Batch API's files are found only on the gateway "
            "that stored them",
            param=param,
            code="file_in_another_folder",
        )

    def data_path(self, file_id: str) -> Path:
        return self.root / f"{file_id}.data"

    def _record_path(self, file_id: str) -> Path:
        return self.root / f"{file_id}.json"

    def temp_path(self, stem: str) -> Path:
        """A scratch path in the same directory (same filesystem, so rename is atomic)."""
        return self.root / f"{TEMP_PREFIX}{stem}-{uuid.uuid4().hex}"

    @contextlib.contextmanager
    def scratch(self, stem: str) -> Iterator[Path]:
        """A temporary path that is gone afterwards, whether it was published or not."""
        path = self.temp_path(stem)
        try:
            yield path
        finally:
            path.unlink(missing_ok=True)

    def publish(
        self,
        temp: Path,
        filename: str,
        purpose: str,
        expires_after_s: int | None = None,
        *,
        owner: str = ANONYMOUS,
        file_id: str | None = None,
    ) -> StoredFile:
        """Move a finished temporary file into place and record it; returns its File object.
        ``expires_after_s``: seconds from now until it expires (None: kept until deleted).
        ``file_id``: an id reserved beforehand (``new_id``); publishing under it again
        replaces the file, so a batch's output written twice is still one file."""
        if file_id is None:
            file_id = self.new_id()
        order = order_key_of(file_id)
        created_at = order[0] if order is not None else int(time.time())
        stored = StoredFile(
            id=file_id,
            bytes=temp.stat().st_size,
            created_at=created_at,
            filename=filename,
            purpose=purpose,
            expires_at=None if expires_after_s is None else created_at + expires_after_s,
            owner=owner,
        )
        with self.scratch("record") as record:
            record.write_text(json.dumps(stored.record()))
            os.replace(temp, self.data_path(stored.id))
            os.replace(record, self._record_path(stored.id))
        return stored

    def _read(self, path: Path) -> StoredFile | None:
        """The record at ``path``; None if it went away (deleted meanwhile)."""
        try:
            return StoredFile(**json.loads(path.read_text()))
        except FileNotFoundError:
            return None

    def get(self, file_id: str, owner: str | None = None) -> StoredFile:
        """The file's record; 404 if it is missing, expired or (given ``owner``) another's."""
        stored = None if "/" in file_id else self._read(self._record_path(file_id))
        if stored is None and self.in_another_folder(file_id):
            raise self.another_folders_file(file_id)
        if (
            stored is None
            or stored.expired(time.time())
            or (owner is not None and stored.owner != owner)
        ):
            raise APIError(
                404, f"no file with id {file_id!r}", param="file_id", code="file_not_found"
            )
        return stored

    def exists(self, file_id: str) -> bool:
        """Whether the file is there to read (not deleted, not expired)."""
        try:
            self.get(file_id)
        except APIError:
            return False
        return self.data_path(file_id).is_file()

    def _all(self) -> list[StoredFile]:
        records = (self._read(path) for path in self.root.glob(f"{ID_PREFIX}*.json"))
        return [stored for stored in records if stored is not None]

    def list(
        self,
        purpose: str | None = None,
        *,
        after: str | None = None,
        limit: int | None = None,
        order: Literal["asc", "desc"] = "desc",
        owner: str | None = None,
    ) -> tuple[list[StoredFile], bool]:
        """One page of the live files by creation time, and whether more follow it.

        ``after`` is the last id of the previous page; the page starts past it even if that
        file has since been deleted or expired."""
        now = time.time()
        files = [
            f
            for f in self._all()
            if not f.expired(now)
            and (purpose is None or f.purpose == purpose)
            and (owner is None or f.owner == owner)
        ]
        descending = order == "desc"
        files.sort(key=lambda f: f.order_key, reverse=descending)
        if after is not None:
            known = next((f for f in files if f.id == after), None)
            cursor = known.order_key if known else order_key_of(after)
            if cursor is None:
                raise APIError(400, f"after: no file with id {after!r}", param="after")
            files = [
                f for f in files if (f.order_key < cursor if descending else f.order_key > cursor)
            ]
        if limit is None:
            return files, False
        return files[:limit], len(files) > limit

    def delete(self, file_id: str, owner: str | None = None) -> None:
        self.get(file_id, owner)
        self._remove(file_id)

    def _remove(self, file_id: str) -> None:
        self._record_path(file_id).unlink(missing_ok=True)
        self.data_path(file_id).unlink(missing_ok=True)

    def sweep(self) -> tuple[int, int]:
        """Delete expired files and stale temporary files; (files, temporaries) removed.
        Safe on a volume several replicas share: each removal tolerates the others'."""
        now = time.time()
        expired = [f.id for f in self._all() if f.expired(now)]
        for file_id in expired:
            self._remove(file_id)
        stale = 0
        for path in self.root.glob(f"{TEMP_PREFIX}*"):
            with contextlib.suppress(FileNotFoundError):
                if now - path.stat().st_mtime > STALE_TEMP_S:
                    path.unlink()
                    stale += 1
        return len(expired), stale

    def lines(self, file_id: str, start_offset: int = 0) -> Iterator[tuple[int, bytes]]:
        """(byte offset after the line, line) from ``start_offset``; blank lines skipped."""
        with self.data_path(file_id).open("rb") as handle:
            handle.seek(start_offset)
            offset = start_offset
            for raw in handle:
                offset += len(raw)
                if raw.strip():
                    yield offset, raw


def bounded_lines(handle: IO[bytes], max_bytes: int) -> Iterator[bytes | None]:
    """Every line of ``handle`` (blank ones too, so callers can number them), but ``None`` for
    a line over ``max_bytes``: it is skipped in blocks, never held whole."""
    while raw := handle.readline(max_bytes + 1):
        if len(raw) <= max_bytes or (len(raw) == max_bytes + 1 and raw.endswith(b"\n")):
            yield raw
            continue
        while raw and not raw.endswith(b"\n"):  # the rest of the long line
            raw = handle.readline(1 << 20)
        yield None
