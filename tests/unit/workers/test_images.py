"""workers/images.py: decoding every format the protocol names, the model's own preprocessing on
the host's threads, each kind of bad image refused with its reason while the others go on, and
image vectors equal to ``get_image_features`` after the model's processor (parity)."""

from __future__ import annotations

import io
import struct
import zlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from embedfleet.shared.dead_letters import DeadReason
from embedfleet.shared.protocol import MAX_IMAGE_PIXELS
from embedfleet.workers.images import (
    FIRST_SLICED_BATCH,
    ImageBatches,
    ImagePipeline,
    ImageRefused,
    decode_image,
)
from embedfleet.workers.model.encoder import Encoder
from tests.image_models import (
    DUAL_FAMILIES,
    dual_model_dir,
    image_bytes,
    min_cosine,
    reference_image_features,
)

LIMIT = 1 << 20


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("dual-images")


@pytest.fixture(scope="module")
def threads() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(4) as pool:
        yield pool


def png_claiming(width: int, height: int) -> bytes:
    """A few dozen bytes of PNG whose header claims ``width`` x ``height`` grey pixels: what a
    decompression bomb shows before its pixels are decoded."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        crc = zlib.crc32(kind + data) & 0xFFFFFFFF
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", crc)

    header = struct.pack(">IIBBBBB", width, height, 8, 0, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", header)
        + chunk(b"IDAT", zlib.compress(b"\0" * 64))
        + chunk(b"IEND", b"")
    )


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF"])
def test_every_format_decodes_to_rgb(fmt: str) -> None:
    image = decode_image(image_bytes(1, (40, 30), fmt), LIMIT)
    assert image.mode == "RGB" and image.size == (40, 30)


def test_a_gif_gives_its_first_frame() -> None:
    frames = [Image.new("RGB", (8, 8), colour) for colour in ("red", "blue")]
    out = io.BytesIO()
    frames[0].save(out, format="GIF", save_all=True, append_images=frames[1:])
    first = decode_image(out.getvalue(), LIMIT)
    assert first.getpixel((0, 0)) == (255, 0, 0)


@pytest.mark.parametrize(
    ("data", "code", "fragment"),
    [
        (b"not an image at all", DeadReason.INVALID, "does not decode"),
        (image_bytes(2, (64, 64), "PNG")[:300], DeadReason.INVALID, "does not decode"),
        (image_bytes(3, (64, 64), "JPEG")[:200], DeadReason.INVALID, "does not decode"),
        (image_bytes(4, (8, 8), "BMP"), DeadReason.INVALID, "does not decode"),
        (png_claiming(7_000, 7_000), DeadReason.TOO_LARGE, "pixel bound"),
        (png_claiming(30_000, 30_000), DeadReason.TOO_LARGE, "decompression bomb"),
        (b"\x89PNG" + b"\0" * LIMIT, DeadReason.TOO_LARGE, "EMBEDFLEET_MAX_IMAGE_BYTES"),
    ],
    ids=["garbage", "truncated png", "truncated jpeg", "bmp", "bomb", "gigapixel bomb", "big"],
)
def test_a_bad_image_is_refused_with_its_reason(
    data: bytes, code: DeadReason, fragment: str
) -> None:
    assert len(png_claiming(30_000, 30_000)) < 200  # the bomb is small; its claim is not
    with pytest.raises(ImageRefused, match=fragment) as refused:
        decode_image(data, LIMIT)
    assert refused.value.code is code


def test_pillows_bound_is_the_protocols() -> None:
    assert Image.MAX_IMAGE_PIXELS == MAX_IMAGE_PIXELS


@pytest.mark.parametrize("family", DUAL_FAMILIES)
def test_preprocessing_is_the_processors_and_bad_images_leave_the_rest(
    models: Path, threads: ThreadPoolExecutor, family: str
) -> None:
    encoder = Encoder(str(dual_model_dir(family, models)), device="cpu", dtype="float32")
    good = [image_bytes(i, (30 + 7 * i, 50 - 3 * i), fmt) for i, fmt in enumerate(FORMATS)]
    images = [good[0], b"garbage", good[1], png_claiming(9_000, 9_000), *good[2:]]
    prepared = ImagePipeline(encoder.image_processor, threads, LIMIT).prepare(images)
    assert prepared.kept == [0, 2, 4, 5]
    assert {at: r.code for at, r in prepared.refused.items()} == {
        1: DeadReason.INVALID,
        3: DeadReason.TOO_LARGE,
    }
    opened = [Image.open(io.BytesIO(data)).convert("RGB") for data in good]
    expected = encoder.image_processor(images=opened, return_tensors="np")["pixel_values"]
    np.testing.assert_array_equal(prepared.pixels, expected)
    assert prepared.pixels.shape[1:] == (3, 32, 32)  # one shape: batches cut by count


FORMATS = ("PNG", "JPEG", "WEBP", "GIF")


@pytest.mark.parametrize("family", DUAL_FAMILIES)
@pytest.mark.parametrize(("dtype", "bar"), [("float32", 0.9999), ("bfloat16", 0.999)])
def test_image_vectors_equal_get_image_features(
    models: Path, threads: ThreadPoolExecutor, family: str, dtype: str, bar: float
) -> None:
    """The host pipeline and the image tower against transformers alone, float32: cos >=
    0.9999; in bfloat16 weights with the float16 vectors the fleet stores: >= 0.999."""
    model_dir = dual_model_dir(family, models)
    encoder = Encoder(str(model_dir), device="cpu", dtype=dtype)
    images = [image_bytes(10 + i, (24 + 9 * i, 60 - 5 * i), FORMATS[i % 4]) for i in range(12)]
    prepared = ImagePipeline(encoder.image_processor, threads, LIMIT).prepare(images)
    ours = np.concatenate(
        [
            encoder.embed_images(prepared.pixels[list(batch)])
            for batch in ImageBatches(max_batch=5, slice_seconds=0, layers=1).cut(12)
        ]
    ).astype(np.float16)
    reference = reference_image_features(model_dir, images)
    found = min_cosine(ours.astype(np.float32), reference)
    print(f"{family} {dtype}: min cosine {found:.6f}")
    assert found >= bar
    assert min_cosine(reference[:1], reference[1:2]) < 0.999  # the images' vectors differ


def test_batches_are_cut_by_count() -> None:
    unsliced = ImageBatches(max_batch=3, slice_seconds=0, layers=12)
    assert unsliced.cut(7) == [range(0, 3), range(3, 6), range(6, 7)]
    assert unsliced.cut(0) == []
    with pytest.raises(ValueError, match="at least one image"):
        ImageBatches(max_batch=0, slice_seconds=0, layers=1)


def test_where_queries_wait_a_batch_holds_what_a_layer_computes_within_the_slice() -> None:
    """On a CPU (a slice target) the first batch is small, to measure; then a batch holds as
    many images as one of the tower's layers computes within the target, by the smoothed cost
    per image, never more than the maximum nor fewer than one. On CUDA (no target): the
    maximum."""
    sizes = ImageBatches(max_batch=128, slice_seconds=0.1, layers=12)
    assert sizes.next_size() == FIRST_SLICED_BATCH
    assert sizes.layer_seconds(12) == 0, "nothing measured: no prediction"
    sizes.observe(4, 0.4)  # 0.1 s an image: a layer of 12 images takes 0.1 s
    assert sizes.next_size() == 12
    assert sizes.layer_seconds(12) == pytest.approx(0.1)
    sizes.observe(12, 0.6)  # cheaper in a larger batch: 0.05 s, smoothed to 0.085
    assert sizes.next_size() == int(0.1 * 12 / 0.085)
    sizes.observe(1, 100.0)  # a batch far slower (a loaded machine): one image at a time
    assert sizes.next_size() == 1
    fast = ImageBatches(max_batch=16, slice_seconds=0.1, layers=12)
    fast.observe(4, 0.004)
    assert fast.next_size() == 16, "never past EMBEDFLEET_MAX_BATCH"
    assert ImageBatches(max_batch=128, slice_seconds=0, layers=12).next_size() == 128
    assert ImageBatches.tower_layers(object()) == 1, "no image tower: nothing to slice by"
