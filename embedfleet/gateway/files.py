"""The Batch API's files, in EMBEDFLEET_FILES_DIR: ``<id>.data`` and its ``<id>.json`` record.

Every write goes to a temporary name first and is renamed into place, so a reader (another
replica on the shared volume, or this one after a restart) sees a whole file or none.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from embedfleet.gateway.errors import APIError


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

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def new_file_id() -> str:
    return f"file-{uuid.uuid4().hex}"


class FileStore:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def data_path(self, file_id: str) -> Path:
        return self.root / f"{file_id}.data"

    def _record_path(self, file_id: str) -> Path:
        return self.root / f"{file_id}.json"

    def temp_path(self, stem: str) -> Path:
        """A scratch path in the same directory (same filesystem, so rename is atomic)."""
        return self.root / f".tmp-{stem}-{uuid.uuid4().hex}"

    def publish(self, temp: Path, filename: str, purpose: str) -> StoredFile:
        """Move a finished temporary file into place and record it; returns its File object."""
        file_id = new_file_id()
        stored = StoredFile(
            id=file_id,
            bytes=temp.stat().st_size,
            created_at=int(time.time()),
            filename=filename,
            purpose=purpose,
        )
        os.replace(temp, self.data_path(file_id))
        record = self.temp_path("record")
        record.write_text(json.dumps(stored.as_dict()))
        os.replace(record, self._record_path(file_id))
        return stored

    def get(self, file_id: str) -> StoredFile:
        path = self._record_path(file_id)
        if "/" in file_id or not path.is_file():
            raise APIError(
                404, f"no file with id {file_id!r}", param="file_id", code="file_not_found"
            )
        return StoredFile(**json.loads(path.read_text()))

    def list(self, purpose: str | None = None) -> list[StoredFile]:
        files = [
            StoredFile(**json.loads(path.read_text())) for path in self.root.glob("file-*.json")
        ]
        files = [f for f in files if purpose is None or f.purpose == purpose]
        return sorted(files, key=lambda f: (f.created_at, f.id), reverse=True)

    def delete(self, file_id: str) -> None:
        self.get(file_id)
        self._record_path(file_id).unlink(missing_ok=True)
        self.data_path(file_id).unlink(missing_ok=True)

    def lines(self, file_id: str, start_offset: int = 0) -> Iterator[tuple[int, bytes]]:
        """(byte offset after the line, line) from ``start_offset``; blank lines skipped."""
        with self.data_path(file_id).open("rb") as handle:
            handle.seek(start_offset)
            offset = start_offset
            for raw in handle:
                offset += len(raw)
                if raw.strip():
                    yield offset, raw
