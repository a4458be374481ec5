"""workers/model/encoder.py's device and dtype settings: what `auto` resolves to, and the
refusal of CUDA where torch sees none (the encoder itself: tests/integration/workers/)."""

from __future__ import annotations

import pytest
import torch

from embedfleet.workers.model.encoder import resolve_device, resolve_dtype


def test_auto_is_cuda_where_torch_sees_it_else_the_cpu() -> None:
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected
    assert resolve_device("cpu") == torch.device("cpu")


@pytest.mark.skipif(torch.cuda.is_available(), reason="refused only where there is no CUDA")
def test_cuda_without_a_device_is_refused_with_what_to_set() -> None:
    with pytest.raises(RuntimeError, match="EMBEDFLEET_DEVICE=cuda but torch sees no CUDA"):
        resolve_device("cuda")


def test_an_explicit_dtype_is_the_one_asked_for() -> None:
    cpu = torch.device("cpu")
    assert resolve_dtype("float32", cpu) is torch.float32
    assert resolve_dtype("bfloat16", cpu) is torch.bfloat16
    assert resolve_dtype("auto", cpu) in (torch.float32, torch.bfloat16)
