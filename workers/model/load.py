"""What a worker loads from a sentence-transformers directory: its card, its fast tokenizer, the
transformer in the class its kind of model needs, and that kind's representation.

One class per representation (workers/model/base.py), chosen once here: it names the
transformers class to load (dense: the bare transformer; sparse: its MLM head too, SPLADE;
rerank: its classification head, CrossEncoder) and reads the output. The encoder
(workers/model/encoder.py) holds what :func:`load_model` returns.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer
from transformers.utils import logging as transformers_logging

from embedfleet.shared.model_path import ModelNotFoundError
from embedfleet.shared.modelcard import ModelCard, max_input_tokens
from embedfleet.workers.model.base import Representation
from embedfleet.workers.model.clip import DUAL_MODALITIES, dual_kind_of, dual_spec, load_dual
from embedfleet.workers.model.dense import Dense
from embedfleet.workers.model.model_dir import ModelSpec, read_model_spec
from embedfleet.workers.model.multivector import MultiVector
from embedfleet.workers.model.rerank import Rerank
from embedfleet.workers.model.sparse import Sparse
from embedfleet.workers.model.tokenizer import TextTokenizer

REPRESENTATIONS: dict[str, type[Representation]] = {
    "dense": Dense,
    "sparse": Sparse,
    "rerank": Rerank,
}


@dataclass(frozen=True)
class LoadedModel:
    """One model directory, loaded."""

    spec: ModelSpec  # modules, pooling, Dense, Normalize, prompts (workers/model/model_dir.py)
    model: torch.nn.Module  # the transformer, in eval mode on its device
    # the sentence pipeline (pooling, Dense, Normalize): on every model's card; the dense
    # vectors and every copy that ends in pooling (frozen, int8, CUDA queries) run it
    sentence: Dense
    representation: Representation  # what the transformer's output becomes
    text: TextTokenizer  # texts to token ids and padded batches, cut to the model's maximum
    # what the lane embeds (the card's ``modalities``); a dual encoder (CLIP, SigLIP:
    # workers/model/clip.py) embeds images too, after this image processor
    modalities: tuple[str, ...] = ("text",)
    image_processor: Any = None

    def card(self, name: str) -> ModelCard:
        """The facts a worker serving this model as ``name`` publishes (shared/modelcard.py)."""
        config: Any = self.model.config
        return ModelCard(
            name=name,
            dim=self.representation.dim,
            max_length=self.text.max_length,
            normalize=self.spec.normalize,
            prompts=dict(self.spec.prompts),
            default_prompt_name=self.spec.default_prompt_name,
            hidden_size=int(config.hidden_size),
            pooling=self.spec.pooling_modes,
            include_prompt=self.spec.include_prompt,
            architecture=str((getattr(config, "architectures", None) or [""])[0]),
            representations=self.representation.representations,
            # a cross-encoder tokenizes (query, document) pairs, never a producer's single ids
            tokenizer_fingerprint=""
            if "rerank" in self.representation.representations
            else self.text.fingerprint,
            modalities=self.modalities,
        )


def representation_class(spec: ModelSpec) -> type[Representation]:
    """The class of what ``spec``'s model gives, chosen once at load: a dense model with
    BGE-M3's token heads beside its pipeline gives several representations (MultiVector)."""
    if spec.representation == "dense" and spec.token_heads is not None:
        return MultiVector
    return REPRESENTATIONS[spec.representation]


def load_model(model_dir: Path, device: torch.device, load_dtype: torch.dtype) -> LoadedModel:
    """The model in ``model_dir`` on ``device``, its weights in ``load_dtype``. Refuses (with
    :class:`ModelNotFoundError`, or the card's own errors) what it cannot reproduce."""
    if dual_kind_of(model_dir) is not None:
        return _load_dual(model_dir, device, load_dtype)
    spec = read_model_spec(model_dir)
    transformer_dir = spec.transformer_dir
    tokenizer = AutoTokenizer.from_pretrained(transformer_dir)
    if not tokenizer.is_fast:
        raise ModelNotFoundError(f"{transformer_dir} has no fast tokenizer (tokenizer.json)")
    transformers_logging.disable_progress_bar()  # a local load needs no progress bar
    kind = representation_class(spec)
    model = kind.auto_model.from_pretrained(transformer_dir, dtype=load_dtype)
    model.to(device).eval()
    config = model.config
    sentence = Dense(spec, device, int(config.hidden_size))
    position_limit = getattr(config, "max_position_embeddings", 512)
    max_length = max_input_tokens(spec.max_seq_length, tokenizer.model_max_length, position_limit)
    text = TextTokenizer(tokenizer, spec, max_length)
    representation = _build_representation(
        kind, spec, sentence, tokenizer, model, device, model_dir
    )
    return LoadedModel(spec, model, sentence, representation, text)


def _load_dual(model_dir: Path, device: torch.device, load_dtype: torch.dtype) -> LoadedModel:
    """A CLIP or SigLIP directory: its text tower where the worker runs a transformer (texts
    go the text path whole), its image tower and processor for image chunks."""
    parts = load_dual(model_dir, device, load_dtype)
    spec = dual_spec(model_dir)
    sentence = Dense(spec, device, int(parts.model.config.hidden_size))  # (copies: unused)
    return LoadedModel(
        spec,
        parts.model,
        sentence,
        parts.representation,
        TextTokenizer(parts.tokenizer, spec, parts.max_length),
        modalities=DUAL_MODALITIES,
        image_processor=parts.processor,
    )


def _build_representation(
    kind: type[Representation],
    spec: ModelSpec,
    sentence: Dense,
    tokenizer: Any,
    model: torch.nn.Module,
    device: torch.device,
    model_dir: Path,
) -> Representation:
    if kind is Dense:
        return sentence
    if kind is MultiVector:
        heads = spec.token_heads
        assert heads is not None
        return MultiVector(sentence, heads, tokenizer, model.config, device, model_dir)
    if kind is Sparse:
        return Sparse(spec, model.config)
    return Rerank(spec, model.config, spec.transformer_dir)
