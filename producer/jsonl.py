"""Reading chunks from JSON Lines: one {"id", "text", "meta"?, options?} object per line (or an
image in place of the text: "image" in base64, or "image_path", a file read here; see
producer/images.py).

Each line becomes a chunk through the Producer's own builder (``chunks.as_chunk``: the fields
it keeps, checked by the protocol's one validator with the configured limits), so a line
carries every field ``Producer.enqueue`` of the same mapping carries, and a line accepted here
is a chunk the worker will embed.

The file is read as bytes, a line at a time and at most ``line_cap`` bytes of it: a line that
is not UTF-8, or longer than the JSON of the largest message a worker takes, is a bad line
named with its number, and the lines after it are still read.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from embedfleet.producer.chunks import as_chunk
from embedfleet.producer.images import line_image_fields
from embedfleet.shared.protocol import DEFAULT_LIMITS, Chunk, ChunkLimits

# JSON spells a byte of a chunk's message in at most 6 bytes (a control character as \u001f),
# so a line longer than 6 x EMBEDFLEET_MAX_MESSAGE_BYTES cannot hold a chunk a worker takes.
JSON_BYTES_PER_BYTE = 6
SKIP_BYTES = 1 << 20  # the rest of a line over the cap is read and dropped this much at a time


@dataclass(frozen=True)
class BadLine:
    line_number: int
    reason: str


def line_cap(limits: ChunkLimits) -> int:
    """The longest line read, in bytes: the JSON of the largest message."""
    return JSON_BYTES_PER_BYTE * limits.max_message_bytes


def read_chunks(
    stream: IO[bytes],
    job: str | None,
    rejected: list[BadLine],
    limits: ChunkLimits = DEFAULT_LIMITS,
    check: Callable[[Chunk], None] | None = None,
    base: Path = Path(),
) -> Iterator[Chunk]:
    """Yield valid chunks; record each bad line (with its number and why) in ``rejected``.

    ``stream`` is binary (a file opened "rb", stdin's buffer). ``check``: the options
    verifier against the served model (shared/options.py ``verify``: a prompt name it declares,
    a dimension it has), whose ValueError makes the line a bad line rather than ending the file
    there. ``base``: the folder a line's relative ``image_path`` is read from (the file's)."""
    cap = line_cap(limits)
    for line_number, line in _lines(stream, cap):
        if line is None:
            rejected.append(
                BadLine(
                    line_number,
                    f"longer than {cap} bytes (the JSON of the largest message: "
                    f"{JSON_BYTES_PER_BYTE} x EMBEDFLEET_MAX_MESSAGE_BYTES)",
                )
            )
            continue
        try:
            text = line.decode("utf-8")
        except UnicodeDecodeError as error:
            rejected.append(
                BadLine(
                    line_number,
                    f"not UTF-8: byte 0x{line[error.start]:02x} at byte {error.start + 1} "
                    f"({error.reason})",
                )
            )
            continue
        if not text.strip():
            continue
        try:
            item = json.loads(text)
        except json.JSONDecodeError as error:
            rejected.append(BadLine(line_number, f"not JSON: {error.msg}"))
            continue
        if not isinstance(item, dict):
            rejected.append(BadLine(line_number, "expected a JSON object"))
            continue
        try:
            # a line's own reply/deadline would turn it into a query: as_chunk keeps only the
            # fields a chunk to enqueue carries, as for Producer.enqueue of the same mapping
            item = line_image_fields(item, base, limits.max_image_bytes)
            chunk = as_chunk(item, job, limits=limits)
            if check is not None:
                check(chunk)
        except ValueError as error:  # ProtocolError, ImageFileError, or the card's refusal
            rejected.append(BadLine(line_number, str(error)))
            continue
        yield chunk


def _lines(stream: IO[bytes], cap: int) -> Iterator[tuple[int, bytes | None]]:
    """(number, line) for each line of ``stream``; None for a line over ``cap`` bytes, whose
    rest is skipped a piece at a time (never held whole)."""
    number = 0
    while line := stream.readline(cap + 1):
        number += 1
        if len(line) > cap and not line.endswith(b"\n"):
            del line  # the cap's worth read: not kept while the rest is skipped
            while (rest := stream.readline(SKIP_BYTES)) and not rest.endswith(b"\n"):
                pass
            yield number, None
            continue
        yield number, line
