"""Running the gateway for tests: uvicorn on a free port in a thread, with its own loop; the
worker a module's gateway tests share; an OpenAI client on a gateway, a gRPC channel to one (and
a gRPC test module's fixtures); the texts they embed and the parity measure they use."""

from __future__ import annotations

import contextlib
import signal
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import Any
from urllib.parse import urlsplit

import grpc
import httpx
import numpy as np
import openai
import pytest
import uvicorn

from embedfleet.gateway.app import create_app
from embedfleet.server import ServerProcess, free_port, isolated_settings
from embedfleet.shared.model_path import resolve_model_path
from embedfleet.shared.settings import Settings
from embedfleet.workers.model.precision import cosines
from tests.conftest import WorkerLauncher, WorkerProcess, shared_encoder


@contextlib.contextmanager
def running_gateway(settings: Settings) -> Iterator[str]:
    """``embedfleet serve``'s app for ``settings``; yields its base URL, stops on exit."""
    port = free_port()
    config = uvicorn.Config(
        create_app(settings), host="127.0.0.1", port=port, log_level="warning", lifespan="on"
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name=f"gateway-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("the gateway did not start")
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def wait_for_worker(base_url: str, timeout: float = 300.0) -> None:
    """Until TEI's /health says a worker reads the query stream (it answers 503 before)."""
    deadline = time.monotonic() + timeout
    with httpx.Client(base_url=base_url) as http:
        while http.get("/health").status_code != 200:
            if time.monotonic() > deadline:
                raise TimeoutError("no worker became live")
            time.sleep(0.1)


def module_gateway_url(name: str = "gateway"):
    """The module-scoped fixture ``name`` of a gateway test module (``fleet_settings`` its
    settings, its ``worker`` running): the base URL of a gateway with those settings, once a
    worker is live behind it. ``gateway = module_gateway_url()``."""

    @pytest.fixture(scope="module", name=name)
    def gateway_url(fleet_settings: Settings, worker: WorkerProcess) -> Iterator[str]:
        with running_gateway(fleet_settings) as url:
            wait_for_worker(url)
            yield url

    return gateway_url


def module_served(name: str, worker_env: dict[str, str] | None = None, **overrides: object):
    """The three module-scoped fixtures of a module that tests one gateway on a worker:
    ``fleet_settings`` (module_fleet_settings: ``name``, ``overrides``), its ``worker``
    (``worker_env``: more of its variables) and ``gateway``, that gateway's base URL once the
    worker is live: ``fleet_settings, worker, gateway = module_served("gc", api_keys=KEY)``."""
    settings = module_fleet_settings(name, **overrides)
    return settings, module_worker(name, **(worker_env or {})), module_gateway_url()


def module_sentence_transformer(model: str):
    """The module-scoped ``model_st`` fixture: sentence-transformers itself on ``model``'s
    directory, the parity reference. ``model_st = module_sentence_transformer(MODEL)``."""

    @pytest.fixture(scope="module", name="model_st")
    def model_st() -> Any:
        from sentence_transformers import SentenceTransformer

        return SentenceTransformer(str(resolve_model_path(model)), device="cpu")

    return model_st


# ``with gateway(**settings) as client``: the fixture module_gateway gives
Gateway = Callable[..., AbstractContextManager[openai.OpenAI]]


# what grpc_gateway yields: an HTTP client, a gRPC channel and its target
GrpcServed = tuple[httpx.Client, grpc.Channel, str]


@contextlib.contextmanager
def grpc_gateway(settings: Settings) -> Iterator[GrpcServed]:
    """A gateway for ``settings`` serving gRPC on a port of its own: an HTTP client of it (with
    the settings' key, if any), a gRPC channel to it, closed on exit, and the channel's target
    (``host:port``, for a client of another program)."""
    port = free_port()
    headers = {"Authorization": f"Bearer {settings.api_keys}"} if settings.api_keys else {}
    with (
        running_gateway(settings.model_copy(update={"gateway_grpc_port": port})) as url,
        httpx.Client(base_url=url, timeout=120, headers=headers) as http,
        grpc.insecure_channel(f"127.0.0.1:{port}") as channel,
    ):
        yield http, channel, f"127.0.0.1:{port}"


# an API key for a test's gateway (EMBEDFLEET_API_KEYS; module_grpc_fleet's gateways take it),
# and the HTTP headers and the gRPC call metadata that carry it
GATEWAY_KEY = "sk-test-" + uuid.uuid4().hex
GATEWAY_AUTH = {"Authorization": f"Bearer {GATEWAY_KEY}"}
GRPC_AUTH = (("authorization", f"Bearer {GATEWAY_KEY}"),)


def module_grpc_fleet(name: str, **worker_env: str):
    """The three module-scoped fixtures of a gRPC gateway test module: ``fleet_settings`` (a
    namespace of its own, GATEWAY_KEY its key), its ``worker`` (``worker_env``: more of its
    variables) and ``grpc_served``, grpc_gateway's ``(http, channel, target)`` for those
    settings once the worker is live:
    ``fleet_settings, worker, grpc_served = module_grpc_fleet("grpc")``."""

    @pytest.fixture(scope="module", name="grpc_served")
    def grpc_served(fleet_settings: Settings, worker: WorkerProcess) -> Iterator[GrpcServed]:
        with grpc_gateway(fleet_settings) as served:
            wait_for_worker(str(served[0].base_url).rstrip("/"))
            yield served

    settings = module_fleet_settings(name, api_keys=GATEWAY_KEY)
    return settings, module_worker(name, **worker_env), grpc_served


@contextlib.contextmanager
def openai_gateway(settings: Settings) -> Iterator[openai.OpenAI]:
    """A gateway for ``settings`` once a worker is live behind it, and the `openai` SDK's
    client on it (no retries: a test sees each answer)."""
    with running_gateway(settings) as url:
        wait_for_worker(url)
        yield openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def module_gateway():
    """The ``gateway`` fixture of a gateway test module (``fleet_settings`` its settings, its
    ``worker`` running): ``with gateway(**settings) as client``, a gateway on the fleet with
    those settings and an OpenAI client on it. ``gateway = module_gateway()``."""

    @pytest.fixture(name="gateway")
    def gateway(fleet_settings: Settings, worker: WorkerProcess) -> Gateway:
        def start(**overrides: Any) -> AbstractContextManager[openai.OpenAI]:
            return openai_gateway(fleet_settings.model_copy(update=overrides))

        return start

    return gateway


def gateway_worker(
    settings: Settings, tmp_path_factory: pytest.TempPathFactory, name: str, **env: str
) -> Iterator[WorkerProcess]:
    """One worker process for a module's gateway tests (a module-scoped fixture yields from it);
    ``env``: more of its EMBEDFLEET_* variables.

    Eager queries: the frozen query graph takes a minute to build on a small shared CPU."""
    workers = WorkerLauncher(settings, shared_encoder, tmp_path_factory.mktemp("workers"))
    process = workers.process(
        f"{name}-worker-{uuid.uuid4().hex[:6]}",
        settings,
        **({"EMBEDFLEET_FROZEN_QUERIES": "false"} | env),
    )
    yield process
    process.send_signal(signal.SIGCONT)  # in case a test stopped it and then failed
    process.send_signal(signal.SIGTERM)
    process.wait(timeout=120)
    workers.stop_all()


# four short texts a gateway test embeds (and compares with sentence-transformers' vectors); a
# list, as the clients' calls take it
TEXTS = [
    "How do I open a file in Python?",
    "The quick brown fox jumps over the lazy dog.",
    "Embeddings map text to vectors.",
    "Redis streams make a durable queue.",
]


def min_cosine(a: np.ndarray, b: np.ndarray) -> float:
    """The lowest row-wise cosine of two (n, dim) arrays (one row: a vector)."""
    return float(cosines(np.atleast_2d(b), np.atleast_2d(a)).min())


def module_worker(name: str, **env: str):
    """The module-scoped ``worker`` fixture of a gateway test module (``fleet_settings`` its
    settings, ``env`` more of its variables): ``worker = module_worker("gw")``."""

    @pytest.fixture(scope="module", name="worker")
    def worker(
        fleet_settings: Settings, tmp_path_factory: pytest.TempPathFactory
    ) -> Iterator[WorkerProcess]:
        yield from gateway_worker(fleet_settings, tmp_path_factory, name, **env)

    return worker


def module_fleet_settings(name: str, **overrides: object):
    """The module-scoped ``fleet_settings`` fixture of a gateway test module: a namespace of its
    own (``name`` and a random suffix), a files folder of its own, short worker reads, and
    ``overrides``: ``fleet_settings = module_fleet_settings("ba", api_keys=KEY)``."""

    @pytest.fixture(scope="module", name="fleet_settings")
    def fleet_settings(redis_server: ServerProcess, tmp_path_factory: pytest.TempPathFactory):
        return isolated_settings(
            redis_server.url,
            f"{name}{uuid.uuid4().hex[:8]}",
            files_dir=str(tmp_path_factory.mktemp(f"{name}-files")),
            block_ms=200,
            **overrides,
        )

    return fleet_settings


def post_raw(url: str, path: str, body: bytes, sent: threading.Event, answer: dict) -> None:
    """POST ``body`` over a plain socket: ``sent`` is set once every byte is handed to the
    kernel (the gateway is then reading or checking it); ``answer`` gets the status line, the
    start of the body, the answer's size and the time it took to arrive after ``sent``."""
    parts = urlsplit(url)
    with socket.create_connection((parts.hostname, parts.port), timeout=600) as conn:
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {parts.hostname}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n"
        ).encode()
        conn.sendall(head + body)
        sent_at = time.monotonic()
        sent.set()
        received = bytearray()
        while chunk := conn.recv(1 << 20):
            received += chunk
        answer["after_sent_s"] = time.monotonic() - sent_at
        answer["status_line"] = bytes(received.split(b"\r\n", 1)[0]).decode()
        answer["body"] = bytes(received.split(b"\r\n\r\n", 1)[-1][:400]).decode(errors="replace")
        answer["bytes"] = len(received)
