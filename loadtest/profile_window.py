"""Where one bulk window's time goes: ``python -m loadtest.profile_window``.

Runs the worker's bulk compute path (tokenize, plan by token budget, collate, embed through the
frozen graph where the worker would use it: ``EMBEDFLEET_FROZEN_BULK`` on a CPU in bf16/fp16;
``--eager`` for the eager model) over one window of the benchmark corpus with the default
settings (``EMBEDFLEET_DTYPE=auto``), once to warm up and once under ``torch.profiler``. Prints
the operators by self CPU time, then the window's time by kind of work (the transformer's
linear layers, attention, everything else) with what each achieves: the linear layers' and
attention's FLOP rates (padded tokens, as computed) against this machine's matmul peak, measured
in the same run, and the window's model FLOPs utilisation (real tokens only, as in
``loadtest.bench``).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import click
import numpy as np
import torch
from torch.profiler import ProfilerActivity, profile

from embedfleet.shared.settings import Batching, Settings
from embedfleet.workers.batcher import plan_batches
from embedfleet.workers.cpus import usable_cpus
from embedfleet.workers.model.encoder import EncodeBatch, Encoder
from loadtest.bench import machine_line, matmul_parameters, measure_peak, useful_flops
from loadtest.corpus import build_corpus

# Operator names by kind of work (self CPU time; aten::linear and aten::matmul only dispatch)
KINDS: dict[str, tuple[str, ...]] = {
    "linear layers (mm/addmm)": ("aten::mm", "aten::addmm", "mkldnn"),
    # bmm: the batched QK^T and attention x V of eager (non-SDPA) attention
    "attention (SDPA kernels)": (
        "scaled_dot_product",
        "flash_attention",
        "aten::_softmax",
        "aten::bmm",
    ),
}


def run_window(
    encoder: Encoder, texts: list[str], batching: Batching, embed: Callable[[EncodeBatch], object]
) -> tuple[float, float, list[tuple[int, int]]]:
    """(seconds in all, seconds in embed, batch shapes) for one window, as the worker runs it."""
    started = time.perf_counter()
    tokens = encoder.tokenize(texts)
    lengths = [t.length for t in tokens]
    in_model = 0.0
    shapes = []
    for planned in plan_batches(lengths, batching.token_budget, batching.max_batch):
        batch = encoder.collate([tokens[p] for p in planned.positions])
        before = time.perf_counter()
        embed(batch)
        in_model += time.perf_counter() - before
        shapes.append(tuple(batch.input_ids.shape))
    return time.perf_counter() - started, in_model, shapes


def padded_flops(encoder: Encoder, shapes: Sequence[tuple[int, int]]) -> tuple[float, float]:
    """(linear layers, attention) FLOPs as computed, padding included."""
    config = encoder._model.config
    linear = sum(2.0 * matmul_parameters(encoder) * rows * width for rows, width in shapes)
    attention = sum(
        4.0 * config.num_hidden_layers * config.hidden_size * rows * width * width
        for rows, width in shapes
    )
    return linear, attention


def seconds_by_kind(profiler: profile) -> dict[str, float]:
    """Self CPU seconds per kind of work (KINDS), the rest under "everything else"."""
    totals = dict.fromkeys([*KINDS, "everything else"], 0.0)
    for event in profiler.key_averages():
        if event.key in ("forward",) or event.key.startswith("ProfilerStep"):
            continue
        kind = next(
            (k for k, names in KINDS.items() if any(n in event.key for n in names)),
            "everything else",
        )
        totals[kind] += event.self_cpu_time_total / 1e6
    return totals


@click.command()
@click.option("--texts", "count", type=int, default=1000, show_default=True)
@click.option("--rows", type=int, default=25, show_default=True, help="Operators to list.")
@click.option(
    "--eager", is_flag=True, help="Profile the eager model, not the worker's frozen bulk path."
)
def main(count: int, rows: int, eager: bool) -> None:
    """Profile one bulk window of the fleet's default compute path."""
    settings = Settings()
    threads = settings.threads or usable_cpus()
    torch.set_num_threads(threads)
    encoder = Encoder(settings.model, device="cpu", dtype=settings.dtype, threads=threads)
    frozen = (
        not eager
        and settings.frozen_bulk
        and encoder.computes_in_reduced_precision
        and encoder.prepare_query_graph()
    )
    embed = encoder.embed_query if frozen else encoder.embed
    batching = settings.batching("cpu")
    texts = [item.text for item in build_corpus(count)][: batching.read_count]
    lengths = [t.length for t in encoder.tokenize(texts)]
    run_window(encoder, texts, batching, embed)  # warm-up: allocator, oneDNN primitives
    with profile(activities=[ProfilerActivity.CPU], record_shapes=False) as profiler:
        seconds, in_model, shapes = run_window(encoder, texts, batching, embed)
    peak = measure_peak(torch.device("cpu"), with_bf16=True)
    precision = "bf16" if encoder.precision.dtype != torch.float32 else "fp32"
    peak_flops = peak.of(precision)
    mfu = useful_flops(lengths, encoder) / seconds / peak_flops
    print(f"machine: {machine_line()}")
    print(
        f"window: {len(texts)} texts, {sum(lengths)} real tokens, "
        f"{int(np.sum([r * w for r, w in shapes]))} padded, {encoder.precision.describe()}, "
        f"{'frozen graph' if frozen else 'eager model'}, token_budget {batching.token_budget}, "
        f"max_batch {batching.max_batch}"
    )
    print(
        f"window {seconds:.2f} s, in embed {in_model / seconds:.0%}; MFU {mfu:.1%} of this run's "
        f"{precision} matmul peak ({peak_flops / 1e9:.0f} GFLOP/s)"
    )
    print(profiler.key_averages().table(sort_by="self_cpu_time_total", row_limit=rows))
    linear_flops, attention_flops = padded_flops(encoder, shapes)
    flops = {"linear layers (mm/addmm)": linear_flops, "attention (SDPA kernels)": attention_flops}
    by_kind = seconds_by_kind(profiler)
    profiled = sum(by_kind.values())
    print("| work | share of the window's operator time | achieved | of the matmul peak |")
    print("|---|---:|---:|---:|")
    for kind, spent in by_kind.items():
        rate = flops[kind] / spent if kind in flops and spent else None
        achieved = f"{rate / 1e9:.0f} GFLOP/s" if rate else ""
        share = f"{rate / peak_flops:.0%}" if rate else ""
        print(f"| {kind} | {spent / profiled:.1%} | {achieved} | {share} |")


if __name__ == "__main__":
    main()
