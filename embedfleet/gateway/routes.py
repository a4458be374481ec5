"""The gateway's HTTP routes, one line per router module. Each module's router declares the
error dialect its routes answer in (errors.dialect_router); the app includes them in this
order, and the first route that matches a request serves it."""

from __future__ import annotations

from fastapi import APIRouter

from embedfleet.gateway import (
    cohere_api,
    infinity_api,
    invocations_api,
    openai_alias_api,
    openai_api,
    rerank_api,
    similarity_api,
    tei_api,
    vertex_api,
)
from embedfleet.gateway.batch import api as batch_api

ROUTERS: tuple[APIRouter, ...] = (
    openai_api.router,
    openai_alias_api.router,
    infinity_api.router,
    batch_api.router,
    # before tei_api's: its POST / (the model's default route) answers before /embed's
    invocations_api.router,
    similarity_api.router,
    vertex_api.router,
    tei_api.router,
    rerank_api.router,
    cohere_api.router,
)
