"""Issue 54, fault 2: work that grows with a request runs off the event loop. TEI's
``x-compute-tokens`` tokenizes every input a request sent once its answer is ready (/rerank's
and /predict's only tokenizing): the TimingHeaders middleware counts them on a worker thread.

The routes' own checks, end to end at the caps, are tests/end_to_end/test_gateway_event_loop.py.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from fastapi import FastAPI
from fastapi.testclient import TestClient

from embedfleet.gateway.errors import ErrorDialect, dialect_router
from embedfleet.gateway.timing_headers import TimingHeaders, fleet_call


def test_the_timing_headers_count_tokens_off_the_event_loop() -> None:
    threads: dict[str, int] = {}

    def count(texts: Sequence[str]) -> int:
        threads["count"] = threading.get_ident()
        return sum(len(text.split()) for text in texts)

    router = dialect_router(ErrorDialect.tei)

    @router.post("/embed")
    async def embed() -> list[int]:
        threads["loop"] = threading.get_ident()
        with fleet_call(["two words", "three words here"], count) as call:
            call.sending()
        return [1]

    app = FastAPI()
    app.include_router(router)
    with TestClient(TimingHeaders(app, "cpu")) as client:
        answer = client.post("/embed")
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-compute-tokens"] == "5"
    assert threads["count"] != threads["loop"], "x-compute-tokens was counted on the event loop"
