"""What every route shares: settings, the model's files and tokenizer, Redis, the embedder."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

import redis.asyncio as aioredis
from fastapi import Depends, Request

from embedfleet.gateway.auth import KeyChecker
from embedfleet.gateway.embedder import Embedder, WorkerHeartbeats
from embedfleet.gateway.errors import APIError
from embedfleet.gateway.metrics import GatewayMetrics
from embedfleet.producer.client import EmbeddingOptions, Producer
from embedfleet.producer.tokens import ModelTokenizer
from embedfleet.shared.modeldir import ModelFiles
from embedfleet.shared.settings import Settings


@dataclass
class Gateway:
    settings: Settings
    model: ModelFiles
    tokenizer: ModelTokenizer
    client: aioredis.Redis
    producer: Producer
    fleet: WorkerHeartbeats  # informative: requests are enqueued with or without a worker
    embedder: Embedder
    keys: KeyChecker
    metrics: GatewayMetrics
    started_at: int

    @property
    def served_name(self) -> str:
        return self.settings.served_model_name or self.model.name

    def check_model(self, requested: str | None, param: str = "model") -> None:
        """An unknown model name is an error (404 model_not_found, as OpenAI answers)."""
        accepted = {self.served_name, self.model.name, f"sentence-transformers/{self.model.name}"}
        if requested not in accepted:
            raise APIError(
                404,
                f"the model {requested!r} does not exist here; this gateway serves "
                f"{self.served_name!r} (GET /v1/models)",
                param=param,
                code="model_not_found",
            )

    def prompt_text(self, prompt_name: str | None) -> str:
        """The prompt sentence-transformers would prepend (the model's config_sentence_transformers
        ``prompts``); the default prompt when none is named."""
        name = prompt_name or self.model.default_prompt_name
        if name is None:
            return ""
        if name not in self.model.prompts:
            known = ", ".join(sorted(self.model.prompts)) or "none"
            raise APIError(
                422,
                f"unknown prompt_name {name!r}; the model's prompts: {known}",
                param="prompt_name",
                code="invalid_prompt",
            )
        return self.model.prompts[name]


def gateway_of(request: Request) -> Gateway:
    return request.app.state.gateway


GatewayDep = Annotated[Gateway, Depends(gateway_of)]


def wire_options(gateway: Gateway, prompt: str, dimensions: int | None) -> EmbeddingOptions:
    """What every chunk the gateway sends asks of the worker, explicitly, so the fleet's own
    defaults (EMBEDFLEET_DIMENSIONS, EMBEDFLEET_OUTPUT_DTYPE, each lane's default prompt) never
    change an HTTP answer: this prompt ("" for none), these dimensions (the model's when not
    asked), fp16 on the wire (the gateway answers in floats)."""
    return EmbeddingOptions(
        prompt=prompt, dimensions=dimensions or gateway.model.dim, dtype="float16"
    )
