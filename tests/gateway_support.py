"""Running the gateway for tests: uvicorn on a free port in a thread, with its own loop."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

import httpx
import uvicorn

from embedfleet.gateway.app import create_app
from embedfleet.server import free_port
from embedfleet.shared.settings import Settings


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
