"""Large and malformed bodies at the gateway's doors (issue 40, point 7 and the lone surrogate).

A real gateway (uvicorn, the app `embedfleet serve` runs) on a real Redis server; no worker is
needed: /tokenize answers from the model's tokenizer, and what is refused is refused before
anything reaches a worker (the batch runner validates without one).

- One 15 MB ``/tokenize`` request must not freeze the gateway: ``/healthz`` (the chart's
  liveness probe) answers within 1 s all the while it runs.
- A lone surrogate (``"\\ud800"`` in the JSON) is no text: a 4xx in the route's dialect
  online, and in a Batch API input file a request refused on its own: the batch runs on,
  and the line is answered in its error file with the online endpoint's 400.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from embedfleet.server import ServerProcess, isolated_settings
from tests.gateway_support import post_raw, running_gateway

# the slow tier (make test-full, CI): starts processes or servers, or compiles a model
pytestmark = [pytest.mark.slow, pytest.mark.serial]  # serial: its assertions hold times (Makefile)

MODEL = "all-MiniLM-L6-v2"
HEALTHZ_BOUND_S = 1.0  # what the issue asks of /healthz while a large /tokenize runs
BODY_BYTES = 15 * 1024 * 1024


def tokenize_body(size: int) -> bytes:
    """A /tokenize body of about ``size`` bytes, within the gateway's caps: the most inputs one
    request may hold (EMBEDFLEET_GATEWAY_MAX_INPUTS, 2048) of ordinary prose, each under
    EMBEDFLEET_GATEWAY_MAX_INPUT_CHARS (100,000)."""
    inputs = 2048
    words = "the quick brown fox jumps over a lazy dog while embeddings flow through redis "
    per_input = size // inputs
    text = (words * (per_input // len(words) + 1))[:per_input]
    return json.dumps({"inputs": [f"{n} {text}" for n in range(inputs)]}).encode()


def test_healthz_answers_within_a_second_while_a_15_mb_tokenize_runs(
    redis_server: ServerProcess, tmp_path: Path
) -> None:
    """/healthz sampled every 50 ms from the moment the 15 MB body is sent until its answer has
    come back: each sample answers within HEALTHZ_BOUND_S (measured on a loaded 2-core machine:
    on the code before the fix one sample waited as long as the whole tokenize, ~20 s)."""
    body = tokenize_body(BODY_BYTES)
    assert BODY_BYTES * 0.95 < len(body) < 16 * 1024 * 1024  # under the 16 MiB body cap
    settings = isolated_settings(redis_server.url, files_dir=str(tmp_path / "files"))
    with running_gateway(settings) as url, httpx.Client(base_url=url, timeout=120) as http:
        assert http.get("/healthz").status_code == 200
        sent, answer = threading.Event(), {}
        poster = threading.Thread(target=post_raw, args=(url, "/tokenize", body, sent, answer))
        poster.start()
        assert sent.wait(120), "the body was not taken in"
        samples: list[float] = []
        while poster.is_alive():
            started = time.monotonic()
            assert http.get("/healthz").status_code == 200
            samples.append(time.monotonic() - started)
            time.sleep(0.05)  # the sampling period, not a wait for an event
        poster.join()
    assert answer["status_line"].split()[1] == "200", answer
    slowest = max(samples, default=0.0)
    print(
        f"tokenize answered {answer['after_sent_s']:.1f}s after its body was sent "
        f"({answer['bytes']:,} bytes); /healthz: {len(samples)} samples, slowest {slowest:.2f}s"
    )
    # /healthz was asked while the request ran (not only after it had ended)
    assert len(samples) >= 3, answer
    assert slowest < HEALTHZ_BOUND_S, f"/healthz took {slowest:.1f}s while /tokenize ran"


@pytest.fixture(scope="module")
def gateway_url(redis_server: ServerProcess, tmp_path_factory: pytest.TempPathFactory):
    settings = isolated_settings(
        redis_server.url, files_dir=str(tmp_path_factory.mktemp("big-bodies-files"))
    )
    with running_gateway(settings) as url:
        yield url


LONE_SURROGATE = b'"bad \\ud800 text"'  # valid JSON, but no text UTF-8 can carry


@pytest.mark.parametrize(
    ("path", "body", "status", "openai_dialect"),
    [
        ("/v1/embeddings", b'{"model": "%s", "input": %s}', 400, True),
        ("/v1/embeddings", b'{"model": "%s", "input": ["fine", %s]}', 400, True),
        ("/embed", b'{"model": null, "inputs": %s}', 422, False),
        ("/tokenize", b'{"inputs": %s}', 422, False),
    ],
)
def test_a_lone_surrogate_is_a_client_error_in_the_routes_dialect(
    gateway_url: str, path: str, body: bytes, status: int, openai_dialect: bool
) -> None:
    if b"%s" in body and body.count(b"%s") == 2:
        payload = body % (MODEL.encode(), LONE_SURROGATE)
    else:
        payload = body % LONE_SURROGATE
    with httpx.Client(base_url=gateway_url, timeout=60) as http:
        answer = http.post(path, content=payload, headers={"Content-Type": "application/json"})
    assert answer.status_code == status, answer.text
    error = answer.json()
    if openai_dialect:
        assert error["error"]["code"] == "invalid_input", error
        assert "surrogate" in error["error"]["message"]
    else:
        assert error["error_type"] == "Validation" and "surrogate" in error["error"], error


def test_a_lone_surrogate_in_a_batch_line_is_answered_in_its_error_file(
    gateway_url: str, tmp_path: Path
) -> None:
    good = {"custom_id": "a", "method": "POST", "url": "/v1/embeddings"}
    lines = [
        json.dumps({**good, "body": {"model": MODEL, "input": "fine"}}),
        json.dumps({**good, "custom_id": "b", "body": {"model": MODEL, "input": "x"}}).replace(
            '"x"', LONE_SURROGATE.decode()
        ),
    ]
    path = tmp_path / "surrogate.jsonl"
    path.write_text("\n".join(lines) + "\n")
    client = openai.OpenAI(base_url=f"{gateway_url}/v1", api_key="unused", max_retries=0)
    with path.open("rb") as handle:
        uploaded = client.files.create(file=handle, purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h"
    )
    # as OpenAI's Batch API: the request is refused on its own, counted failed at once, and the
    # batch runs on with the other line (no worker here: it waits in progress, and is cancelled)
    deadline = time.monotonic() + 120
    while (batch := client.batches.retrieve(batch.id)).status == "validating":
        assert time.monotonic() < deadline, batch
        time.sleep(0.1)  # polling the batch's state, not waiting blind
    assert batch.status == "in_progress", batch
    assert (batch.request_counts.total, batch.request_counts.failed) == (2, 1)
    client.batches.cancel(batch.id)
    while (batch := client.batches.retrieve(batch.id)).status != "cancelled":
        assert time.monotonic() < deadline, batch
        time.sleep(0.1)  # polling the batch's state, not waiting blind
    assert (batch.request_counts.completed, batch.request_counts.failed) == (0, 2)
    content = client.files.content(batch.error_file_id).text.splitlines()
    by_id = {record["custom_id"]: record for record in map(json.loads, content)}
    assert by_id["a"]["error"]["code"] == "batch_cancelled", by_id
    refused = by_id["b"]
    # the online endpoint's answer: 400 and OpenAI's error body
    assert refused["response"]["status_code"] == 400 and refused["error"] is None, refused
    error = refused["response"]["body"]["error"]
    assert error["code"] == "invalid_input" and "surrogate" in error["message"], error
