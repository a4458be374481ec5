"""Vector post-processing, the one place for it: Matryoshka truncation, (re)normalisation and
quantisation. numpy only, so the worker (on its results) and the gateway (on what crossed the
wire as fp16) apply the same operations.

``truncate``
    Keep the first ``dim`` values of each row (Matryoshka), renormalised when asked: a truncated
    unit vector is no longer unit length, so cosine and dot-product search would disagree.
``normalize``
    Unit length per row, with ``torch.nn.functional.normalize``'s rule (divide by
    ``max(norm, 1e-12)``), as sentence-transformers' ``Normalize`` module computes it.
``quantize``
    ``float16`` / ``float32``, or ``sentence_transformers.quantize_embeddings``' ``int8``,
    ``uint8``, ``binary``, ``ubinary``, reproduced operation for operation so the bytes are the
    same. int8/uint8 need calibration ranges (workers/calibration.py).
"""

from __future__ import annotations

import numpy as np

from embedfleet.shared.protocol import DEFAULT_DTYPE, STORAGE_DTYPES

QUANTIZED = ("int8", "uint8")
# torch.nn.functional.normalize's floor on the norm: a zero vector stays zero
NORM_EPSILON = 1e-12


def normalize(vectors: np.ndarray) -> np.ndarray:
    """Each row at unit length (float32); a zero row stays zero."""
    vectors = np.asarray(vectors, dtype=np.float32)
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    return vectors / np.maximum(norms, NORM_EPSILON)


def truncate(vectors: np.ndarray, dim: int, *, renormalize: bool) -> np.ndarray:
    """The first ``dim`` values of each row (float32), renormalised when ``renormalize``. A
    ``dim`` of the whole row returns ``vectors`` itself: nothing was cut, nothing to redo."""
    if dim >= vectors.shape[1]:
        return vectors
    kept = np.ascontiguousarray(vectors[:, :dim], dtype=np.float32)
    return normalize(kept) if renormalize else kept


def quantize(vectors: np.ndarray, dtype: str, ranges: np.ndarray | None = None) -> np.ndarray:
    """``vectors`` (float32, (n, dim)) in ``dtype``'s stored form.

    The integer and binary branches are sentence-transformers' ``quantize_embeddings`` step for
    step (same operations in the same order, so the same bytes); ``ranges`` is (2, dim):
    per-dimension minimum and maximum from calibration.
    """
    if dtype == DEFAULT_DTYPE:
        return vectors.astype(STORAGE_DTYPES[dtype])
    if dtype == "float32":
        return vectors.astype(np.float32)
    if dtype in QUANTIZED:
        if ranges is None or ranges.shape != (2, vectors.shape[1]):
            raise ValueError(f"{dtype} needs calibration ranges of shape (2, {vectors.shape[1]})")
        ranges = ranges.astype(np.float32, copy=False)
        starts = ranges[0, :]
        steps = (ranges[1, :] - starts) / 255
        steps = np.where(steps == 0, 1, steps)
        codes = np.clip(np.floor((vectors - starts) / steps), 0, 255)
        if dtype == "uint8":
            return codes.astype(np.uint8)
        return (codes - 128).astype(np.int8)
    if dtype == "binary":
        return (np.packbits(vectors > 0, axis=-1) - 128).astype(np.int8)
    if dtype == "ubinary":
        return np.packbits(vectors > 0, axis=-1)
    raise ValueError(f"unknown output dtype {dtype!r}")
