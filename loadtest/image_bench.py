"""Images through the fleet beside sentence-transformers (issue 56):
``python -m loadtest.bench --images N [--rounds R] [--image-model DIR]``.

The model: CLIP ViT-B/32's shapes with random weights (tests/image_models.py
``clip_shaped_dir``: a ``CLIPModel`` directory with the test tokenizer and a
``CLIPImageProcessor``), nothing downloaded. The images: ``N`` new to each round (seeded by the
round) and to the warm-up, of mixed sizes (160-1024 pixels a side, any aspect) and formats
(JPEG, PNG, WebP): a smooth field of colour with a few shapes drawn on it, so each compresses
about as a photo or a figure does rather than as noise. Within a round both contenders embed the
same files; the order of the two rotates from round to round. Contenders:

1. ``st encode(32)``: sentence-transformers' ``encode`` of the files as PIL images, batch 32, on
   the same directory (its Transformer module with the image modality: the CLIP wrapper). The
   files are opened from their bytes inside its clock and decoded and preprocessed by its
   processor inside the call, so preprocessing is counted, as it is for the fleet.
2. ``fleet auto``: ``Chunk(image=...)`` through the Producer into a real Redis-compatible server,
   an in-process worker with the default settings (``loadtest.bench``'s ``Fleet``, as
   ``embedfleet demo`` runs it: decode and preprocess on the host's threads, workers/images.py),
   from the first enqueue to the last result; the vectors are read back after the clock. Where
   ``auto`` computes in another precision than float32, ``fleet fp32`` runs beside it; where
   its parity probe kept float32 on a CPU that has a reduced precision (random weights drift
   more than trained ones), ``fleet bfloat16`` (or float16) runs it by name beside it.

Reported: images/s per contender (median of rounds), the median of the per-round ratios to (1)
(the issue's target: fleet >= 1.5x), the worst cosine of a fleet vector to sentence-transformers'
on the same file, and the host's decode + preprocess rate per core: workers/images.py's
``ImagePipeline.one`` over the round's files on one thread, images per CPU second of that thread.
"""

from __future__ import annotations

import io
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageDraw

from embedfleet.shared.settings import Settings
from embedfleet.workers.images import ImagePipeline
from embedfleet.workers.model.encoder import Encoder
from embedfleet.workers.model.precision import cosines
from loadtest.bench import Contender, Fleet, FleetEncoders, Run, _server, machine_line

FORMATS = ("JPEG", "PNG", "WEBP")
SIDES = (160, 1024)  # pixels a side, each side drawn on its own
ST_BATCH = 32
ST = f"st encode({ST_BATCH})"


@dataclass(frozen=True)
class ImageBench:
    """What ``loadtest.bench --images`` was asked for."""

    count: int  # images per round
    rounds: int
    seed: int
    threads: int
    device: str
    only: str  # comma-separated contender names ("" for all); the baseline always runs
    redis_url: str | None


def round_images(count: int, seed: int, name: str) -> list[bytes]:
    """``count`` encoded images for one round, the same for the same seed and name and new to
    any other name."""
    rng = np.random.default_rng([seed, *name.encode()])
    return [_picture(rng, FORMATS[int(rng.integers(len(FORMATS)))]) for _ in range(count)]


def _picture(rng: np.random.Generator, fmt: str) -> bytes:
    width, height = (int(side) for side in rng.integers(SIDES[0], SIDES[1] + 1, 2))
    grid = rng.integers(0, 256, (4, 4, 3), dtype=np.uint8)  # a smooth field, upsampled
    image = Image.fromarray(grid).resize((width, height), Image.Resampling.BICUBIC)
    draw = ImageDraw.Draw(image)
    for _ in range(int(rng.integers(3, 9))):
        x0, x1 = sorted(int(x) for x in rng.integers(0, width, 2))
        y0, y1 = sorted(int(y) for y in rng.integers(0, height, 2))
        colour = tuple(int(c) for c in rng.integers(0, 256, 3))
        shape = draw.ellipse if rng.random() < 0.5 else draw.rectangle
        shape((x0, y0, x1, y1), fill=colour)
    out = io.BytesIO()
    image.save(out, format=fmt, **({} if fmt == "PNG" else {"quality": 85}))
    return out.getvalue()


def describe_images(images: list[bytes]) -> str:
    sizes = [Image.open(io.BytesIO(data)).size for data in images]
    formats = [Image.open(io.BytesIO(data)).format for data in images]
    return (
        f"{len(images)} images, {min(min(s) for s in sizes)}-{max(max(s) for s in sizes)} px a "
        f"side, median {statistics.median(len(d) for d in images) / 1024:.0f} KiB, "
        + ", ".join(f"{fmt} {formats.count(fmt)}" for fmt in FORMATS)
    )


def st_images(model: Any, images: list[bytes]) -> Run:
    """sentence-transformers' ``encode`` of the files, opened from their bytes on its clock."""
    started = time.perf_counter()
    opened = [Image.open(io.BytesIO(data)) for data in images]
    vectors = model.encode(
        opened, batch_size=ST_BATCH, convert_to_numpy=True, show_progress_bar=False
    )
    seconds = time.perf_counter() - started
    return Run(seconds, len(images), 0, 0, np.asarray(vectors, dtype=np.float32))


def decode_rate(processor: Any, images: list[bytes], max_bytes: int) -> tuple[float, float]:
    """workers/images.py's decode + preprocess of ``images`` on this one thread: images per CPU
    second of the thread, and per wall second."""
    with ThreadPoolExecutor(1) as unused:  # ``one`` runs on the caller's thread
        pipeline = ImagePipeline(processor, unused, max_bytes)
        cpu, wall = time.thread_time(), time.perf_counter()
        for data in images:
            pipeline.one(data)
        cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
    return len(images) / cpu, len(images) / wall


def sentence_transformer(model_dir: Path, device: torch.device) -> Any:
    """The CLIP wrapper of sentence-transformers (its Transformer module with text and image
    modalities) around ``model_dir``, as ``SentenceTransformer(dir)`` makes it of a published
    CLIP snapshot."""
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules.transformer import Transformer

    return SentenceTransformer(modules=[Transformer(str(model_dir))], device=str(device))


def contenders(
    bench: ImageBench, model_dir: Path, fleet: Fleet, say: Callable[[str], None]
) -> tuple[list[Contender], Encoder]:
    """The baseline first, then the fleet rows ``bench.only`` keeps (all where it names none);
    with the default worker's encoder."""
    from embedfleet.workers.model.encoder import resolve_device
    from embedfleet.workers.model.precision import requested_precision

    device = resolve_device(bench.device)
    st = sentence_transformer(model_dir, device)
    encoders = FleetEncoders(bench.device, bench.threads, model=str(model_dir))
    auto = encoders.encoder({})
    processor = type(auto.image_processor).__name__
    say(f"fleet auto: {auto.precision.describe()}, image processor {processor}")
    rows = [Contender(ST, "fp32", lambda images: st_images(st, images))]
    fleet_rows = {"fleet auto": auto}
    if auto.precision.dtype != torch.float32:
        fleet_rows["fleet fp32"] = encoders.encoder({"EMBEDFLEET_DTYPE": "float32"})
    elif (candidate := requested_precision("auto", device)).dtype != torch.float32:
        # auto's parity probe kept float32: random weights drift further in a reduced
        # precision than trained ones, whose probe passes. The precision auto tried, asked for
        # by name, as a trained model's lane runs it (min cos vs st says what it costs here)
        fleet_rows[f"fleet {candidate.name}"] = encoders.encoder(
            {"EMBEDFLEET_DTYPE": candidate.name}
        )
    for name, encoder in fleet_rows.items():

        def run(images: list[bytes], encoder: Encoder = encoder) -> Run:
            ids = [f"img{i}" for i in range(len(images))]
            return fleet.run_images(encoder, images, ids)

        rows.append(Contender(name, "fp32", run))
    wanted = {name.strip() for name in bench.only.split(",") if name.strip()}
    if wanted:
        rows = [row for row in rows if row.name in wanted or row.name == ST]
    return rows, auto


def run_rounds(
    bench: ImageBench, rows: list[Contender], say: Callable[[str], None]
) -> tuple[dict[str, list[float]], str]:
    """A warm-up, then the rounds interleaved (the order rotates); per fleet row, each round's
    cosines of its vectors to the baseline's on the same files. Returns those and the first
    round's images described."""
    for row in rows:
        row.run(round_images(min(16, bench.count), bench.seed, "warm-up"))
    parity: dict[str, list[float]] = {row.name: [] for row in rows}
    described = ""
    for number in range(bench.rounds):
        images = round_images(bench.count, bench.seed, f"round {number + 1}")
        described = described or describe_images(images)
        order = rows[number % len(rows) :] + rows[: number % len(rows)]
        for row in order:
            run = row.run(images)
            if run.cache_hits:  # every round's files are new: a hit would measure the cache
                raise RuntimeError(f"{row.name}: {run.cache_hits} images answered by the cache")
            row.runs.append(run)
            say(
                f"round {number + 1}/{bench.rounds} {row.name}: "
                f"{run.texts / run.seconds:.1f} images/s ({run.seconds:.1f} s)"
            )
        reference = rows[0].runs[-1].vectors
        for row in rows:
            assert reference is not None and row.runs[-1].vectors is not None
            parity[row.name] += cosines(reference, row.runs[-1].vectors).tolist()
    return parity, described


def summary(rows: list[Contender], parity: dict[str, list[float]]) -> list[dict[str, Any]]:
    baseline = rows[0]
    table = []
    for row in rows:
        rates = [run.texts / run.seconds for run in row.runs]
        ratios = [
            rate / (base.texts / base.seconds)
            for rate, base in zip(rates, baseline.runs, strict=True)
        ]
        table.append(
            {
                "name": row.name,
                "images_per_s": statistics.median(rates),
                "ratio": statistics.median(ratios),
                "ratios": ratios,
                "min_cosine_vs_st": min(parity[row.name]),
                "rates": rates,
            }
        )
    return table


def render(table: list[dict[str, Any]]) -> str:
    lines = [
        f"| contender | images/s | × {ST} (median of rounds) | min cos vs st |",
        "|---|---:|---:|---:|",
    ]
    for row in table:
        lines.append(
            f"| {row['name']} | {row['images_per_s']:.1f} | {row['ratio']:.2f} | "
            f"{row['min_cosine_vs_st']:.5f} |"
        )
    return "\n".join(lines)


def run_images(
    bench: ImageBench, model_dir: Path | None, say: Callable[[str], None], json_out: Path | None
) -> list[dict[str, Any]]:
    """The whole images benchmark; prints its report, returns its table's rows."""
    from tests.image_models import clip_shaped_dir

    with tempfile.TemporaryDirectory(prefix="image-bench-") as scratch:
        model_dir = model_dir or Path(scratch) / "clip-vit-b-32-random"
        if not (model_dir / "config.json").is_file():
            say(f"building a CLIP ViT-B/32-shaped model (random weights) in {model_dir}")
            clip_shaped_dir(model_dir)
        with _server(bench.redis_url) as url:
            fleet = Fleet(url, vector_cache=True)  # as users run it; every file is new to it
            rows, auto = contenders(bench, model_dir, fleet, say)
            say(f"warming up {len(rows)} contenders")
            parity, described = run_rounds(bench, rows, say)
    images = round_images(bench.count, bench.seed, "round 1")
    max_bytes = Settings().max_image_bytes  # the worker's bound (EMBEDFLEET_MAX_IMAGE_BYTES)
    per_cpu_s, per_wall_s = decode_rate(auto.image_processor, images, max_bytes)
    table = summary(rows, parity)
    print(f"machine: {machine_line()}")
    print(
        f"model: {model_dir.name} (CLIP ViT-B/32 shapes unless --image-model says otherwise); "
        f"per round: {described}; new files each round (seed {bench.seed}); "
        f"{bench.rounds} rounds interleaved"
    )
    print(render(table))
    print(
        f"host decode + preprocess (workers/images.py, one thread): {per_cpu_s:.1f} images per "
        f"CPU second ({per_wall_s:.1f} per wall second); x {bench.threads} threads = "
        f"{per_cpu_s * bench.threads:.0f} images/s at most on this host's cores"
    )
    if json_out is not None:
        report = {
            "machine": machine_line(),
            "images": described,
            "seed": bench.seed,
            "rows": table,
            "decode_preprocess_per_cpu_s": per_cpu_s,
            "decode_preprocess_per_wall_s": per_wall_s,
        }
        json_out.write_text(json.dumps(report, indent=2))
    return table
