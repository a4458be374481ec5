"""Export vectors to .npz (arrays ``ids``, ``vectors``) or .jsonl (``{"id", "vector"}``).

The rows come from the results stream (the Redis sink) or from the vector database the workers
write (``VectorBackend.export_rows``): anything with an ``id`` and a float16 ``vector``.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

SUPPORTED_SUFFIXES = (".npz", ".jsonl")


class ExportRow(Protocol):
    @property
    def id(self) -> str: ...

    @property
    def vector(self) -> np.ndarray: ...


def write_export(rows: Sequence[ExportRow], out: Path) -> int:
    """Write one vector per row (the caller keeps one row per id); returns how many."""
    suffix = out.suffix.lower()
    if suffix not in SUPPORTED_SUFFIXES:
        raise ValueError(f"--out must end in .npz or .jsonl, got {out.name!r}")
    out.parent.mkdir(parents=True, exist_ok=True)
    if suffix == ".npz":
        vectors = np.stack([row.vector for row in rows]) if rows else np.zeros((0, 0), np.float16)
        ids = np.array([row.id for row in rows], dtype=str)
        np.savez(out, ids=ids, vectors=vectors.astype(np.float16))
    else:
        with out.open("w") as handle:
            for row in rows:
                vector = np.asarray(row.vector, np.float32).tolist()
                handle.write(json.dumps({"id": row.id, "vector": vector}) + "\n")
    return len(rows)
