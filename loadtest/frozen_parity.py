"""How far the frozen query graph is from the eager model, per weight dtype: ``python -m
loadtest.frozen_parity``.

Prints min cosine on the precision probe texts (single texts and padded batches) of frozen vs
eager, frozen vs float32 eager and eager vs float32 eager, for float32 weights and for what
``EMBEDFLEET_DTYPE=auto`` picks here. One thread. docs/BENCHMARKS.md (the Zen 5 rejection)
has the figures and what follows from them.
"""

from __future__ import annotations

import argparse

import torch

from embedfleet.workers.model.encoder import Encoder
from embedfleet.workers.model.frozen import freeze
from embedfleet.workers.model.precision import PROBE_TEXTS, cosines


def main() -> None:
    # No options; the parser is there so that --help explains instead of loading two models.
    argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    ).parse_args()
    torch.set_num_threads(1)
    reference = Encoder(dtype="float32", threads=1)
    probe = [[PROBE_TEXTS[0]], [PROBE_TEXTS[-1]], list(PROBE_TEXTS[:4]), list(PROBE_TEXTS)]
    print("| weights | frozen vs eager | frozen vs fp32 eager | eager vs fp32 eager |")
    print("|---|---:|---:|---:|")
    for dtype in ("float32", "auto"):
        encoder = reference if dtype == "float32" else Encoder(dtype=dtype, threads=1)
        example = encoder.collate(encoder.tokenize(["a query", "a longer query, so it pads"]))
        frozen = freeze(encoder._model, (example.input_ids, example.attention_mask))
        worst = [1.0, 1.0, 1.0]
        for texts in probe:
            batch = encoder.collate(encoder.tokenize(texts))
            eager = encoder.embed(batch)
            fast = encoder.paths.through(frozen).embed(batch)
            exact = reference.embed(batch)
            for i, (a, b) in enumerate(((eager, fast), (exact, fast), (exact, eager))):
                worst[i] = min(worst[i], float(cosines(a, b).min()))
        print(f"| {encoder.precision.describe()} | " + " | ".join(f"{w:.13f}" for w in worst))


if __name__ == "__main__":
    main()
