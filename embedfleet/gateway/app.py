"""The FastAPI app: lifespan (Redis, tokenizer, batch runner), the front door, the routes."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Sequence

from fastapi import APIRouter, FastAPI, Request
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from embedfleet.gateway import routes
from embedfleet.gateway.auth import KeyChecker, is_open, load_api_keys
from embedfleet.gateway.batch.files import FileStore
from embedfleet.gateway.batch.runner import BatchRunner, BatchStore
from embedfleet.gateway.embedder import Embedder, WorkerHeartbeats
from embedfleet.gateway.errors import (
    EXCEPTION_HANDLERS,
    APIError,
    ErrorDialect,
    declared_dialect,
    render,
    router_dialect,
)
from embedfleet.gateway.grpc_server import start_grpc_server, stop_grpc_server
from embedfleet.gateway.metrics import GatewayMetrics
from embedfleet.gateway.readiness import readiness
from embedfleet.gateway.state import Gateway
from embedfleet.gateway.timing_headers import HEADERS as TIMING_HEADERS
from embedfleet.gateway.timing_headers import TimingHeaders, compute_type
from embedfleet.gateway.token_ids import tiktoken_ids_of
from embedfleet.producer.client import Producer
from embedfleet.producer.tokens import ModelTokenizer
from embedfleet.shared.eviction import warn_on_eviction_policy
from embedfleet.shared.logging import get_logger
from embedfleet.shared.model_path import resolve_model_path
from embedfleet.shared.redis_conn import connect_settings
from embedfleet.shared.settings import Settings

log = get_logger("embedfleet.gateway")


class FrontDoor:
    """Pure ASGI middleware (no per-request task, unlike BaseHTTPMiddleware): API key, body size
    limit, and the request metrics by route template and status. Its refusals come before
    routing, in the dialect of the route the request would reach (``routes``: the declared
    ones), else by the path's prefix, as an unknown path's 404."""

    def __init__(self, app: ASGIApp, gateway: Gateway, routes: Sequence[BaseRoute] = ()) -> None:
        self.app = app
        self.gateway = gateway
        self.routes = list(routes)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        gateway = self.gateway
        metrics = gateway.metrics
        started = time.perf_counter()
        status = 500
        path: str = scope["path"]

        async def send_counted(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        metrics.in_flight.inc()
        try:
            headers = dict(scope["headers"])
            if gateway.keys.enabled and not is_open(scope["method"], path):
                try:
                    gateway.keys.check(_header(headers, b"authorization"))
                except APIError as error:
                    await self._send_error(scope, receive, send_counted, error)
                    return
            limit = (
                gateway.settings.batch_max_file_bytes + 64 * 1024  # multipart overhead
                if path == "/v1/files"
                else gateway.settings.gateway_max_body_bytes
            )
            declared = _header(headers, b"content-length")
            if declared is not None and declared.isdigit() and int(declared) > limit:
                await self._send_error(scope, receive, send_counted, _too_large(limit))
                return
            await self.app(scope, _limited(receive, limit), send_counted)
        finally:
            metrics.in_flight.dec()
            route = scope.get("route")
            template = getattr(route, "path", None) or "unmatched"
            metrics.requests.labels(template, scope["method"], str(status)).inc()
            metrics.latency.labels(template, str(status)).observe(time.perf_counter() - started)

    async def _send_error(
        self, scope: Scope, receive: Receive, send: Send, error: APIError
    ) -> None:
        await self._dialect(scope).response(error)(scope, receive, send)

    def _dialect(self, scope: Scope) -> ErrorDialect:
        """The dialect of the route Starlette will pick (the first full match, else the first
        partial one: a 405), else by the path's prefix."""
        chosen = None
        for route in self.routes:
            match, _ = route.matches(scope)
            if match is Match.FULL:
                chosen = route
                break
            if match is Match.PARTIAL and chosen is None:
                chosen = route
        dialect = declared_dialect(chosen)
        return dialect if dialect is not None else ErrorDialect.of_path(scope["path"])


class BodyTooLarge(Exception):
    pass


def _too_large(limit: int) -> APIError:
    return APIError(
        413,
        f"request body over {limit:,} bytes (EMBEDFLEET_GATEWAY_MAX_BODY_BYTES); "
        "split the request or use the Batch API",
        code="request_too_large",
    )


def _limited(receive: Receive, limit: int) -> Receive:
    """A chunked body without Content-Length is counted as it arrives."""
    received = 0

    async def receive_limited() -> Message:
        nonlocal received
        message = await receive()
        if message["type"] == "http.request":
            received += len(message.get("body", b""))
            if received > limit:
                raise BodyTooLarge(limit)
        return message

    return receive_limited


def _header(headers: dict[bytes, bytes], name: bytes) -> str | None:
    value = headers.get(name)
    return None if value is None else value.decode("latin-1")


def build_gateway(settings: Settings) -> Gateway:
    # the tokenizer is read from the model's files (token ids, usage, TEI's length check); what
    # the model is comes from the workers' card (state.py)
    tokenizer = ModelTokenizer(resolve_model_path(settings.model))
    client = connect_settings(settings)  # one server, or a Redis Cluster
    producer = Producer(settings, client)
    metrics = GatewayMetrics()
    fleet = WorkerHeartbeats(client, settings)
    return Gateway(
        settings=settings,
        tokenizer=tokenizer,
        client=client,
        producer=producer,
        fleet=fleet,
        embedder=Embedder(settings, producer, fleet, metrics),
        keys=KeyChecker(load_api_keys(settings)),
        metrics=metrics,
        started_at=int(time.time()),
        tiktoken_ids=tiktoken_ids_of(settings.gateway_tiktoken_encoding),
    )


def create_app(settings: Settings | None = None) -> FastAPI:
    """The gateway app for ``settings`` (default: from EMBEDFLEET_* variables)."""
    settings = settings or Settings()
    gateway = build_gateway(settings)
    files = FileStore(settings.files_dir)
    store = BatchStore(gateway.producer)
    runner = BatchRunner(gateway, files, store)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        # beside the start: a Redis that may evict reply lists or the backlog is said loudly
        policy_check = asyncio.ensure_future(warn_on_eviction_policy(gateway.client))
        await gateway.producer.setup()
        card = await gateway.model_card()  # None until a worker has started once: fine
        # TEI's gRPC API beside HTTP, on this loop (EMBEDFLEET_GATEWAY_GRPC_PORT; None: unset)
        grpc_server = await start_grpc_server(gateway)
        task = asyncio.create_task(runner.run())
        log.info(
            "gateway started",
            model=gateway.served_name,
            dim=card.dim if card is not None else "not published yet",
            api_keys=len(gateway.keys.keys),
            files_dir=str(files.root),
            tiktoken_encoding=gateway.tiktoken_ids.name if gateway.tiktoken_ids else None,
        )
        try:
            yield
        finally:
            await stop_grpc_server(grpc_server)
            runner.stop()
            policy_check.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            with contextlib.suppress(asyncio.CancelledError):
                await policy_check
            await gateway.client.aclose()

    app = FastAPI(
        title="embedfleet gateway",
        summary="OpenAI- and TEI-compatible embeddings over an embedfleet worker fleet",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
    )
    app.state.gateway = gateway
    app.state.files = files
    app.state.batches = store
    app.state.runner = runner
    for error_class, handler in EXCEPTION_HANDLERS:
        app.add_exception_handler(error_class, handler)
    app.add_exception_handler(BodyTooLarge, _body_too_large_handler)
    include_routers(app, routes.ROUTERS)
    _add_ops_routes(app, gateway)
    declared = [route for router in routes.ROUTERS for route in router.routes]
    # the last added runs first: CORS answers a browser's preflight before the API key check
    # (a preflight carries no key), then the front door, then the request's clock
    app.add_middleware(TimingHeaders, compute_type=compute_type(settings.device))
    app.add_middleware(FrontDoor, gateway=gateway, routes=declared)
    add_cors(app, settings.gateway_cors_allow_origins)
    return app


def add_cors(app: FastAPI, allow_origins: str | None) -> None:
    """CORS as TEI's ``--cors-allow-origin``: unset, any origin; empty, none (off); else the
    comma-separated origins. TEI's timing headers are exposed to the page's scripts."""
    if allow_origins is None:
        origins = ["*"]
    else:
        origins = [origin.strip() for origin in allow_origins.split(",") if origin.strip()]
        if not origins:
            return
    app.add_middleware(
        CORSMiddleware,
        allow_origins=origins,
        allow_methods=["GET", "POST"],
        allow_headers=["Content-Type", "Authorization"],
        expose_headers=list(TIMING_HEADERS),
    )


def include_routers(app: FastAPI, routers: Sequence[APIRouter]) -> None:
    """Every router of the registry (gateway/routes.py), in its order; TypeError for one that
    declares no error dialect (its errors would answer by its path's prefix)."""
    for router in routers:
        router_dialect(router)
        app.include_router(router)


async def _body_too_large_handler(request: Request, error: Exception) -> JSONResponse:
    limit = int(error.args[0]) if error.args else 0
    return render(request, _too_large(limit))


def _add_ops_routes(app: FastAPI, gateway: Gateway) -> None:
    @app.get("/healthz", include_in_schema=False)
    async def healthz() -> dict[str, str]:
        """Liveness: the process answers."""
        return {"status": "ok"}

    @app.get("/readyz", include_in_schema=False)
    async def readyz() -> JSONResponse:
        """Readiness (gateway/readiness.py owns it: gRPC's health service answers the same):
        200 with the live workers counted, for people; 503 with Retry-After while Redis does
        not answer within EMBEDFLEET_GATEWAY_REDIS_TIMEOUT_S."""
        try:
            ready = await readiness(gateway)
        except Exception as error:
            return JSONResponse(
                {"status": "redis unreachable", "error": str(error)},
                503,
                headers={"Retry-After": str(gateway.settings.gateway_retry_after_s)},
            )
        return JSONResponse(
            {"status": "ready", "live_workers": ready.live_workers, "models": ready.models}
        )

    @app.get("/docs", include_in_schema=False)
    async def docs() -> HTMLResponse:
        """Swagger UI over the OpenAPI page (TEI's /docs). Its script and style come from
        FastAPI's defaults (a CDN): a browser without internet access shows an empty page,
        /openapi.json itself is served here."""
        return get_swagger_ui_html(openapi_url=app.openapi_url or "/openapi.json", title=app.title)

    @app.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        return Response(gateway.metrics.exposition(), media_type=CONTENT_TYPE_LATEST)
