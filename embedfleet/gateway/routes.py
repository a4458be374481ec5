"""The gateway's HTTP routes, one line per router module. Each module's router declares the
error dialect its routes answer in (errors.dialect_router); the app includes them in this
order, and the first route that matches a request serves it."""

from __future__ import annotations

from fastapi import APIRouter

from embedfleet.gateway import batch_api, cohere_api, openai_api, rerank_api, tei_api

ROUTERS: tuple[APIRouter, ...] = (
    openai_api.router,
    batch_api.router,
    tei_api.router,
    rerank_api.router,
    cohere_api.router,
)
