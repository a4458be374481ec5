"""The gateway's app in process with no Redis and no worker (FastAPI's TestClient, the lifespan
not run): for a route module's checks, which answer before anything reaches the fleet."""

from __future__ import annotations

import httpx
from fastapi.testclient import TestClient

from embedfleet.gateway.app import create_app
from embedfleet.shared.settings import Settings

KEY = "sk-offline"
AUTH = {"Authorization": f"Bearer {KEY}"}


def offline_gateway() -> TestClient:
    # port 9: nothing listens there, and nothing here connects (no lifespan)
    settings = Settings(api_keys=KEY, redis_url="redis://127.0.0.1:9")
    return TestClient(create_app(settings), raise_server_exceptions=False)


def tei_error(answer: httpx.Response, status: int) -> str:
    """The message of TEI's error body, after checking its status and shape."""
    assert answer.status_code == status, answer.text
    body = answer.json()
    assert set(body) == {"error", "error_type"}, body
    return str(body["error"])


def openai_error(answer: httpx.Response, status: int) -> dict[str, object]:
    """OpenAI's error object, after checking its status and shape."""
    assert answer.status_code == status, answer.text
    body = answer.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return dict(body["error"])
