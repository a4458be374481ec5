"""workers/model/forward.py's helpers: the layer stack a model's layer callback hooks, the path
kind of a copy, and the sentence pipeline run on a copy's hidden states."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from embedfleet.workers.model.dense import Dense
from embedfleet.workers.model.forward import copy_kind, layer_stack, pooled_on_host
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
