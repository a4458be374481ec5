"""A producer lane's document splitters (producer/document_splitters.py): one per overlap,
prompt and card, built once; a lane of another model than the settings' refused."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from embedfleet.producer.document_splitters import DocumentSplitters
from embedfleet.shared.settings import Settings


def _splitters(settings: Settings, model_lane: str | None = None) -> DocumentSplitters:
    keys = settings.keys if model_lane is None else settings.keys.for_model(model_lane)
    # a lane's settings and keys are all a splitter reads of it
    return DocumentSplitters(SimpleNamespace(settings=settings, keys=keys))  # type: ignore[arg-type]


def test_a_splitter_is_built_once_per_overlap_and_prompt() -> None:
    settings = Settings(document_overlap_tokens=16)
    splitters = _splitters(settings)
    default = splitters.splitter(None, None, None)
    assert splitters.splitter(16, None, None) is default  # None: the setting's overlap
    assert splitters.splitter(0, None, None) is not default
    assert splitters.splitter(None, "query", None) is not default


def test_a_lane_of_another_model_is_refused() -> None:
    with pytest.raises(ValueError, match="split with that model's tokenizer"):
        _splitters(Settings(), model_lane="other-model").splitter(None, None, None)
