"""Request inputs → texts the workers embed, checked against the limits; vectors → the answer.

OpenAI's ``input`` may be a string, a list of strings, one list of token ids or a list of them.
Token ids are decoded with the model's tokenizer (special tokens dropped) and the worker
tokenizes the text again: for the ids a tokenizer produced from text this gives the same ids.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence

import numpy as np

from embedfleet.gateway.errors import APIError
from embedfleet.producer.tokens import ModelTokenizer
from embedfleet.shared.postprocess import normalize
from embedfleet.shared.settings import Settings

EmbeddingInput = str | list[str] | list[int] | list[list[int]]


def as_texts(value: EmbeddingInput, tokenizer: ModelTokenizer, param: str = "input") -> list[str]:
    """The texts of an OpenAI ``input`` (or TEI ``inputs``), in order; 400 for a bad shape."""
    if isinstance(value, str):
        items: list[object] = [value]
    elif isinstance(value, list) and value and all(isinstance(v, int) for v in value):
        items = [value]  # one list of token ids
    else:
        items = list(value)
    if not items:
        raise APIError(400, f"'{param}' must not be empty", param=param, code="invalid_input")
    texts: list[str] = []
    for index, item in enumerate(items):
        if isinstance(item, str):
            text = item
        elif isinstance(item, list) and all(
            isinstance(v, int) and not isinstance(v, bool) for v in item
        ):
            bad = [v for v in item if not 0 <= v < tokenizer.vocab_size]
            if bad:
                raise APIError(
                    400,
                    f"'{param}[{index}]' has token ids outside the model's vocabulary "
                    f"(0..{tokenizer.vocab_size - 1}): {bad[:5]}",
                    param=param,
                    code="invalid_input",
                )
            text = tokenizer.decode(item)
        else:
            raise APIError(
                400,
                f"'{param}[{index}]' must be a string or a list of token ids",
                param=param,
                code="invalid_input",
            )
        if not text.strip():
            raise APIError(
                400,
                f"'{param}[{index}]' is empty; every input must contain text",
                param=param,
                code="invalid_input",
            )
        texts.append(text)
    return texts


def check_limits(texts: Sequence[str], settings: Settings, param: str = "input") -> None:
    if len(texts) > settings.gateway_max_inputs:
        raise APIError(
            413,
            f"{len(texts)} inputs in one request; at most {settings.gateway_max_inputs} "
            "(EMBEDFLEET_GATEWAY_MAX_INPUTS). Split the request, or use the Batch API.",
            param=param,
            code="too_many_inputs",
        )
    for index, text in enumerate(texts):
        if len(text) > settings.gateway_max_input_chars:
            raise APIError(
                413,
                f"'{param}[{index}]' has {len(text):,} characters; at most "
                f"{settings.gateway_max_input_chars:,} (EMBEDFLEET_GATEWAY_MAX_INPUT_CHARS). "
                "Split long documents into chunks first.",
                param=param,
                code="input_too_long",
            )


def prepare(
    value: EmbeddingInput, tokenizer: ModelTokenizer, settings: Settings, param: str = "input"
) -> list[str]:
    texts = as_texts(value, tokenizer, param)
    check_limits(texts, settings, param)
    return texts


def check_dimensions(dimensions: int | None, model_dim: int | None) -> None:
    """400 for ``dimensions`` out of range; ``model_dim`` None (no model card yet): only the
    lower bound here, the worker refuses one over the model's dimension."""
    if dimensions is None:
        return
    if dimensions < 1 or (model_dim is not None and dimensions > model_dim):
        upper = f"the model's {model_dim}" if model_dim is not None else "the model's dimension"
        raise APIError(
            400,
            f"'dimensions' must be between 1 and {upper}, got {dimensions}",
            param="dimensions",
            code="invalid_dimensions",
        )


def unit_vectors(vectors: np.ndarray, unit: bool) -> np.ndarray:
    """The answer's vectors in float32: unit length when ``unit`` (the model normalises, or TEI's
    ``normalize``), normalised once here, in float32, so what crossed the wire as fp16 (and was
    truncated and renormalised by the worker) leaves at norm 1."""
    return normalize(vectors) if unit else np.asarray(vectors, dtype=np.float32)


def encode_vector(vector: np.ndarray, encoding_format: str) -> list[float] | str:
    """``float``: a JSON list; ``base64``: little-endian float32 bytes, as OpenAI sends."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return [float(v) for v in np.asarray(vector, dtype=np.float32)]
