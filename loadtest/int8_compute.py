"""Would int8 compute pay, and hold parity? ``python -m loadtest.int8_compute``.

Two questions, each answered on this machine:

- **Speed.** ``torch._int_mm`` (int8 x int8 -> int32) against the bf16 linear layer the worker
  runs, on the model's own matrix shapes, interleaved rounds, median ratio. This is the ceiling
  of what int8 weights and activations could buy the linear layers (before the cost of
  quantizing activations and dequantizing outputs, which is not counted here).
- **Parity.** W8A8 simulated in float32: every linear layer of the transformer with its weights
  rounded per output channel and its inputs rounded per token (symmetric, 127 levels, the
  usual dynamic int8 scheme), vectors compared with float32 sentence-transformers on the
  benchmark corpus against the issue's bar (min cosine >= 0.99, mean >= 0.999). ``--keep``
  leaves the linear layers whose names contain a pattern in float (e.g. ``output.dense``).
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
from embedfleet.workers.encoder import Encoder, resolve_model_path
from embedfleet.workers.precision import cosines
from loadtest.bench import machine_line
from loadtest.corpus import build_corpus

PARITY_MIN, PARITY_MEAN = 0.99, 0.999


def _milliseconds(function: Callable[[], object], repeat: int = 20) -> float:
    function()
    started = time.perf_counter()
    for _ in range(repeat):
        function()
    return (time.perf_counter() - started) / repeat * 1000


def speed_rows(encoder: Encoder, tokens: int, rounds: int) -> list[str]:
    """Markdown rows: bf16 linear vs int8 matmul per distinct (in, out) shape of the model."""
    shapes = sorted(
        {
            (m.in_features, m.out_features)
            for m in transformer_layers(encoder).modules()
            if isinstance(m, torch.nn.Linear)
        }
    )
    rows = []
    for inputs, outputs in shapes:
        activations = torch.randn(tokens, inputs).bfloat16()
        weight = torch.randn(outputs, inputs).bfloat16()
        bias = torch.randn(outputs).bfloat16()
        codes = torch.randint(-127, 128, (tokens, inputs), dtype=torch.int8)
        weight_codes = torch.randint(-127, 128, (inputs, outputs), dtype=torch.int8)
        linear = functools.partial(torch.nn.functional.linear, activations, weight, bias)
        int8_matmul = functools.partial(torch._int_mm, codes, weight_codes)
        bf16, int8 = [], []
        with torch.inference_mode():
            for _ in range(rounds):
                bf16.append(_milliseconds(linear))
                int8.append(_milliseconds(int8_matmul))
        flops = 2 * tokens * inputs * outputs
        ratio = statistics.median(b / i for b, i in zip(bf16, int8, strict=True))
        rows.append(
            f"| {tokens} x {inputs} -> {outputs} | {flops / statistics.median(bf16) / 1e6:.0f} | "
            f"{flops / statistics.median(int8) / 1e6:.0f} | {ratio:.2f}x |"
        )
    return rows


def transformer_layers(encoder: Encoder) -> torch.nn.Module:
    """The stack of transformer layers (BERT-class models, which this script targets): the
    linear layers the worker's matmul time goes to (the pooler is never used)."""
    return encoder._model.encoder.layer


def simulate_w8a8(model: torch.nn.Module, keep: tuple[str, ...]) -> int:
    """Round every linear layer's weights per output channel and its inputs per token, in
    place (float32 throughout); returns how many layers were rounded."""
    rounded = 0
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear) or any(k in name for k in keep):
            continue
        weight = module.weight.data
        scale = weight.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127
        module.weight.data = (weight / scale).round().clamp(-127, 127) * scale

        def round_input(_module: torch.nn.Module, args: tuple) -> tuple:
            x = args[0]
            scale = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12) / 127
            return ((x / scale).round().clamp(-127, 127) * scale, *args[1:])

        module.register_forward_pre_hook(round_input)
        rounded += 1
    return rounded


@click.command()
@click.option("--texts", "count", type=int, default=400, show_default=True)
@click.option("--tokens", type=int, default=2048, show_default=True, help="Rows per matmul.")
@click.option("--rounds", type=int, default=5, show_default=True)
@click.option("--keep", multiple=True, help="Leave linear layers whose name has this in float.")
def main(count: int, tokens: int, rounds: int, keep: tuple[str, ...]) -> None:
    """int8 matmul speed against bf16, and W8A8 parity against float32 sentence-transformers."""
    from sentence_transformers import SentenceTransformer

    threads = usable_cpus()
    torch.set_num_threads(threads)
    texts = [item.text for item in build_corpus(count)]
    encoder = Encoder(dtype="float32", threads=threads)
    print(f"machine: {machine_line()}")
    print("| matmul (tokens x in -> out) | bf16 linear GFLOP/s | int8 GOP/s | int8 / bf16 |")
    print("|---|---:|---:|---:|")
    print("\n".join(speed_rows(encoder, tokens, rounds)))
    reference = SentenceTransformer(str(resolve_model_path(encoder.name)), device="cpu")
    expected = reference.encode(texts, batch_size=32, convert_to_numpy=True)
    rounded = simulate_w8a8(transformer_layers(encoder), keep)
    vectors = np.concatenate([encoder.embed_texts(texts[i : i + 32]) for i in range(0, count, 32)])
    found = cosines(vectors, expected)
    verdict = "holds" if found.min() >= PARITY_MIN and found.mean() >= PARITY_MEAN else "fails"
    print(
        f"W8A8 (per-channel weights, per-token inputs) on {rounded} linear layers"
        f"{' (kept in float: ' + ', '.join(keep) + ')' if keep else ''}, {count} texts: min "
        f"cosine {found.min():.5f}, mean {found.mean():.6f} vs float32 sentence-transformers: "
        f"{verdict} the bar (min >= {PARITY_MIN}, mean >= {PARITY_MEAN})"
    )


if __name__ == "__main__":
    main()
