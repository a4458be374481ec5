"""Model cards the tests share: the facts a worker would publish about a small model, for the
tests that check a chunk against a card or a card's round trip without loading one."""

from __future__ import annotations

from typing import Any

from embedfleet.shared.modelcard import ModelCard


def tiny_card(**fields: Any) -> ModelCard:
    """A 48-dimension, 128-token, normalising card named ``tiny`` with a ``query`` and a
    ``passage`` prompt (``q: ``, ``p: ``); ``fields``: more of its fields."""
    return ModelCard(
        name="tiny",
        dim=48,
        max_length=128,
        normalize=True,
        prompts={"query": "q: ", "passage": "p: "},
        **fields,
    )
