"""The producer's document splitters: one per options, for its own model's tokenizer.

Built on first use (``DocumentSplitter``, producer/documents.py, needs the ``documents`` extra,
imported only then): the tokenizer from the model's files, the maximum and prompts from the
model card once one was read, else as the model's directory declares them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from embedfleet.producer.lane import ProducerLane
from embedfleet.shared.modelcard import ModelCard

if TYPE_CHECKING:
    from embedfleet.producer.documents import DocumentSplitter


class DocumentSplitters:
    """The splitters of one producer lane, kept by (overlap, prompt, card read or not)."""

    def __init__(self, lane: ProducerLane) -> None:
        self.lane = lane
        self._built: dict[tuple[int, str | None, bool], DocumentSplitter] = {}

    def splitter(
        self, overlap_tokens: int | None, prompt_name: str | None, card: ModelCard | None
    ) -> DocumentSplitter:
        """The splitter for the lane's model (EMBEDFLEET_MODEL), ``card`` its model card if
        one was read; a ValueError for a lane of another model than the settings name."""
        from embedfleet.producer.documents import DocumentSplitter, SplitLimits
        from embedfleet.shared.model_path import resolve_model_path

        settings = self.lane.settings
        if self.lane.keys.model_lane != settings.model_lane:
            model = self.lane.keys.model_lane or "the namespace's default model"
            raise ValueError(
                f"documents for {model!r} are split with that model's tokenizer: use a Producer "
                "whose settings name it (EMBEDFLEET_MODEL_LANE and EMBEDFLEET_MODEL, the "
                "model's directory)"
            )

        overlap = settings.document_overlap_tokens if overlap_tokens is None else overlap_tokens
        key = (overlap, prompt_name, card is not None)
        if key not in self._built:
            limits = None if card is None else SplitLimits.of_card(card)
            self._built[key] = DocumentSplitter(
                resolve_model_path(settings.model),
                limits,
                overlap_tokens=overlap,
                prompt_name=prompt_name,
            )
        return self._built[key]
