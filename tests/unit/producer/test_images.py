"""Images for `embedfleet enqueue` (producer/images.py): a JSON line's "image" (base64, a data
URI) or "image_path" becomes an image chunk with its reference; a folder gives one chunk per
image file, its id the path relative to the folder; a file unreadable, empty or over the cap is
refused with its reason and the others are still read."""

from __future__ import annotations

import base64
import io
import os
from pathlib import Path

import pytest

from embedfleet.producer.images import (
    BadFile,
    ImageFileError,
    decode_base64_image,
    folder_chunks,
    image_files,
    line_image_fields,
    read_image,
)
from embedfleet.producer.jsonl import BadLine, read_chunks
from embedfleet.shared.protocol import Chunk, ChunkLimits, decode_chunk, encode_chunk

PNG = b"\x89PNG\r\n\x1a\n" + bytes(range(40))  # bytes the producer sends as they are
LIMITS = ChunkLimits(max_image_bytes=100)


def test_a_file_is_read_whole_within_the_cap_and_refused_over_it(tmp_path: Path) -> None:
    (tmp_path / "ok.png").write_bytes(PNG)
    (tmp_path / "big.png").write_bytes(b"x" * 101)
    (tmp_path / "empty.png").write_bytes(b"")
    assert read_image(tmp_path / "ok.png", 100) == PNG
    with pytest.raises(ImageFileError, match=r"big\.png: 101 bytes, over the 100 limit"):
        read_image(tmp_path / "big.png", 100)
    with pytest.raises(ImageFileError, match=r"empty\.png: an empty file"):
        read_image(tmp_path / "empty.png", 100)
    with pytest.raises(ImageFileError, match=r"missing\.png: cannot be read: No such file"):
        read_image(tmp_path / "missing.png", 100)


def test_base64_and_data_uris_decode_and_bad_ones_say_why() -> None:
    encoded = base64.b64encode(PNG).decode()
    assert decode_base64_image(encoded, 100) == PNG
    assert decode_base64_image(f"data:image/png;base64,{encoded}", 100) == PNG
    with pytest.raises(ImageFileError, match="'image' is not base64"):
        decode_base64_image("not base64!", 100)
    with pytest.raises(ImageFileError, match="over the 10 limit"):
        decode_base64_image(encoded, 10)
    with pytest.raises(ImageFileError, match="got int"):
        decode_base64_image(5, 100)


def test_a_line_with_an_image_path_reads_it_from_the_base_folder(tmp_path: Path) -> None:
    (tmp_path / "cats").mkdir()
    (tmp_path / "cats" / "1.png").write_bytes(PNG)
    line = {"id": "c1", "image_path": "cats/1.png"}
    assert line_image_fields(line, tmp_path, 100) == {
        **line,
        "image": PNG,
        "image_ref": "cats/1.png",
    }
    own = {**line, "image_ref": "s3://photos/cats/1.png"}
    assert line_image_fields(own, tmp_path, 100)["image_ref"] == "s3://photos/cats/1.png"
    text = {"id": "t", "text": "a text"}
    assert line_image_fields(text, tmp_path, 100) is text  # a text line as it was
    with pytest.raises(ImageFileError, match="'image' or 'image_path', not both"):
        line_image_fields({**line, "image": "AAAA"}, tmp_path, 100)


def test_jsonl_image_lines_become_image_chunks_and_bad_files_bad_lines(tmp_path: Path) -> None:
    (tmp_path / "a.png").write_bytes(PNG)
    (tmp_path / "big.png").write_bytes(b"x" * 101)
    encoded = base64.b64encode(PNG).decode()
    data = (
        b'{"id": "a", "image_path": "a.png", "meta": {"page": 1}}\n'
        b'{"id": "big", "image_path": "big.png"}\n'
        b'{"id": "gone", "image_path": "gone.png"}\n'
        b'{"id": "inline", "image": "' + encoded.encode() + b'", "image_ref": "scan 4"}\n'
        b'{"id": "both", "text": "t", "image": "' + encoded.encode() + b'"}\n'
        b'{"id": "t", "text": "a text"}\n'
    )
    rejected: list[BadLine] = []
    chunks = list(read_chunks(io.BytesIO(data), "j", rejected, LIMITS, base=tmp_path))
    assert [(c.id, c.image, c.image_ref, c.text) for c in chunks] == [
        ("a", PNG, "a.png", ""),
        ("inline", PNG, "scan 4", ""),
        ("t", None, None, "a text"),
    ]
    assert chunks[0].meta == {"page": 1} and chunks[0].job == "j"
    assert [bad.line_number for bad in rejected] == [2, 3, 5]
    assert "big.png: 101 bytes, over the 100 limit" in rejected[0].reason
    assert "gone.png: cannot be read" in rejected[1].reason
    assert "'text' or 'image', not both" in rejected[2].reason
    # what the worker reads is what was read here, with its reference
    assert decode_chunk(encode_chunk(chunks[0])) == chunks[0]


def _folder(root: Path) -> Path:
    photos = root / "photos"
    for name in ("b/2.JPG", "b/1.png", "a.webp", "c/d/e.gif", "notes.txt", "big.png", "x.jpeg"):
        (photos / name).parent.mkdir(parents=True, exist_ok=True)
        (photos / name).write_bytes(b"x" * 101 if name == "big.png" else PNG)
    return photos


def test_a_folder_gives_its_images_in_path_order_and_counts_the_rest(tmp_path: Path) -> None:
    photos = _folder(tmp_path)
    os.symlink(photos, photos / "c" / "loop")  # a link to a folder is not followed
    files, others = image_files(photos)
    relative = [path.relative_to(photos).as_posix() for path in files]
    assert relative == ["a.webp", "b/1.png", "b/2.JPG", "big.png", "c/d/e.gif", "x.jpeg"]
    assert others == 1  # notes.txt (the link is a folder's, not a file)


def test_folder_chunks_are_read_as_sent_and_a_bad_file_does_not_stop_them(
    tmp_path: Path,
) -> None:
    photos = _folder(tmp_path)
    files, _ = image_files(photos)
    (photos / "x.jpeg").chmod(0)
    rejected: list[BadFile] = []

    def check(chunk: Chunk) -> None:
        if chunk.id == "a.webp":
            raise ValueError("this model embeds text only, not image input")

    chunks = list(folder_chunks(photos, files, "pics", rejected, LIMITS, check))
    readable = os.access(photos / "x.jpeg", os.R_OK)  # root reads any file
    assert [c.id for c in chunks] == ["b/1.png", "b/2.JPG", "c/d/e.gif"] + (
        ["x.jpeg"] if readable else []
    )
    assert all(c.image == PNG and c.job == "pics" and c.text == "" for c in chunks)
    assert chunks[0].image_ref == str(photos / "b" / "1.png")
    reasons = {Path(bad.path).name: bad.reason for bad in rejected}
    assert reasons["a.webp"] == "this model embeds text only, not image input"
    assert reasons["big.png"] == "101 bytes, over the 100 limit (EMBEDFLEET_MAX_IMAGE_BYTES)"
    if not readable:
        assert reasons["x.jpeg"].startswith("cannot be read: Permission denied")
