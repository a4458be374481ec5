"""A hung Redis never holds a caller past its own timeout.

Each test runs its own redis-server and SIGSTOPs it once the caller is connected: its sockets
stay open and nothing answers, as with a blackholed failover or a stalled fork. Every caller
must give up within about a second of its own timeout: ``embed_queries(timeout=2)``,
``asyncio.wait_for`` around a producer call (the query's clean-up in ``finally`` is bounded
too), the gateway's ``/v1/embeddings`` with a 2 s gateway timeout (a JSON 503 with Retry-After
in each dialect's envelope) and ``/readyz`` (not ready). A watchdog SIGCONTs the server after
``WATCHDOG_S``, so code that waits on a hung Redis (today's before the fix) ends late, and
fails on its measured time, instead of never; the server is always resumed on the way out.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from embedfleet.producer import Producer, QueryTimeoutError
from embedfleet.server import ServerProcess
from embedfleet.shared.settings import Settings
from loadtest.common import isolated_settings
from tests.conftest import _server_binary
from tests.gateway_support import running_gateway

# A caller may take this much longer than its own timeout (its clean-up included)
GRACE_S = 1.2
# The hung server is resumed after this long whatever happens, so the old code's waits end
WATCHDOG_S = 15.0
AUTH = {"Authorization": "Bearer hung-key"}


@pytest.fixture
def own_redis() -> Iterator[ServerProcess]:
    with ServerProcess(_server_binary()) as server:
        yield server


@contextlib.contextmanager
def hung(server: ServerProcess) -> Iterator[None]:
    """The server stopped (SIGSTOP) inside the block; resumed on exit, or by the watchdog."""
    process = server.process
    assert process is not None
    process.send_signal(signal.SIGSTOP)
    watchdog = threading.Timer(WATCHDOG_S, process.send_signal, (signal.SIGCONT,))
    watchdog.start()
    try:
        yield
    finally:
        watchdog.cancel()
        process.send_signal(signal.SIGCONT)


@pytest.fixture
def settings(own_redis: ServerProcess) -> Settings:
    return isolated_settings(own_redis.url, gateway_timeout_s=2.0, api_keys="hung-key")


async def test_embed_queries_gives_up_at_its_timeout(
    own_redis: ServerProcess, settings: Settings
) -> None:
    async with Producer(settings) as producer:  # connected, groups created
        with hung(own_redis):
            started = time.monotonic()
            with pytest.raises(QueryTimeoutError, match="no answer within 2"):
                await producer.embed_queries(["a query"], timeout=2)
            elapsed = time.monotonic() - started
    assert 2 <= elapsed < 2 + GRACE_S, elapsed


async def test_wait_for_around_a_producer_call_is_honoured(
    own_redis: ServerProcess, settings: Settings
) -> None:
    """The caller's own bound cancels the query; its withdrawal in ``finally`` (Redis again)
    must not hold the cancellation."""
    async with Producer(settings) as producer:
        with hung(own_redis):
            started = time.monotonic()
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(producer.embed_query("a query", timeout=60), 5)
            elapsed = time.monotonic() - started
    assert 5 <= elapsed < 5 + GRACE_S, elapsed


async def test_wait_for_job_gives_up_at_its_timeout(
    own_redis: ServerProcess, settings: Settings
) -> None:
    async with Producer(settings) as producer:
        await producer.enqueue([{"id": "c1", "text": "some text"}], job="j")
        with hung(own_redis):
            started = time.monotonic()
            with pytest.raises(TimeoutError, match="not finished after 2"):
                await producer.wait_for_job("j", timeout=2)
            elapsed = time.monotonic() - started
    assert 2 <= elapsed < 2 + GRACE_S, elapsed


def _timed(call) -> tuple[httpx.Response, float]:
    started = time.monotonic()
    answer = call()
    return answer, time.monotonic() - started


def test_gateway_answers_503_within_its_timeout_while_redis_hangs(
    own_redis: ServerProcess, settings: Settings
) -> None:
    """/v1/embeddings (OpenAI's envelope) and /embed (TEI's) with a 2 s gateway timeout: a
    JSON 503 with Retry-After within about a second of it; /readyz: not ready within its own
    bound (EMBEDFLEET_GATEWAY_REDIS_TIMEOUT_S)."""
    with (
        running_gateway(settings) as url,
        httpx.Client(base_url=url, headers=AUTH, timeout=WATCHDOG_S + 30) as http,
    ):
        assert http.get("/readyz").status_code == 200  # connected before the hang
        with hung(own_redis):
            openai_answer, openai_s = _timed(
                lambda: http.post(
                    "/v1/embeddings", json={"model": "all-MiniLM-L6-v2", "input": "hi"}
                )
            )
            tei_answer, tei_s = _timed(lambda: http.post("/embed", json={"inputs": "hi"}))
            ready, ready_s = _timed(lambda: http.get("/readyz"))
    for answer, elapsed in ((openai_answer, openai_s), (tei_answer, tei_s)):
        assert elapsed < settings.gateway_timeout_s + GRACE_S, (answer.text, elapsed)
        assert answer.status_code == 503, answer.text
        assert answer.headers["retry-after"] == str(settings.gateway_retry_after_s)
    error = openai_answer.json()["error"]
    assert error["code"] == "queue_unavailable" and error["type"] == "server_error"
    assert "Redis" in error["message"]
    assert tei_answer.json()["error_type"] == "Unhealthy"
    assert ready_s < settings.gateway_redis_timeout_s + GRACE_S, ready_s
    assert ready.status_code == 503 and ready.json()["status"] == "redis unreachable"
    assert ready.headers["retry-after"] == str(settings.gateway_retry_after_s)


def test_gateway_answers_json_503_with_retry_after_while_redis_is_down(
    own_redis: ServerProcess, settings: Settings
) -> None:
    """Redis gone (its port closed): every route that needs it answers a JSON 503 with
    Retry-After in its dialect's envelope, never a plain-text 500."""
    with (
        running_gateway(settings) as url,
        httpx.Client(base_url=url, headers=AUTH, timeout=WATCHDOG_S + 30) as http,
    ):
        own_redis.stop()
        answers = {
            "/v1/embeddings": http.post(
                "/v1/embeddings", json={"model": "all-MiniLM-L6-v2", "input": "hi"}
            ),
            "/v1/models": http.get("/v1/models"),
            "/embed": http.post("/embed", json={"inputs": "hi"}),
            "/info": http.get("/info"),
            "/health": http.get("/health"),
            "/readyz": http.get("/readyz"),
        }
    for route, answer in answers.items():
        assert answer.status_code == 503, (route, answer.status_code, answer.text)
        assert answer.headers["content-type"] == "application/json", route
        assert answer.headers["retry-after"] == str(settings.gateway_retry_after_s), route
        body = answer.json()
        if route.startswith("/v1"):
            assert body["error"]["code"] == "queue_unavailable", (route, body)
        elif route != "/readyz":
            assert body["error_type"] == "Unhealthy", (route, body)
