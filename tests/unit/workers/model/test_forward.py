"""workers/model/forward.py's helpers: the layer stack a model's layer callback hooks, the path
kind of a copy, and the sentence pipeline run on a copy's hidden states."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import cast

import numpy as np
import pytest
import torch

from embedfleet.workers.model.dense import Dense
from embedfleet.workers.model.forward import (
    ForwardPath,
    KeptPath,
    copy_kind,
    layer_stack,
    pooled_on_host,
)
from embedfleet.workers.model.model_dir import ModelSpec


class Encoderish(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.heads = torch.nn.ModuleList([torch.nn.Identity()])
        self.layer = torch.nn.ModuleList([torch.nn.Linear(2, 2) for _ in range(3)])


def test_the_layer_stack_is_the_longest_module_list() -> None:
    model = Encoderish()
    assert layer_stack(model) is model.layer
    assert len(layer_stack(torch.nn.Linear(2, 2))) == 0, "none: an empty stack"


def test_a_copy_of_no_known_kind_is_refused() -> None:
    class Other:
        name = "tensorrt"

    with pytest.raises(ValueError, match="not a CPU copy"):
        copy_kind(Other())  # type: ignore[arg-type]


def test_the_sentence_pipeline_runs_on_the_hosts_copy() -> None:
    sentence = Dense(ModelSpec(Path("."), normalize=True), torch.device("cpu"), hidden_size=2)
    hidden = torch.tensor([[[3.0, 0.0], [3.0, 8.0], [9.0, 9.0]]])
    with torch.no_grad():
        vectors = pooled_on_host(sentence, hidden, torch.tensor([[1, 1, 0]]))
    assert isinstance(vectors, np.ndarray)
    np.testing.assert_allclose(vectors, [[0.6, 0.8]], rtol=1e-6)


class _Kept(KeptPath):
    """The facts the encoder takes from ``KeptPath``, over a path of a given kind."""

    def __init__(self, kind: str) -> None:
        self.query_path = cast("ForwardPath", SimpleNamespace(kind=kind, name=f"{kind} path"))


@pytest.mark.parametrize(
    ("kind", "copy", "int8", "engine", "concurrent"),
    [
        ("eager", False, False, None, False),
        ("frozen", True, False, None, False),
        ("int8", True, True, None, False),
        ("onnxruntime", True, False, "onnxruntime", False),
        ("openvino", True, False, "openvino", False),
        ("cuda", False, False, None, True),
    ],
)
def test_the_kept_path_is_described_by_its_kind(
    kind: str, copy: bool, int8: bool, engine: str | None, concurrent: bool
) -> None:
    kept = _Kept(kind)
    assert kept.forward_path == f"{kind} path"
    assert (kept.has_query_graph, kept.computes_in_int8) == (copy, int8)
    assert kept.engine == engine
    assert kept.serves_queries_concurrently is concurrent
