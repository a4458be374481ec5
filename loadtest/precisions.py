"""Output precisions side by side: ``python -m loadtest.precisions``.

The same corpus (``loadtest.corpus``) through the whole fleet (a real server, an in-process
worker, the Redis sink) once per output dtype, interleaved (a rotation per round, so a machine
that gets busier or quieter affects every dtype alike); the table gives texts/s per dtype and
the median of its per-round ratios to float16. int8/uint8 calibration is made before the clock
starts (a worker does it once per model and dimension, not per run).

It also times the output stage alone (``Outputs.results`` on 1024 vectors: truncation,
quantization, Result objects), which is what a dtype adds to the write path.
"""

from __future__ import annotations

import statistics
import sys
import time

import click
import numpy as np

from embedfleet.shared.protocol import OUTPUT_DTYPES, Chunk
from embedfleet.workers.model.encoder import Encoder
from loadtest.bench import Fleet, _server, machine_line, redis_url_option
from loadtest.corpus import CorpusText, build_corpus


def fleet_run(fleet: Fleet, encoder: Encoder, corpus: list[CorpusText], dtype: str) -> float:
    """Seconds from the first enqueue to the last result, every chunk written as ``dtype``."""
    texts = [item.text for item in corpus]
    ids = [item.id for item in corpus]
    run = fleet.run(encoder, texts, ids, keep=False, settings={"output_dtype": dtype})
    if run.texts != len(corpus):
        raise RuntimeError(f"{dtype}: {run.texts} of {len(corpus)} done")
    return run.seconds


def output_stage_us(encoder: Encoder, dtype: str, repeats: int = 20) -> float:
    """Microseconds per vector of the output stage alone, on 1024 random unit vectors."""
    from embedfleet.shared.settings import Settings
    from embedfleet.workers.calibration import Calibration, CalibrationStore
    from embedfleet.workers.output import Outputs

    outputs = Outputs(
        Settings(output_dtype=dtype), encoder, CalibrationStore(None, Settings().keys, "x")
    )
    generator = np.random.default_rng(0)
    vectors = generator.standard_normal((1024, encoder.dim)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    ranges = np.vstack((vectors.min(axis=0), vectors.max(axis=0)))
    outputs.calibrations._cache[outputs.variant(encoder.dim)] = Calibration(
        "x", "full", ranges, 1024, "bench"
    )
    chunks = [Chunk(id=str(i), text="t") for i in range(len(vectors))]
    truncated = [False] * len(vectors)
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        outputs.results(chunks, vectors, truncated)
        best = min(best, time.perf_counter() - started)
    return best / len(vectors) * 1e6


@click.command()
@click.option("--texts", "count", type=int, default=600, show_default=True)
@click.option("--rounds", type=int, default=3, show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@redis_url_option
def main(count: int, rounds: int, seed: int, redis_url: str | None) -> None:
    """Fleet throughput per output dtype, relative to float16, interleaved."""
    from embedfleet.shared.logging import configure_logging

    configure_logging("warning", "console")
    encoder = Encoder(device="cpu", dtype="float32")
    corpus = build_corpus(count, seed=seed)
    print(f"machine: {machine_line()}", file=sys.stderr)
    rates: dict[str, list[float]] = {dtype: [] for dtype in OUTPUT_DTYPES}
    ratios: dict[str, list[float]] = {dtype: [] for dtype in OUTPUT_DTYPES}
    with _server(redis_url) as url:
        fleet = Fleet(url)
        fleet_run(fleet, encoder, corpus[:64], "float16")  # warm-up
        for round_number in range(rounds):
            shift = round_number % len(OUTPUT_DTYPES)
            order = OUTPUT_DTYPES[shift:] + OUTPUT_DTYPES[:shift]
            this_round: dict[str, float] = {}
            for dtype in order:
                seconds = fleet_run(fleet, encoder, corpus, dtype)
                this_round[dtype] = len(corpus) / seconds
                print(
                    f"round {round_number + 1} {dtype}: {this_round[dtype]:.1f} texts/s",
                    file=sys.stderr,
                )
            for dtype, rate in this_round.items():
                rates[dtype].append(rate)
                ratios[dtype].append(rate / this_round["float16"])
    print(f"\n{count} texts, {rounds} rounds interleaved; {machine_line()}\n")
    print(
        "| output dtype | texts/s (median) | vs float16 (median of per-round ratios) | "
        "output stage alone, µs/vector |"
    )
    print("|---|---|---|---|")
    for dtype in OUTPUT_DTYPES:
        print(
            f"| {dtype} | {statistics.median(rates[dtype]):.1f} | "
            f"{statistics.median(ratios[dtype]):.3f} "
            f"({min(ratios[dtype]):.3f}-{max(ratios[dtype]):.3f}) | "
            f"{output_stage_us(encoder, dtype):.2f} |"
        )


if __name__ == "__main__":
    main()
