"""Dual encoders (workers/model/clip.py): what loads as one, the text tower's parity with
``get_text_features``, the card's modalities (the refusal of a modality a lane lacks is the
options verifier's: tests/unit/shared/test_options.py)."""

from __future__ import annotations

import io
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from PIL import Image

from embedfleet.shared.model_path import ModelNotFoundError
from embedfleet.shared.modelcard import ModelCard
from embedfleet.workers.images import ImagePipeline
from embedfleet.workers.model.clip import dual_kind_of, load_dual
from embedfleet.workers.model.encoder import Encoder
from embedfleet.workers.model.model_dir import UnsupportedModelError
from tests.image_models import (
    DUAL_FAMILIES,
    dual_model_dir,
    image_bytes,
    min_cosine,
    reference_text_features,
    sentence_transformers_dual_dir,
)
from tests.model_zoo import hf_model_dir, sample_texts


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("dual")


@pytest.mark.parametrize("family", DUAL_FAMILIES)
def test_a_dual_encoder_directory_is_recognised(models: Path, family: str) -> None:
    assert dual_kind_of(dual_model_dir(family, models)) == family


def test_a_text_model_is_not_a_dual_encoder(models: Path) -> None:
    bert = hf_model_dir("bert", models)
    assert dual_kind_of(bert) is None
    assert dual_kind_of(models / "nothing-here") is None
    with pytest.raises(ModelNotFoundError, match="not a CLIP or SigLIP"):
        load_dual(bert, torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("family", DUAL_FAMILIES)
def test_text_vectors_equal_get_text_features(models: Path, family: str) -> None:
    model_dir = dual_model_dir(family, models)
    encoder = Encoder(str(model_dir), device="cpu", dtype="float32")
    texts = sample_texts(3, 400)
    ours = encoder.embed_texts(texts)
    reference = reference_text_features(model_dir, texts)
    assert ours.shape == reference.shape == (len(texts), encoder.dim)
    assert min_cosine(ours, reference) >= 0.9999
    # random weights still tell texts apart: a parity check on identical rows proves nothing
    assert min_cosine(ours[:1], ours[1:2]) < 0.999


@pytest.mark.parametrize("family", DUAL_FAMILIES)
def test_the_card_says_the_lane_serves_text_and_images(models: Path, family: str) -> None:
    encoder = Encoder(str(dual_model_dir(family, models)), device="cpu", dtype="float32")
    card = encoder.card
    assert card.modalities == ("text", "image")
    assert card.dim == encoder.dim
    assert ModelCard.from_fields(card.to_fields()).modalities == ("text", "image")


def test_a_card_written_before_modalities_serves_text() -> None:
    card = ModelCard(name="m", dim=4, max_length=8, normalize=True)
    older = {k: v for k, v in card.to_fields().items() if k != "modalities"}
    assert ModelCard.from_fields(older).modalities == ("text",)


@pytest.mark.parametrize("family", DUAL_FAMILIES)
def test_a_sentence_transformers_dual_encoder_embeds_as_its_encode(
    models: Path, family: str
) -> None:
    """Saved by sentence-transformers (one Transformer module around the model): images equal
    its ``encode`` on PIL images; CLIP's texts equal its ``encode`` too. SigLIP's texts are
    padded to the model's length as its processor pads them (``get_text_features`` as
    transformers documents it), where sentence-transformers 6 pads to the longest text."""
    from sentence_transformers import SentenceTransformer

    model_dir = sentence_transformers_dual_dir(family, models)
    encoder = Encoder(str(model_dir), device="cpu", dtype="float32")
    reference = SentenceTransformer(str(model_dir), device="cpu")
    images = [image_bytes(i, (30 + 5 * i, 50 - 2 * i), "PNG") for i in range(6)]
    opened = [Image.open(io.BytesIO(data)).convert("RGB") for data in images]
    with ThreadPoolExecutor(2) as threads:
        pixels = ImagePipeline(encoder.image_processor, threads, 1 << 20).prepare(images).pixels
    assert min_cosine(encoder.embed_images(pixels), reference.encode(opened)) >= 0.9999
    texts = sample_texts(5, 500)
    expected = (
        reference.encode(texts)
        if family == "clip"
        else reference_text_features(dual_model_dir(family, models), texts)
    )
    assert min_cosine(encoder.embed_texts(texts), expected) >= 0.9999


def test_a_module_after_the_dual_encoder_is_refused_at_start(models: Path) -> None:
    model_dir = sentence_transformers_dual_dir("clip", models, normalize=True)
    with pytest.raises(UnsupportedModelError, match="nothing after it"):
        Encoder(str(model_dir), device="cpu", dtype="float32")


@pytest.mark.parametrize("family", DUAL_FAMILIES)
def test_the_query_stage_gets_in_between_the_layers_of_either_tower(
    models: Path, family: str
) -> None:
    """On a CPU a query is served before any transformer layer of a bulk pass (the layer
    callback): on a dual lane before the image tower's layers too, so it waits at most one
    layer behind an image batch, as behind a text one. A query's own text pass inside the
    image batch leaves the image vectors as they were."""
    model_dir = dual_model_dir(family, models)
    encoder = Encoder(str(model_dir), device="cpu", dtype="float32")
    dual = encoder.loaded.model.dual
    text_layers = len(dual.text_model.encoder.layers)
    image_layers = len(dual.vision_model.encoder.layers)
    with ThreadPoolExecutor(1) as threads:
        pixels = (
            ImagePipeline(encoder.image_processor, threads, 1 << 20)
            .prepare([image_bytes(i, (40, 36), "PNG") for i in range(3)])
            .pixels
        )
    alone = encoder.embed_images(pixels)
    boundaries: list[int] = []
    served: list[object] = []

    def at_boundary() -> None:
        boundaries.append(1)
        if len(boundaries) == 2 and not served:  # a query waiting: served inside the batch
            served.append(encoder.embed_texts(["a red bicycle"]))

    assert encoder.set_layer_callback(at_boundary) == text_layers + image_layers
    try:
        assert min_cosine(encoder.embed_images(pixels), alone) >= 0.99999
    finally:
        encoder.set_layer_callback(None)
    # the image pass's boundaries, and the query's text pass's own (served re-entrantly)
    assert len(boundaries) == image_layers + text_layers
    assert served and min_cosine(served[0], encoder.embed_texts(["a red bicycle"])) >= 0.99999
