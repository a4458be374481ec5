"""Images sent by reference (issue 56): an image chunk whose ``image_ref`` comes without bytes
is read by the worker, from a folder on its host or an S3 bucket, if EMBEDFLEET_IMAGE_SOURCES
allows that place.

``EMBEDFLEET_IMAGE_SOURCES`` lists the places, comma-separated: ``s3://bucket`` or
``s3://bucket/prefix`` (the keys under that prefix), and absolute folders (the files under them,
after every link is resolved: a link inside pointing outside is outside). S3 is read as the
Parquet store writes it (embedfleet/sinks/parquet/dataset.py ``s3_filesystem``):
``EMBEDFLEET_S3_ENDPOINT_URL`` for an S3-compatible server, credentials and region from the
``AWS_*`` variables. A reference outside every place, an object or file that is missing or
cannot be read is refused with its reason (dead letter ``source``); one over
EMBEDFLEET_MAX_IMAGE_BYTES is refused before it is read (``too_large``).

Reads run on the image pipeline's threads (workers/images.py), one image per task, never on the
event loop.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from embedfleet.shared.dead_letters import DeadReason
from embedfleet.shared.protocol import over_image_limit


class ImageSourceRefused(Exception):
    """A reference the worker will not read; ``code`` is its dead-letter reason."""

    def __init__(self, detail: str, code: DeadReason = DeadReason.SOURCE) -> None:
        super().__init__(detail)
        self.code = code


@dataclass(frozen=True)
class _Bucket:
    name: str
    prefix: str  # "" for the whole bucket, else without slashes at either end

    def holds(self, bucket: str, key: str) -> bool:
        if bucket != self.name:
            return False
        return not self.prefix or key.startswith(self.prefix + "/")


class ImageSources:
    """The places EMBEDFLEET_IMAGE_SOURCES allows, and the reads of references in them."""

    def __init__(self, places: Sequence[str], max_bytes: int, s3_endpoint_url: str = "") -> None:
        """``places``: as the setting lists them; a place of another form is a ValueError (the
        worker refuses to start on it)."""
        self.max_bytes = max_bytes
        self.s3_endpoint_url = s3_endpoint_url
        self.buckets: list[_Bucket] = []
        self.folders: list[str] = []
        for place in (p.strip() for p in places):
            if place.startswith("s3://"):
                bucket, _, prefix = place.removeprefix("s3://").partition("/")
                if not bucket:
                    raise ValueError(f"EMBEDFLEET_IMAGE_SOURCES: {place!r} names no bucket")
                self.buckets.append(_Bucket(bucket, prefix.strip("/")))
            elif os.path.isabs(place):
                self.folders.append(os.path.realpath(place))
            elif place:
                raise ValueError(
                    f"EMBEDFLEET_IMAGE_SOURCES: {place!r} is neither s3://bucket[/prefix] nor an "
                    "absolute folder"
                )
        self._s3: Any = None  # made on the first S3 read

    @classmethod
    def of(cls, settings: Any) -> ImageSources:
        """The places of ``settings`` (EMBEDFLEET_IMAGE_SOURCES), read with its image cap and
        the Parquet store's S3 endpoint."""
        return cls(
            settings.image_sources.split(","), settings.max_image_bytes, settings.s3_endpoint_url
        )

    def read(self, ref: str) -> bytes:
        """The bytes of the image at ``ref`` (``s3://bucket/key`` or an absolute path), or
        ImageSourceRefused saying why not."""
        if ref.startswith("s3://"):
            bucket, _, key = ref.removeprefix("s3://").partition("/")
            parts = key.split("/")
            if not key or any(part in ("", ".", "..") for part in parts):
                raise ImageSourceRefused(f"{ref!r} is not s3://bucket/key (a plain key)")
            if not any(place.holds(bucket, key) for place in self.buckets):
                raise self._outside(ref)
            return self._read_s3(ref, f"{bucket}/{key}")
        if not os.path.isabs(ref):
            raise ImageSourceRefused(
                f"{ref!r} is neither s3://bucket/key nor an absolute path on the worker's host"
            )
        path = os.path.realpath(ref)
        if not any(os.path.commonpath([folder, path]) == folder for folder in self.folders):
            raise self._outside(ref)
        return self._read_file(ref, path)

    def _outside(self, ref: str) -> ImageSourceRefused:
        allowed = ", ".join(
            [f"s3://{b.name}/{b.prefix}".rstrip("/") for b in self.buckets] + self.folders
        )
        return ImageSourceRefused(
            f"{ref!r} is outside the places EMBEDFLEET_IMAGE_SOURCES allows "
            f"({allowed or 'none: the setting is empty'})"
        )

    def _too_large(self, ref: str, size: int) -> ImageSourceRefused:
        return ImageSourceRefused(
            f"{ref!r} is {over_image_limit(size, self.max_bytes)}", DeadReason.TOO_LARGE
        )

    def _read_file(self, ref: str, path: str) -> bytes:
        try:
            with open(path, "rb") as file:
                size = os.fstat(file.fileno()).st_size
                if size > self.max_bytes:
                    raise self._too_large(ref, size)
                return file.read(self.max_bytes + 1)
        except OSError as error:
            raise ImageSourceRefused(f"{ref!r} cannot be read: {error.strerror or error}") from None

    def _read_s3(self, ref: str, path: str) -> bytes:
        import pyarrow.fs as pafs

        try:
            if self._s3 is None:
                from embedfleet.sinks.parquet.dataset import s3_filesystem

                self._s3 = s3_filesystem(self.s3_endpoint_url)
            info = self._s3.get_file_info(path)
            if info.type != pafs.FileType.File:
                raise ImageSourceRefused(f"{ref!r}: no such object")
            if info.size is not None and info.size > self.max_bytes:
                raise self._too_large(ref, info.size)
            with self._s3.open_input_stream(path) as stream:
                return bytes(stream.read(self.max_bytes + 1))
        except OSError as error:
            raise ImageSourceRefused(f"{ref!r} cannot be read: {error}") from None
