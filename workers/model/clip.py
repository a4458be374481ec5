"""Dual encoders (CLIP, SigLIP): a text tower and an image tower embedding into one space.

A ``transformers`` ``CLIPModel`` or ``SiglipModel`` directory, loaded from a local path as
users have it: text chunks embed with ``get_text_features`` after the model's tokenizer (as its
processor pads them: CLIP to the longest text, SigLIP to the fixed length it was trained with,
since SigLIP's text tower pools the last position whatever the mask), image chunks with
``get_image_features`` after the model's own image processor (workers/images.py decodes and
preprocesses them on the host's threads). The vectors are the features as the model returns
them, in float32, as ``get_*_features`` answers them.

The card (shared/modelcard.py ``modalities``) says what a lane serves: a dual encoder serves
``text`` and ``image``; every other model ``text`` alone (the options verifier's
``check_modality``, shared/options.py, refuses the other modality).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import transformers
from transformers.utils import logging as transformers_logging

from embedfleet.shared.model_path import ModelNotFoundError
from embedfleet.workers.model.base import Forward, Representation
from embedfleet.workers.model.forward import layer_stack
from embedfleet.workers.model.model_dir import ModelSpec, UnsupportedModelError


@dataclass(frozen=True)
class DualKind:
    """One family of dual encoder: how it loads and how its texts are padded. The classes are
    named, not imported: ``transformers`` loads a model's module (and an image processor's,
    which brings torch.distributed and sympy: ~2.5 s) when it is first asked for, and every
    worker imports this module, most of them to serve text."""

    model_class_name: str
    # the PIL processor: decoding and resizing stay on the host's threads (workers/images.py)
    processor_class_name: str
    # SigLIP was trained on texts padded to a fixed length and pools the last position
    pad_to_max_length: bool

    @property
    def model_class(self) -> Any:
        return getattr(transformers, self.model_class_name)

    @property
    def processor_class(self) -> Any:
        return getattr(transformers, self.processor_class_name)


DUAL_KINDS: dict[str, DualKind] = {
    "clip": DualKind("CLIPModel", "CLIPImageProcessorPil", pad_to_max_length=False),
    "siglip": DualKind("SiglipModel", "SiglipImageProcessorPil", pad_to_max_length=True),
}
DUAL_MODALITIES = ("text", "image")
# the sentence-transformers modules that wrap a dual encoder whole: v5+'s Transformer with text
# and image modalities, and the legacy CLIPModel module
SENTENCE_WRAPPERS = ("Transformer", "CLIPModel")
TOWER_METHODS = {"text": "get_text_features", "image": "get_image_features"}


def dual_kind_of(model_dir: Path) -> str | None:
    """``clip`` or ``siglip`` where ``model_dir``'s ``config.json`` is one of those dual
    encoders; None for any other model (a text model, read by workers/model/load.py)."""
    config_file = model_dir / "config.json"
    if not config_file.is_file():
        return None
    model_type = json.loads(config_file.read_text()).get("model_type")
    return model_type if model_type in DUAL_KINDS else None


def dual_spec(model_dir: Path) -> ModelSpec:
    """The worker's spec of a dual encoder's directory: a plain Hugging Face one, or one that
    sentence-transformers saved as a single module around it (its ``encode`` is then the towers'
    features, as here). Any other module (a Normalize, a Dense after it) is refused at start
    rather than left out of the vectors."""
    modules_file = model_dir / "modules.json"
    if modules_file.is_file():
        modules = json.loads(modules_file.read_text())
        kinds = [str(module.get("type", "")).rsplit(".", 1)[-1] for module in modules]
        paths = {str(module.get("path", "")) for module in modules}
        if len(kinds) != 1 or kinds[0] not in SENTENCE_WRAPPERS or paths - {"", "."}:
            raise UnsupportedModelError(
                f"{model_dir}: modules.json holds {kinds}; a CLIP or SigLIP model is served as "
                "one module at the directory's root (Transformer or CLIPModel), nothing after it"
            )
        _check_towers(model_dir)
    return ModelSpec(transformer_dir=model_dir, pooling_modes=())


def _check_towers(model_dir: Path) -> None:
    config_file = model_dir / "sentence_bert_config.json"
    config = json.loads(config_file.read_text()) if config_file.is_file() else {}
    modalities = config.get("modality_config", {})
    methods = {name: part.get("method") for name, part in modalities.items()}
    if modalities and methods != TOWER_METHODS:
        raise UnsupportedModelError(
            f"{model_dir}: sentence_bert_config.json's modality_config calls {methods}; the "
            f"worker embeds with {TOWER_METHODS}"
        )


class TextTowerModel(torch.nn.Module):
    """A dual encoder's text tower as the worker's eager path calls a transformer
    (``model(input_ids=, attention_mask=)``): its ``get_text_features``. The whole dual model
    is held, so the image tower (:meth:`image_features`) shares its weights and device."""

    def __init__(self, dual: Any, kind: DualKind, pad_id: int) -> None:
        super().__init__()
        self.dual = dual
        self.config = dual.config.text_config
        self.pad_to = int(self.config.max_position_embeddings) if kind.pad_to_max_length else 0
        self.pad_id = pad_id

    def forward(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, **_: Any
    ) -> torch.Tensor:
        if self.pad_to:
            # SigLIP pools the last position with no mask: rows padded to the length it was
            # trained with, as its processor pads them, whatever the batch's longest
            extra = self.pad_to - input_ids.shape[1]
            input_ids = torch.nn.functional.pad(input_ids, (0, extra), value=self.pad_id)
            return _tensor(self.dual.get_text_features(input_ids=input_ids))
        return _tensor(
            self.dual.get_text_features(input_ids=input_ids, attention_mask=attention_mask)
        )

    def layer_stacks(self) -> list[torch.nn.ModuleList]:
        """Both towers' transformer layers, where the query stage gets in on a CPU
        (``EagerPath.set_layer_callback``): an image batch is as long as a text one, and a
        query waits at most one layer behind it too."""
        return [layer_stack(self.dual.text_model), layer_stack(self.dual.vision_model)]

    def image_features(self, pixels: torch.Tensor) -> torch.Tensor:
        """The image tower's features for preprocessed images (batch, channels, h, w)."""
        dtype = next(self.dual.parameters()).dtype
        return _tensor(self.dual.get_image_features(pixel_values=pixels.to(dtype)))


class TextTower(Representation):
    """A dual encoder's text vectors: the tower's features, as ``get_text_features`` answers."""

    name = "dense"
    auto_model = None  # loaded by :func:`load_dual`, not by a transformers Auto class

    def __init__(self, dim: int) -> None:
        self.dim = dim

    def vectors(self, forward: Forward) -> torch.Tensor:
        features: torch.Tensor = forward.output
        return features.float()


@dataclass(frozen=True)
class DualParts:
    """What :func:`load_dual` gives the model loader (workers/model/load.py)."""

    model: TextTowerModel
    tokenizer: Any
    processor: Any  # the model's PIL image processor (workers/images.py runs it)
    representation: TextTower
    max_length: int


def load_dual(model_dir: Path, device: torch.device, dtype: torch.dtype) -> DualParts:
    """``model_dir``'s CLIP or SigLIP model on ``device`` in ``dtype``, as the worker runs it."""
    kind_name = dual_kind_of(model_dir)
    if kind_name is None:
        raise ModelNotFoundError(f"{model_dir} is not a CLIP or SigLIP model directory")
    kind = DUAL_KINDS[kind_name]
    transformers_logging.disable_progress_bar()
    dual = kind.model_class.from_pretrained(model_dir, dtype=dtype)
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    if not tokenizer.is_fast:
        raise ModelNotFoundError(f"{model_dir} has no fast tokenizer (tokenizer.json)")
    model = TextTowerModel(dual, kind, int(tokenizer.pad_token_id or 0)).to(device).eval()
    dim = int(getattr(dual.config, "projection_dim", 0) or model.config.hidden_size)
    if kind_name == "siglip":  # SigLIP's text head keeps the width
        dim = int(getattr(model.config, "projection_size", None) or model.config.hidden_size)
    return DualParts(
        model=model,
        tokenizer=tokenizer,
        processor=kind.processor_class.from_pretrained(model_dir),
        representation=TextTower(dim),
        max_length=int(model.config.max_position_embeddings),
    )


def _tensor(output: Any) -> torch.Tensor:
    return output if isinstance(output, torch.Tensor) else output.pooler_output
