"""shared/postprocess.py: truncation, normalisation, quantisation (numpy only), the operations
the worker applies to its results and the gateway to what crossed the wire."""

from __future__ import annotations

import numpy as np
import pytest

from embedfleet.shared.postprocess import normalize, quantize, truncate


def unit_rows(n: int = 4, dim: int = 16) -> np.ndarray:
    vectors = np.random.default_rng(3).standard_normal((n, dim)).astype(np.float32)
    return vectors / np.linalg.norm(vectors, axis=1, keepdims=True)


def test_normalize_as_torch_does_it() -> None:
    import torch

    vectors = np.random.default_rng(1).standard_normal((5, 8)).astype(np.float32) * 7
    vectors[2] = 0.0  # a zero row stays zero (the norm's floor), never NaN
    ours = normalize(vectors)
    theirs = torch.nn.functional.normalize(torch.from_numpy(vectors), p=2, dim=1).numpy()
    assert ours.dtype == np.float32
    assert np.allclose(ours, theirs, atol=1e-7)
    assert not np.isnan(ours).any() and not ours[2].any()


def test_truncate_keeps_the_first_values_renormalised_when_asked() -> None:
    vectors = unit_rows()
    cut = truncate(vectors, 4, renormalize=True)
    assert cut.shape == (4, 4) and np.allclose(np.linalg.norm(cut, axis=1), 1.0)
    assert np.allclose(cut / cut[:, :1], vectors[:, :4] / vectors[:, :1])  # same direction
    raw = truncate(vectors * 3, 4, renormalize=False)
    assert np.allclose(raw, vectors[:, :4] * 3)  # sentence-transformers' truncate_dim
    assert truncate(vectors, 16, renormalize=True) is vectors  # nothing cut, nothing redone


@pytest.mark.parametrize("dtype", ["float16", "float32", "binary", "ubinary"])
def test_quantize_without_calibration(dtype: str) -> None:
    from sentence_transformers.util.quantization import quantize_embeddings

    vectors = unit_rows()
    stored = quantize(vectors, dtype)
    if dtype.startswith("float"):
        assert stored.dtype == np.dtype(dtype) and np.allclose(stored, vectors, atol=1e-3)
    else:
        assert stored.tobytes() == quantize_embeddings(vectors, precision=dtype).tobytes()


def test_quantize_refuses_what_it_cannot_do() -> None:
    with pytest.raises(ValueError, match=r"int8 needs calibration ranges of shape \(2, 16\)"):
        quantize(unit_rows(), "int8")
    with pytest.raises(ValueError, match="unknown output dtype 'int4'"):
        quantize(unit_rows(), "int4")
