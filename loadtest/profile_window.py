"""Where one bulk window's time goes: ``python -m loadtest.profile_window``.

Runs the worker's compute path (tokenize, plan by token budget, collate, embed) over one window
of the benchmark corpus with the default settings (``EMBEDFLEET_DTYPE=auto``: bf16 where the
probe keeps it), once to warm up and once under ``torch.profiler``, and prints the operators by
self CPU time, the share of the window spent outside the model, and the model FLOPs
utilisation of the window against this machine's bf16 matmul peak, measured in the same run.
"""

from __future__ import annotations

import os
import time

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import click
import torch
from torch.profiler import ProfilerActivity, profile

from embedfleet.shared.settings import Batching, Settings
from embedfleet.workers.batcher import plan_batches
from embedfleet.workers.cpus import usable_cpus
from embedfleet.workers.encoder import Encoder
from loadtest.bench import machine_line, measure_peak, useful_flops
from loadtest.corpus import build_corpus


def run_window(encoder: Encoder, texts: list[str], batching: Batching) -> tuple[float, float]:
    """(seconds in all, seconds in embed) for one window, as the worker runs it."""
    started = time.perf_counter()
    tokens = encoder.tokenize(texts)
    lengths = [t.length for t in tokens]
    in_model = 0.0
    for planned in plan_batches(lengths, batching.token_budget, batching.max_batch):
        batch = encoder.collate([tokens[p] for p in planned.positions])
        before = time.perf_counter()
        encoder.embed(batch)
        in_model += time.perf_counter() - before
    return time.perf_counter() - started, in_model


@click.command()
@click.option("--texts", "count", type=int, default=1000, show_default=True)
@click.option("--rows", type=int, default=25, show_default=True, help="Operators to list.")
def main(count: int, rows: int) -> None:
    """Profile one bulk window of the fleet's default compute path."""
    settings = Settings()
    threads = settings.threads or usable_cpus()
    torch.set_num_threads(threads)
    encoder = Encoder(settings.model, device="cpu", dtype=settings.dtype, threads=threads)
    batching = settings.batching("cpu")
    texts = [item.text for item in build_corpus(count)][: batching.read_count]
    lengths = [t.length for t in encoder.tokenize(texts)]
    run_window(encoder, texts, batching)  # warm-up: allocator, oneDNN primitives
    with profile(activities=[ProfilerActivity.CPU], record_shapes=False) as profiler:
        seconds, in_model = run_window(encoder, texts, batching)
    peak = measure_peak(torch.device("cpu"), with_bf16=True)
    precision = "bf16" if encoder.precision.dtype != torch.float32 else "fp32"
    mfu = useful_flops(lengths, encoder) / seconds / peak.of(precision)
    print(f"machine: {machine_line()}")
    print(
        f"window: {len(texts)} texts, {sum(lengths)} real tokens, {encoder.precision.describe()}, "
        f"token_budget {batching.token_budget}, max_batch {batching.max_batch}"
    )
    print(
        f"window {seconds:.2f} s, in embed {in_model / seconds:.0%}; MFU {mfu:.1%} of this run's "
        f"{precision} matmul peak ({peak.of(precision) / 1e9:.0f} GFLOP/s)"
    )
    print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))


if __name__ == "__main__":
    main()
