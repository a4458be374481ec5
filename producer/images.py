"""Images for `embedfleet enqueue` (issue 56): a JSON line's image fields, and a folder of
images, made into image chunks (shared/protocol.py ``Chunk.image``, ``Chunk.image_ref``).

A JSON line carries its image in one of two fields, in place of ``text``:

- ``"image"``: the encoded file in base64, or as a data URI (``data:image/png;base64,...``, what
  the gateway takes);
- ``"image_path"``: a file read here, a path relative to the JSON Lines file's folder (stdin's:
  the current folder) or absolute. The path as the line writes it becomes the chunk's
  ``image_ref`` (a database row stores it in place of a text) unless the line gives its own.

A folder (``embedfleet enqueue --images DIR``) gives one chunk per file under it whose name ends
in one of ``IMAGE_SUFFIXES`` (any case), in path order: its id is the path relative to the
folder (``/`` between its parts), its ``image_ref`` the path as the folder was given joined
with it. Other files are counted and skipped.

A file that cannot be read, is empty or is over EMBEDFLEET_MAX_IMAGE_BYTES is refused here with
its reason (a bad line, a bad file) and the others are still sent; whether its bytes decode is
the worker's check (a dead letter ``invalid``), as for an image from any other client.
"""

from __future__ import annotations

import base64
import binascii
import os
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from embedfleet.producer.chunks import as_chunk
from embedfleet.shared.protocol import DEFAULT_LIMITS, Chunk, ChunkLimits, over_image_limit

# the names of the files a folder's images are read from: the formats a worker decodes
# (shared/protocol.py IMAGE_FORMATS)
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".gif")
# a data URI's head: data:<media type>[;parameters];base64,
DATA_URI = re.compile(r"data:[^,;]*(;[^,;]*)*;base64,", re.IGNORECASE)


class ImageFileError(ValueError):
    """An image the producer cannot send: unreadable, empty, over the cap, not base64."""


@dataclass(frozen=True)
class BadFile:
    """A file of a folder not enqueued, and why."""

    path: str
    reason: str


def read_image(path: Path, max_bytes: int) -> bytes:
    """The bytes of the image file at ``path``, at most ``max_bytes`` of them (over: refused
    before they are read), or ImageFileError saying why not."""
    try:
        with path.open("rb") as file:
            size = os.fstat(file.fileno()).st_size
            data = b"" if size > max_bytes else file.read(max_bytes + 1)
    except OSError as error:
        raise ImageFileError(f"{path}: cannot be read: {error.strerror or error}") from None
    size = max(size, len(data))
    if size > max_bytes:
        raise ImageFileError(f"{path}: {over_image_limit(size, max_bytes)}")
    if not data:
        raise ImageFileError(f"{path}: an empty file")
    return data


def decode_base64_image(value: object, max_bytes: int) -> bytes:
    """A line's ``"image"``: base64 or a base64 data URI, decoded; at most ``max_bytes``."""
    if not isinstance(value, str) or not value:
        raise ImageFileError(
            "'image' must be the encoded file in base64 (or a data:image/...;base64, URI), "
            f"got {type(value).__name__}"
        )
    head = DATA_URI.match(value)
    encoded = value[head.end() :] if head else value
    if len(encoded) // 4 * 3 > max_bytes + 2:  # refused before it is decoded
        raise ImageFileError(
            f"'image' holds about {len(encoded) // 4 * 3} bytes, over the {max_bytes} limit "
            "(EMBEDFLEET_MAX_IMAGE_BYTES)"
        )
    try:
        data = base64.b64decode(encoded, validate=True)
    except (binascii.Error, ValueError) as error:
        raise ImageFileError(f"'image' is not base64: {error}") from None
    if not data:
        raise ImageFileError("'image' is empty")
    return data


def line_image_fields(item: Mapping[str, Any], base: Path, max_bytes: int) -> Mapping[str, Any]:
    """A JSON line with its image as bytes: ``"image"`` decoded from base64, or the file of
    ``"image_path"`` (relative to ``base``) read, its path the ``image_ref`` unless the line has
    one. A line without either is returned as it is."""
    path, image = item.get("image_path"), item.get("image")
    if path is None and image is None:
        return item
    if path is not None and image is not None:
        raise ImageFileError("a line carries 'image' or 'image_path', not both")
    if image is not None:
        return {**item, "image": decode_base64_image(image, max_bytes)}
    if not isinstance(path, str) or not path:
        raise ImageFileError(f"'image_path' must be a non-empty string, got {path!r}")
    data = read_image(base / path, max_bytes)
    return {**item, "image": data, "image_ref": item.get("image_ref", path)}


def image_files(folder: Path) -> tuple[list[Path], int]:
    """The image files under ``folder`` (by ``IMAGE_SUFFIXES``), in path order, and how many
    other files there are. Links to folders are not followed (a loop cannot trap the walk)."""
    found: list[Path] = []
    others = 0
    for root, folders, files in os.walk(folder):
        folders.sort()
        for name in sorted(files):
            if name.lower().endswith(IMAGE_SUFFIXES):
                found.append(Path(root, name))
            else:
                others += 1
    found.sort(key=lambda path: path.relative_to(folder).parts)
    return found, others


def folder_chunks(
    folder: Path,
    files: list[Path],
    job: str | None,
    rejected: list[BadFile],
    limits: ChunkLimits = DEFAULT_LIMITS,
    check: Callable[[Chunk], None] | None = None,
) -> Iterator[Chunk]:
    """One image chunk per file of ``files`` (under ``folder``), read as it is sent: its id the
    path relative to ``folder``, its ``image_ref`` the file's path. A file refused (unreadable,
    over the cap, or by ``check``: the options verifier against the served model) goes to
    ``rejected`` with its reason, and the others are still read."""
    for path in files:
        chunk_id = path.relative_to(folder).as_posix()
        try:
            data = read_image(path, limits.max_image_bytes)
            chunk = as_chunk(
                {"id": chunk_id, "image": data, "image_ref": str(path)}, job, limits=limits
            )
            if check is not None:
                check(chunk)
        except ValueError as error:  # ImageFileError, ProtocolError, the card's refusal
            rejected.append(BadFile(str(path), str(error).removeprefix(f"{path}: ")))
            continue
        yield chunk
