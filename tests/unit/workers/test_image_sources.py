"""workers/image_sources.py: an image sent by reference is read only from a place
EMBEDFLEET_IMAGE_SOURCES allows (a folder, after its links are resolved; an S3 bucket or prefix),
and a reference elsewhere, a missing file or one over the cap is refused with its reason.
Reads from a real S3-compatible server: tests/integration/workers/test_images.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from embedfleet.shared.dead_letters import DeadReason
from embedfleet.workers.image_sources import ImageSourceRefused, ImageSources

PNG = b"\x89PNG\r\n\x1a\n" + bytes(40)


def _places(root: Path) -> tuple[Path, Path]:
    allowed, elsewhere = root / "photos", root / "private"
    (allowed / "cats").mkdir(parents=True)
    elsewhere.mkdir()
    (allowed / "cats" / "1.png").write_bytes(PNG)
    (allowed / "big.png").write_bytes(b"x" * 101)
    (elsewhere / "secret.png").write_bytes(PNG)
    os.symlink(elsewhere / "secret.png", allowed / "escape.png")  # a link out of the folder
    return allowed, elsewhere


def test_a_file_under_an_allowed_folder_is_read_and_any_other_refused(tmp_path: Path) -> None:
    allowed, elsewhere = _places(tmp_path)
    sources = ImageSources([f" {allowed} ", "s3://bucket/photos"], max_bytes=100)
    assert sources.read(str(allowed / "cats" / "1.png")) == PNG
    refusals = {
        str(elsewhere / "secret.png"): "is outside the places EMBEDFLEET_IMAGE_SOURCES allows",
        str(allowed / "escape.png"): "is outside the places",
        str(allowed / "cats" / ".." / ".." / "private" / "secret.png"): "is outside the places",
        str(allowed / "missing.png"): "cannot be read: No such file",
        str(allowed / "cats"): "cannot be read",  # a folder
        "cats/1.png": "neither s3://bucket/key nor an absolute path",
    }
    for ref, reason in refusals.items():
        with pytest.raises(ImageSourceRefused, match=reason) as refused:
            sources.read(ref)
        assert refused.value.code is DeadReason.SOURCE
    with pytest.raises(ImageSourceRefused, match="is 101 bytes, over the 100 limit") as big:
        sources.read(str(allowed / "big.png"))
    assert big.value.code is DeadReason.TOO_LARGE


def test_s3_references_outside_the_buckets_and_prefixes_are_refused_unread() -> None:
    # refused before any S3 call: no server is needed (none is configured)
    sources = ImageSources(["s3://photos/2024/", "s3://scans"], max_bytes=100)
    for ref in (
        "s3://photos/2023/a.png",
        "s3://photos/2024",  # the prefix itself is no object under it
        "s3://photos/20245/a.png",  # a longer name, not the folder
        "s3://other/2024/a.png",
    ):
        with pytest.raises(ImageSourceRefused, match=r"outside the places .*s3://photos/2024"):
            sources.read(ref)
    for ref in ("s3://scans/", "s3://scans/a//b.png", "s3://photos/2024/../secret.png"):
        with pytest.raises(ImageSourceRefused, match="is not s3://bucket/key"):
            sources.read(ref)


def test_nothing_is_allowed_by_default_and_a_bad_place_stops_the_start() -> None:
    with pytest.raises(ImageSourceRefused, match=r"allows \(none: the setting is empty\)"):
        ImageSources([""], max_bytes=100).read("/etc/passwd")
    with pytest.raises(ValueError, match="'photos' is neither s3://bucket"):
        ImageSources(["photos"], max_bytes=100)
    with pytest.raises(ValueError, match="names no bucket"):
        ImageSources(["s3://"], max_bytes=100)
