"""TEI's routes (embedfleet/gateway/tei_api.py): /info's model type from the card, and a body
refused as TEI refuses it."""

from __future__ import annotations

from embedfleet.gateway.tei_api import model_type
from embedfleet.shared.modelcard import ModelCard
from tests.unit.gateway.offline import AUTH, offline_gateway, tei_error


def test_a_dense_models_type_names_its_pooling() -> None:
    card = ModelCard(name="tiny", dim=48, max_length=32, normalize=True)
    assert model_type(card) == {"embedding": {"pooling": "mean"}}


def test_inputs_of_another_shape_are_teis_422() -> None:
    answer = offline_gateway().post("/embed", json={"inputs": 3}, headers=AUTH)
    assert tei_error(answer, 422).startswith("invalid request: inputs.str: Input should be")
    assert answer.json()["error_type"] == "Validation"
