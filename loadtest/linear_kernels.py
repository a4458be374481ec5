"""Which float32 linear kernel is fastest on this CPU, for the bulk path's layer shapes.

    python -m loadtest.linear_kernels [--tokens 3840] [--threads 0] [--json FILE]

A float32 bulk batch is mostly the six transformer layers' linear layers: 384 -> 384 (query,
key, value, attention output), 384 -> 1536 and 1536 -> 384 (the feed-forward pair) for
all-MiniLM-L6-v2. This times each shape, over ``--tokens`` rows (a bulk batch's real tokens),
through the kernels torch offers for it on a CPU: aten's ``linear`` (MKL's sgemm, what the
eager model and the frozen graph run), MKL's packed sgemm with the weight packed once
(``torch.ops.mkl._mkl_linear``, what inductor's freezing emits for float32), and oneDNN's
``linear_pointwise`` on a reordered weight (what it emits for bf16). Best of ``--repeats``
calls each (``workers.model.choose.best_of``, the worker's own timing), in GFLOP/s, beside this
CPU's flags: if one kernel were clearly faster, the float32 path would be worth building on it.
Figures: docs/BENCHMARKS.md (stop 38). An experiment, not a worker path.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

import torch

from embedfleet.workers.cpus import cpu_class
from embedfleet.workers.model.choose import best_of

SHAPES = ((384, 384), (384, 1536), (1536, 384))  # (in, out) of all-MiniLM-L6-v2's linear layers


def kernels(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> dict[str, Callable]:
    """The float32 linear kernels this torch build has, each on weights prepared once."""
    rows = x.shape[0]
    found: dict[str, Callable] = {
        "aten linear": lambda: torch.nn.functional.linear(x, weight, bias)
    }
    if torch.backends.mkl.is_available():
        packed = torch.ops.mkl._mkl_reorder_linear_weight(weight, rows)
        found["mkl packed"] = lambda: torch.ops.mkl._mkl_linear(x, packed, weight, bias, rows)
    if torch.backends.mkldnn.is_available():
        reordered = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        found["onednn"] = lambda: torch.ops.mkldnn._linear_pointwise(
            x, reordered, bias, "none", [], ""
        )
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=3840, help="rows per call (real tokens)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per kernel")
    parser.add_argument("--json", type=Path, default=None, help="also write the rows here")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"cpu: {cpu_class().describe()}; torch {torch.__version__}, {torch.get_num_threads()}")
    print("| in -> out | kernel | ms | GFLOP/s |\n|---|---|---:|---:|")
    rows = []
    generator = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        for fan_in, fan_out in SHAPES:
            x = torch.randn(args.tokens, fan_in, generator=generator)
            weight = torch.randn(fan_out, fan_in, generator=generator)
            bias = torch.randn(fan_out, generator=generator)
            flops = 2 * args.tokens * fan_in * fan_out
            for name, call in kernels(x, weight, bias).items():
                ms = best_of(call, args.repeats) * 1000
                rows.append({"shape": [fan_in, fan_out], "kernel": name, "ms": ms})
                print(f"| {fan_in} -> {fan_out} | {name} | {ms:.2f} | {flops / ms / 1e6:.0f} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
