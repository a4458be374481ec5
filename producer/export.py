"""Export results to .npz (arrays ``ids``, ``vectors``) or .jsonl (``{"id", "vector"}``)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import numpy as np
from embedfleet.shared.protocol import Result

SUPPORTED_SUFFIXES = (".npz", ".jsonl")


def write_export(latest: Mapping[str, Result], out: Path) -> int:
    """Write one vector per id (the caller keeps the latest per id); returns how many."""
    suffix = out.suffix.lower()
    if suffix not in SUPPORTED_SUFFIXES:
        raise ValueError(f"--out must end in .npz or .jsonl, got {out.name!r}")
    out.parent.mkdir(parents=True, exist_ok=True)
    ids = list(latest)
    if suffix == ".npz":
        dim = next(iter(latest.values())).dim if latest else 0
        vectors = (
            np.stack([latest[i].vector for i in ids]) if ids else np.zeros((0, dim), np.float16)
        )
        np.savez(out, ids=np.array(ids, dtype=str), vectors=vectors.astype(np.float16))
    else:
        with out.open("w") as handle:
            for chunk_id in ids:
                vector = latest[chunk_id].vector.astype(np.float32).tolist()
                handle.write(json.dumps({"id": chunk_id, "vector": vector}) + "\n")
    return len(ids)
