"""The host's side of image chunks: decode, then preprocess as the model's image processor does.

An image chunk (shared/protocol.py ``Chunk.image``) carries an encoded file. Here it is decoded
with Pillow (JPEG, PNG, WebP, a GIF's first frame), converted to RGB and handed to the model's
own image processor (``CLIPImageProcessor``, ``SiglipImageProcessor``: resize, crop, rescale,
normalise), one image per task on a pool of the host's threads: Pillow's decoders and resizes
and numpy's arithmetic release the GIL, so the host's cores work side by side, and the event
loop is never held. Every image has the same shape afterwards, so batches are cut by count.

An image sent by reference (``image_ref`` alone) is read first, on the same threads, from a
place EMBEDFLEET_IMAGE_SOURCES allows (workers/image_sources.py; refused: ``source``).

Bad input loses nothing: a file that does not decode or is truncated (``invalid``), one over
``EMBEDFLEET_MAX_IMAGE_BYTES`` or one whose header promises more than ``MAX_IMAGE_PIXELS``
pixels (a decompression bomb: a small file that expands to gigapixels; ``too_large``) is
refused with its reason before its pixels are held, and the other images go on.
"""

from __future__ import annotations

import io
import warnings
from collections.abc import Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image, UnidentifiedImageError

from embedfleet.shared.dead_letters import DeadReason
from embedfleet.shared.protocol import IMAGE_FORMATS, MAX_IMAGE_PIXELS, Chunk, over_image_limit
from embedfleet.sinks import Delivery
from embedfleet.workers.cpus import usable_cpus
from embedfleet.workers.dead_letter_writer import Rejected
from embedfleet.workers.decode import Accepted
from embedfleet.workers.image_sources import ImageSourceRefused, ImageSources
from embedfleet.workers.model.tokenizer import Tokenized

# Pillow's own bound, set explicitly rather than left to its default: it raises
# DecompressionBombError past twice this; ours (below) refuses past it, from the header alone
Image.MAX_IMAGE_PIXELS = MAX_IMAGE_PIXELS
# Pillow warns past its bound; the check below refuses those images before they are loaded,
# so the warning would only repeat it (set once here: warning filters are process-wide)
warnings.simplefilter("ignore", Image.DecompressionBombWarning)
# what Pillow raises for a file it cannot read: unknown or corrupt data, a truncated file
_UNREADABLE = (UnidentifiedImageError, OSError, ValueError, SyntaxError, EOFError)


class ImageRefused(Exception):
    """An image the worker will not embed; ``code`` is its dead-letter reason."""

    def __init__(self, detail: str, code: DeadReason) -> None:
        super().__init__(detail)
        self.code = code


def decode_image(data: bytes, max_bytes: int) -> Image.Image:
    """``data`` decoded to an RGB image (a GIF or an animated WebP: its first frame), or
    :class:`ImageRefused` saying why not."""
    if len(data) > max_bytes:
        raise ImageRefused(
            f"the image is {over_image_limit(len(data), max_bytes)}", DeadReason.TOO_LARGE
        )
    try:
        image = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
        width, height = image.size
        if width * height > MAX_IMAGE_PIXELS:
            raise ImageRefused(_bomb(width, height), DeadReason.TOO_LARGE)
        image.load()  # the first frame, decoded whole: a truncated file raises here
        return image.convert("RGB")
    except Image.DecompressionBombError as error:
        raise ImageRefused(str(error), DeadReason.TOO_LARGE) from None
    except _UNREADABLE as error:
        raise ImageRefused(
            f"the image does not decode as {', '.join(IMAGE_FORMATS)}: {error}",
            DeadReason.INVALID,
        ) from None


def _bomb(width: int, height: int) -> str:
    return (
        f"the image is {width} x {height} pixels, over the {MAX_IMAGE_PIXELS:,}-pixel bound "
        "(a decompression bomb, or a photo far larger than any model sees)"
    )


@dataclass
class Prepared:
    """A list of images preprocessed: ``pixels`` holds one row per image kept (``kept``: their
    positions in the list), ``refused`` the others' positions and reasons."""

    pixels: np.ndarray  # (len(kept), channels, height, width), float32
    kept: list[int]
    refused: dict[int, ImageRefused]


# an image chunk's row for the writer, which reads a text's tokens for its truncated flag
NO_TOKENS = Tokenized(ids=(), truncated=False)


@dataclass
class ImageRows:
    """A window's image chunks, preprocessed: one row of ``pixels`` per chunk."""

    chunks: list[Chunk]
    deliveries: list[Delivery]
    pixels: np.ndarray
    # the content key of each chunk the vector cache may store (by its entry)
    content_keys: dict[Delivery, str]


class ImagePipeline:
    """Decoding and the model's image processor, one image per task on ``threads``."""

    def __init__(
        self,
        processor: Any,
        threads: Executor,
        max_bytes: int,
        sources: ImageSources | None = None,
    ) -> None:
        self.processor = processor
        self.threads = threads
        self.max_bytes = max_bytes
        # where images sent by reference are read (None: none allowed)
        self.sources = sources or ImageSources((), max_bytes)

    @classmethod
    def for_encoder(
        cls, encoder: Any, max_bytes: int, sources: ImageSources | None = None
    ) -> ImagePipeline | None:
        """The pipeline of ``encoder``'s image processor, on a pool of the host's usable
        cores; None for a model that embeds text only."""
        processor = getattr(encoder, "image_processor", None)
        if processor is None:
            return None
        threads = ThreadPoolExecutor(usable_cpus(), thread_name_prefix="images")
        return cls(processor, threads, max_bytes, sources)

    def one(self, data: bytes | str) -> np.ndarray | ImageRefused:
        """One image's pixels as the processor makes them (channels first), or its refusal;
        ``data`` a reference (str): read from its place first."""
        try:
            if isinstance(data, str):
                data = self.sources.read(data)
            image = decode_image(data, self.max_bytes)
        except ImageSourceRefused as refused:
            return ImageRefused(str(refused), refused.code)
        except ImageRefused as refused:
            return refused
        pixels = self.processor(images=[image], return_tensors="np")["pixel_values"][0]
        return np.asarray(pixels, dtype=np.float32)

    def prepare(self, images: Sequence[bytes | str]) -> Prepared:
        """Every image of ``images`` decoded and preprocessed side by side on the threads.
        Blocks its caller: call it off the event loop."""
        done = list(self.threads.map(self.one, images))
        kept = [at for at, item in enumerate(done) if isinstance(item, np.ndarray)]
        refused = {at: item for at, item in enumerate(done) if isinstance(item, ImageRefused)}
        rows = [item for item in done if isinstance(item, np.ndarray)]
        pixels = np.stack(rows) if rows else np.zeros((0, 0, 0, 0), dtype=np.float32)
        return Prepared(pixels, kept, refused)


def take_images(
    pipeline: ImagePipeline,
    accepted: Sequence[Accepted],
    positions: list[int],
    keys: Sequence[str | None],
    rejected: list[Rejected],
) -> tuple[list[int], ImageRows | None]:
    """The positions of ``positions`` that are texts, and the image chunks among them
    preprocessed (None: none kept); a refused image goes to ``rejected`` with its reason."""
    pictures = [p for p in positions if accepted[p].chunk.is_image]
    if not pictures:
        return positions, None
    texts = [p for p in positions if not accepted[p].chunk.is_image]
    prepared = pipeline.prepare([_image_of(accepted[p].chunk) for p in pictures])
    for at, refused in prepared.refused.items():
        item = accepted[pictures[at]]
        rejected.append(Rejected.chunk(item.delivery, item.chunk, refused.code, str(refused)))
    kept = [pictures[at] for at in prepared.kept]
    if not kept:
        return texts, None
    rows = ImageRows(
        [accepted[p].chunk for p in kept],
        [accepted[p].delivery for p in kept],
        prepared.pixels,
        {accepted[p].delivery: key for p in kept if (key := keys[p]) is not None},
    )
    return texts, rows


def _image_of(chunk: Chunk) -> bytes | str:
    """An image chunk's bytes, or its reference where it came without them."""
    if chunk.image is not None:
        return chunk.image
    assert chunk.image_ref is not None, "an image chunk has its bytes or its reference"
    return chunk.image_ref


# the first image batch where queries wait on bulk work: small, so the image tower's cost is
# measured before a batch is sized to the slice target
FIRST_SLICED_BATCH = 4
# the weight of the newest batch in the smoothed cost per image
COST_SMOOTHING = 0.3


@dataclass
class ImageBatches:
    """How many images the next batch holds: ``max_batch`` (EMBEDFLEET_MAX_BATCH) at most, and
    where queries wait on bulk work (a CPU's query stage, served between the towers' layers:
    workers/slices.py) no more than a layer of the image tower computes within the slice
    target, from the cost per image measured so far. Preprocessed images all have one shape,
    so a batch's cost is its count."""

    max_batch: int
    slice_seconds: float  # 0: queries do not wait on bulk work (the CUDA query path)
    layers: int  # the image tower's: a query waits behind one of them at most
    seconds_per_image: float | None = None

    def __post_init__(self) -> None:
        if self.max_batch < 1:
            raise ValueError(f"a batch holds at least one image, not {self.max_batch}")

    def next_size(self) -> int:
        if self.slice_seconds <= 0:
            return self.max_batch
        if self.seconds_per_image is None:
            return min(self.max_batch, FIRST_SLICED_BATCH)
        fit = int(self.slice_seconds * max(1, self.layers) / self.seconds_per_image)
        return max(1, min(self.max_batch, fit))

    def layer_seconds(self, images: int) -> float:
        """The predicted time of one layer over ``images`` (0 before any batch is measured)."""
        return (self.seconds_per_image or 0.0) * images / max(1, self.layers)

    def observe(self, images: int, seconds: float) -> None:
        """A batch of ``images`` took ``seconds`` of the model (queries served inside left out)."""
        each = max(seconds, 1e-9) / images
        last = self.seconds_per_image
        self.seconds_per_image = each if last is None else last + COST_SMOOTHING * (each - last)

    @staticmethod
    def tower_layers(model: Any) -> int:
        """A dual encoder's image tower layers (``TextTowerModel.layer_stacks``); 1 for any
        other model (it has no image tower: its batches are never sliced by it)."""
        stacks = getattr(model, "layer_stacks", None)
        return len(stacks()[-1]) if stacks is not None else 1

    def cut(self, count: int) -> list[range]:
        """Positions ``0..count-1`` cut by :meth:`next_size` as it stands (no batch observed)."""
        size = self.next_size()
        return [range(start, min(start + size, count)) for start in range(0, count, size)]
