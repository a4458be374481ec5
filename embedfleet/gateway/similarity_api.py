"""TEI's POST /similarity (text-embeddings-inference's SimilarityRequest, the Hugging Face
sentence-similarity task): ``{"inputs": {"source_sentence", "sentences"}, "parameters"?}`` ->
one float per sentence, the cosine of its embedding with the source sentence's.

A door onto TEI's /embed (tei_api.embed: its validation, limits, prompts and truncation), one
request for the source and the sentences together; the cosines are taken here."""

from __future__ import annotations

import numpy as np
from pydantic import BaseModel

from embedfleet.gateway import tei_api
from embedfleet.gateway.errors import APIError, ErrorDialect, dialect_router
from embedfleet.gateway.inputs import TruncationDirection
from embedfleet.gateway.state import GatewayDep

router = dialect_router(ErrorDialect.tei)


class SimilarityInput(BaseModel):
    source_sentence: str
    sentences: list[str]


class SimilarityParameters(BaseModel):
    truncate: bool | None = None
    truncation_direction: TruncationDirection = "Right"
    prompt_name: str | None = None


class SimilarityRequest(BaseModel):
    inputs: SimilarityInput
    parameters: SimilarityParameters | None = None
    model: str | None = None  # not TEI's: another model of the namespace


def is_similarity(payload: object) -> bool:
    """Whether a JSON body is a sentence-similarity request (how POST / tells it from /embed's:
    ``huggingface_hub.InferenceClient(base_url).sentence_similarity`` posts it to the URL)."""
    inputs = payload.get("inputs") if isinstance(payload, dict) else None
    return isinstance(inputs, dict) and "source_sentence" in inputs


@router.post("/similarity")
async def similarity(body: SimilarityRequest, gateway: GatewayDep) -> list[float]:
    if not body.inputs.sentences:
        raise APIError(400, "`sentences` cannot be empty", param="inputs", code="empty_input")
    parameters = body.parameters or SimilarityParameters()
    embed = tei_api.EmbedRequest(
        inputs=[body.inputs.source_sentence, *body.inputs.sentences],
        truncate=parameters.truncate,
        truncation_direction=parameters.truncation_direction,
        prompt_name=parameters.prompt_name,
        model=body.model,
    )
    vectors = np.asarray(await tei_api.embed(embed, gateway), dtype=np.float32)
    return cosines(vectors[0], vectors[1:]).tolist()


def cosines(source: np.ndarray, others: np.ndarray) -> np.ndarray:
    """The cosine of each row of ``others`` with ``source`` (0 for a zero vector)."""
    norms = np.linalg.norm(others, axis=1) * np.linalg.norm(source)
    dots = others @ source
    return np.divide(dots, norms, out=np.zeros_like(dots), where=norms > 0)
