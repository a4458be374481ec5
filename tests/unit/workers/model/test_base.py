"""workers/model/base.py: what a representation gives unless it says otherwise (its one name,
no heads, its rows as they are) and the refusal to cut pairs for a model that is no
cross-encoder."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from embedfleet.workers.model.base import Forward, Representation


class Plain(Representation):
    name = "plain"
    auto_model = None
    dim = 2

    def vectors(self, forward: Forward) -> torch.Tensor:
        return forward.output


def test_a_representation_gives_itself_and_its_rows_as_they_are() -> None:
    plain = Plain()
    assert plain.representations == ("plain",)
    assert plain.heads_for([["plain"], []]) is None
    rows = np.array([[1.0, -2.0]], np.float32)
    assert plain.activate(rows) is rows
    forward = Forward(torch.ones(1, 2), torch.zeros(1, 3, dtype=torch.int64), torch.ones(1, 3))
    assert forward.heads is None and forward.prompt_lengths is None
    assert plain.vectors(forward) is forward.output
    assert not plain.ends_in_pooling and plain.layout is None


def test_only_a_cross_encoder_cuts_pairs() -> None:
    with pytest.raises(ValueError, match="pairs are scored by a cross-encoder"):
        Plain().cut_pairs(["q"], ["d"], 16)


def test_a_representation_must_say_how_it_makes_vectors() -> None:
    class Unfinished(Representation):  # no vectors()
        name = "unfinished"

    with pytest.raises(TypeError, match="abstract"):
        Unfinished()  # type: ignore[abstract]
