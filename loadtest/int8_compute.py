"""Would int8 compute pay, and hold parity? ``python -m loadtest.int8_compute``.

Two questions, each answered on this machine:

- **Speed.** For each of the model's linear-layer shapes, interleaved rounds, median ratio
  against the bf16 linear layer the worker runs: ``torch._int_mm`` alone (int8 x int8 -> int32:
  the ceiling), and a whole W8A8 linear layer (:class:`W8A8Linear`: inputs quantized per
  token, the int8 matmul, outputs dequantized with the bias added) eager and under
  ``torch.compile``, which fuses the quantize and dequantize steps around the matmul.
- **Parity.** That W8A8 layer in place of every linear layer of the transformer (weights per
  output channel, inputs per token, symmetric, 127 levels), optionally with SmoothQuant
  (``--smooth ALPHA``: each input channel's range moved into the weights by
  ``max|x|^alpha / max|w|^(1 - alpha)``, from the built-in probe texts, as the worker does),
  vectors compared with float32 sentence-transformers on the benchmark corpus against the
  issue's bar (min cosine >= 0.99, mean >= 0.999). ``--keep`` leaves the linear layers whose
  names contain a pattern in float (e.g. ``output.dense``). Computed in float32 around the int8
  matmul, so this is the scheme's own error, not bf16's on top.
"""

from __future__ import annotations

import functools
import os
import statistics
import time
from collections.abc import Callable

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import click
import numpy as np
import torch

from embedfleet.workers.cpus import usable_cpus
from embedfleet.workers.model.encoder import Encoder, resolve_model_path
from embedfleet.workers.model.int8 import W8A8Linear, input_ranges, quantize_layers
from embedfleet.workers.model.precision import PROBE_TEXTS, cosines
from loadtest.bench import machine_line
from loadtest.corpus import build_corpus

PARITY_MIN, PARITY_MEAN = 0.99, 0.999


def _milliseconds(function: Callable[[], object], repeat: int = 20) -> float:
    function()
    started = time.perf_counter()
    for _ in range(repeat):
        function()
    return (time.perf_counter() - started) / repeat * 1000


def transformer_layers(encoder: Encoder) -> torch.nn.Module:
    """The stack of transformer layers (BERT-class models, which this script targets): the
    linear layers the worker's matmul time goes to (the pooler is never used)."""
    return encoder._model.encoder.layer


def speed_rows(encoder: Encoder, tokens: int, rounds: int) -> list[str]:
    """Markdown rows, one per distinct (in, out) shape: each way's GFLOP/s and its median
    per-round speed-up over the bf16 linear layer."""
    shapes = sorted(
        {
            (m.in_features, m.out_features)
            for m in transformer_layers(encoder).modules()
            if isinstance(m, torch.nn.Linear)
        }
    )
    rows = []
    for inputs, outputs in shapes:
        linear = torch.nn.Linear(inputs, outputs).bfloat16().eval()
        activations = torch.randn(tokens, inputs).bfloat16()
        codes = torch.randint(-127, 128, (tokens, inputs), dtype=torch.int8)
        w8a8 = W8A8Linear(linear)
        ways: dict[str, Callable[[], object]] = {
            "bf16": functools.partial(linear, activations),
            "int_mm": functools.partial(torch._int_mm, codes, w8a8.weight_codes),
            "eager": functools.partial(w8a8, activations),
            "compiled": functools.partial(torch.compile(w8a8, dynamic=True), activations),
        }
        times: dict[str, list[float]] = {name: [] for name in ways}
        with torch.inference_mode():
            for _ in range(rounds):
                for name, way in ways.items():
                    times[name].append(_milliseconds(way))
        flops = 2 * tokens * inputs * outputs
        cells = [f"{tokens} x {inputs} -> {outputs}"]
        for name in ways:
            rate = flops / statistics.median(times[name]) / 1e6
            ratio = statistics.median(
                b / t for b, t in zip(times["bf16"], times[name], strict=True)
            )
            cells.append(f"{rate:.0f}" if name == "bf16" else f"{rate:.0f} ({ratio:.2f}x)")
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def swap_in_w8a8(
    encoder: Encoder, keep: tuple[str, ...], smooth: float | None, calibration: list[str]
) -> int:
    """Replace the transformer's linear layers by the worker's W8A8 ones (workers/model/int8.py);
    returns how many."""
    layers = transformer_layers(encoder)
    ranges = input_ranges(layers, encoder.embed_texts, calibration) if smooth is not None else {}
    return quantize_layers(layers, ranges, alpha=smooth or 0.0, kept=keep)


@click.command()
@click.option("--texts", "count", type=int, default=400, show_default=True)
@click.option("--tokens", type=int, default=2048, show_default=True, help="Rows per matmul.")
@click.option("--rounds", type=int, default=5, show_default=True)
@click.option("--keep", multiple=True, help="Leave linear layers whose name has this in float.")
@click.option("--smooth", type=float, default=None, help="SmoothQuant alpha (e.g. 0.5).")
@click.option("--no-speed", is_flag=True, help="Parity only.")
def main(
    count: int,
    tokens: int,
    rounds: int,
    keep: tuple[str, ...],
    smooth: float | None,
    no_speed: bool,
) -> None:
    """int8 matmul speed against bf16, and W8A8 parity against float32 sentence-transformers."""
    from sentence_transformers import SentenceTransformer

    threads = usable_cpus()
    torch.set_num_threads(threads)
    texts = [item.text for item in build_corpus(count)]
    calibration = list(PROBE_TEXTS)  # what the worker calibrates on (workers/model/int8.py)
    encoder = Encoder(dtype="float32", threads=threads)
    print(f"machine: {machine_line()}")
    if not no_speed:
        print(
            "| matmul (tokens x in -> out) | bf16 linear GFLOP/s | int8 matmul alone | "
            "W8A8 linear, eager | W8A8 linear, compiled |"
        )
        print("|---|---:|---:|---:|---:|")
        print("\n".join(speed_rows(encoder, tokens, rounds)))
    reference = SentenceTransformer(str(resolve_model_path(encoder.name)), device="cpu")
    expected = reference.encode(texts, batch_size=32, convert_to_numpy=True)
    swapped = swap_in_w8a8(encoder, keep, smooth, calibration)
    vectors = np.concatenate([encoder.embed_texts(texts[i : i + 32]) for i in range(0, count, 32)])
    found = cosines(vectors, expected)
    verdict = "holds" if found.min() >= PARITY_MIN and found.mean() >= PARITY_MEAN else "fails"
    scheme = f"SmoothQuant alpha {smooth}" if smooth is not None else "no smoothing"
    kept = f", kept in float: {', '.join(keep)}" if keep else ""
    print(
        f"W8A8 ({scheme}{kept}) on {swapped} linear layers, {count} texts: min cosine "
        f"{found.min():.5f}, mean {found.mean():.6f} vs float32 sentence-transformers: {verdict} "
        f"the bar (min >= {PARITY_MIN}, mean >= {PARITY_MEAN})"
    )


if __name__ == "__main__":
    main()
