"""The gateway's state (embedfleet/gateway/state.py): what it sends needs no model card."""

from __future__ import annotations

from embedfleet.gateway.state import wire_options
from embedfleet.shared.protocol import FULL_DIMENSIONS


def test_wire_options_need_no_model_card() -> None:
    """The gateway enqueues before any worker published: nothing it sends depends on the card,
    and nothing is left to the fleet's defaults (EMBEDFLEET_DIMENSIONS, lane prompts)."""
    plain = wire_options(None, None)
    assert (plain.prompt, plain.prompt_name) == ("", None)  # no prompt, explicitly
    assert plain.dimensions == FULL_DIMENSIONS and plain.dtype == "float16"
    named = wire_options("query", 64)
    assert (named.prompt, named.prompt_name, named.dimensions) == (None, "query", 64)
