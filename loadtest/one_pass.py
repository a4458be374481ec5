"""One pass for every representation vs a pass per representation (issue 32).

A BGE-M3-shaped model (tests/model_zoo.py ``bge_m3_dir``: an XLM-R of the width and depth asked
for, random weights, with its sparse and ColBERT heads) embeds the same texts two ways, through
the worker's own stages (length-sorted batches under a token budget, ``Encoder.embed``,
``Outputs.results``):

- **one pass**: each batch asks for dense, sparse and multivector at once (``EncodeBatch.heads``),
  one forward pass, the three heads on its hidden states;
- **separate**: three runs over the texts, one representation each, as a fleet without one-pass
  support would serve them (three models, or three requests).

It counts the transformer's forward calls (a hook) and times both, best of ``--rounds``.

    python -m loadtest.one_pass --hidden 384 --layers 6 --texts 256
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import click

from embedfleet.shared.protocol import Chunk
from embedfleet.shared.settings import Settings
from embedfleet.workers.batcher import plan_batches
from embedfleet.workers.calibration import CalibrationStore
from embedfleet.workers.model.encoder import Encoder
from embedfleet.workers.output import Outputs

ALL = ("dense", "sparse", "multivector")


def run(
    encoder: Encoder, outputs: Outputs, texts: Sequence[str], wanted: tuple[str, ...], budget: int
) -> int:
    """Embed ``texts`` asking for ``wanted``; returns the results made."""
    chunks = [Chunk(id=str(i), text=t, representations=wanted) for i, t in enumerate(texts)]
    tokens = encoder.tokenize(list(texts))
    made = 0
    for planned in plan_batches([t.length for t in tokens], token_budget=budget, max_batch=64):
        batch_chunks = [chunks[p] for p in planned.positions]
        batch = encoder.collate([tokens[p] for p in planned.positions])
        batch.heads = outputs.heads_for(batch_chunks)
        rows = encoder.embed(batch)
        made += len(outputs.results(batch_chunks, rows, [False] * len(batch_chunks)))
    return made


@click.command()
@click.option("--hidden", type=int, default=384, show_default=True, help="Model width.")
@click.option("--layers", type=int, default=6, show_default=True, help="Transformer layers.")
@click.option("--texts", "count", type=int, default=256, show_default=True)
@click.option("--max-length", type=int, default=128, show_default=True)
@click.option("--budget", type=int, default=4096, show_default=True, help="Tokens per batch.")
@click.option("--rounds", type=int, default=3, show_default=True)
def main(hidden: int, layers: int, count: int, max_length: int, budget: int, rounds: int) -> None:
    from tests.model_zoo import bge_m3_dir, corpus_lines

    lines = corpus_lines()
    texts = [" ".join(lines[i : i + 1 + i % 6]) for i in range(0, 7 * count, 7)][:count]
    with tempfile.TemporaryDirectory() as root:
        model_dir = bge_m3_dir(Path(root), hidden=hidden, layers=layers, max_seq_length=max_length)
        encoder = Encoder(str(model_dir), device="cpu", threads=int(os.environ.get("THREADS", 0)))
        outputs = Outputs(Settings(), encoder, CalibrationStore(None, None, encoder.name))  # type: ignore[arg-type]
        forwards: list[int] = []
        hook = encoder._model.register_forward_hook(lambda *_: forwards.append(1))
        plans: dict[str, list[tuple[str, ...]]] = {
            "one pass": [ALL],
            "separate": [(name,) for name in ALL],
        }
        figures: dict[str, dict[str, float]] = {}
        run(encoder, outputs, texts[:16], ALL, budget)  # warm-up
        for name, passes in plans.items():
            best = float("inf")
            for _ in range(rounds):
                forwards.clear()
                started = time.perf_counter()
                for wanted in passes:
                    run(encoder, outputs, texts, wanted, budget)
                best = min(best, time.perf_counter() - started)
            figures[name] = {"seconds": round(best, 3), "forwards": len(forwards)}
        hook.remove()
    ratio = figures["separate"]["seconds"] / figures["one pass"]["seconds"]
    report = {
        "model": f"XLM-R {hidden}x{layers}, max {max_length} tokens",
        "texts": count,
        **{f"{name} {key}": value for name, row in figures.items() for key, value in row.items()},
        "separate / one pass (wall)": round(ratio, 2),
        "load average": os.getloadavg(),
    }
    click.echo(json.dumps(report))


if __name__ == "__main__":
    main()
