"""The HTTP gateway with the real clients: `openai`, huggingface_hub's TEI client, over a
running gateway, a real worker process and a real Redis server."""

from __future__ import annotations

import asyncio
import base64
import json
import time
import uuid
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from embedfleet.producer.chunker import builtin_corpus
from embedfleet.producer.client import Producer
from embedfleet.server import ServerProcess, isolated_settings
from embedfleet.shared.model_path import resolve_model_path
from embedfleet.shared.redis_conn import connect
from embedfleet.shared.settings import Settings
from tests.gateway_support import (
    TEXTS,
    gateway_worker,
    min_cosine,
    module_gateway_url,
    running_gateway,
)

# the slow tier (make test-full, CI): starts processes or servers, or compiles a model
pytestmark = pytest.mark.slow

API_KEY = "sk-test-" + uuid.uuid4().hex
# The worker's read window here (EMBEDFLEET_READ_COUNT; 1024 by default on CPU) and the bulk
# backlog a large request must not wait behind: more than one window, and a window more than
# half the backlog, so a worker that finished its window before serving the request would have
# done over half of it when it answers (the assertion), while one that serves it between slices
# has done a batch or two (about 100 texts each). Smaller than the default's 1,024 and 1,200: the
# backlog is drained at the end, and its embeddings were CPU minutes on CI's slowest class.
BACKLOG_WINDOW = 512
BACKLOG = 800


@pytest.fixture(scope="module")
def fleet_settings(redis_server: ServerProcess, tmp_path_factory: pytest.TempPathFactory):
    return isolated_settings(
        redis_server.url,
        f"gw{uuid.uuid4().hex[:8]}",
        api_keys=f"other-key,{API_KEY}",
        files_dir=str(tmp_path_factory.mktemp("files")),
        gateway_lane_max_inputs=4,
        gateway_max_inputs=300,
        gateway_max_input_chars=5000,
        block_ms=200,
    )


@pytest.fixture(scope="module")
def worker(fleet_settings: Settings, tmp_path_factory: pytest.TempPathFactory):
    """The module's worker, reading the ingest stream BACKLOG_WINDOW entries at a time."""
    yield from gateway_worker(
        fleet_settings, tmp_path_factory, "gw", EMBEDFLEET_READ_COUNT=str(BACKLOG_WINDOW)
    )


gateway = module_gateway_url()


@pytest.fixture(scope="module")
def reference():
    """sentence-transformers itself on the same model directory: the vectors to match."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(resolve_model_path("all-MiniLM-L6-v2")), device="cpu")
    return lambda texts: model.encode(list(texts), normalize_embeddings=False)


@pytest.fixture
def client(gateway: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway}/v1", api_key=API_KEY, max_retries=0)


def test_one_string_matches_sentence_transformers(client: openai.OpenAI, reference) -> None:
    response = client.embeddings.create(model="all-MiniLM-L6-v2", input=TEXTS[0])
    assert len(response.data) == 1 and response.data[0].index == 0
    vector = np.array(response.data[0].embedding)
    assert vector.shape == (384,)
    assert min_cosine(vector[None], reference(TEXTS[:1])) >= 0.999
    assert response.model == "all-MiniLM-L6-v2"
    assert response.usage.prompt_tokens == response.usage.total_tokens > 5


def test_a_batch_in_order_default_base64_and_explicit_float(
    client: openai.OpenAI, gateway: str, reference
) -> None:
    # the SDK asks for base64 by default and decodes it itself
    default = client.embeddings.create(model="all-MiniLM-L6-v2", input=TEXTS)
    floats = client.embeddings.create(
        model="all-MiniLM-L6-v2", input=TEXTS, encoding_format="float"
    )
    expected = reference(TEXTS)
    for response in (default, floats):
        assert [item.index for item in response.data] == list(range(len(TEXTS)))
        got = np.array([item.embedding for item in response.data])
        assert min_cosine(got, expected) >= 0.999
    # on the wire: base64 of little-endian float32, as OpenAI sends it
    raw = httpx.post(
        f"{gateway}/v1/embeddings",
        headers={"Authorization": f"Bearer {API_KEY}"},
        json={"model": "all-MiniLM-L6-v2", "input": TEXTS[1], "encoding_format": "base64"},
    ).json()
    decoded = np.frombuffer(base64.b64decode(raw["data"][0]["embedding"]), dtype="<f4")
    assert decoded.shape == (384,) and min_cosine(decoded[None], expected[1:2]) >= 0.999


def test_a_large_request_goes_through_the_interactive_stream(
    client: openai.OpenAI, gateway: str, reference
) -> None:
    texts = [chunk.text[:300] for chunk in builtin_corpus(120)]  # over the lane's 4 inputs
    response = client.embeddings.create(model="all-MiniLM-L6-v2", input=texts)
    got = np.array([item.embedding for item in response.data])
    assert [item.index for item in response.data] == list(range(len(texts)))
    assert min_cosine(got, reference(texts)) >= 0.999
    metrics = httpx.get(f"{gateway}/metrics").text
    counted = 'embedfleet_gateway_inputs_total{lane="interactive",model="all-MiniLM-L6-v2"} 120.0'
    assert counted in metrics
    assert 'route="/v1/embeddings"' in metrics


def test_dimensions_truncate_and_renormalise(client: openai.OpenAI, reference) -> None:
    response = client.embeddings.create(model="all-MiniLM-L6-v2", input=TEXTS[:2], dimensions=64)
    got = np.array([d.embedding for d in response.data])
    assert got.shape == (2, 64)
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    expected = reference(TEXTS[:2])[:, :64]  # sentence-transformers' truncate_dim, normalised
    assert min_cosine(got, expected) >= 0.999


def test_models_list(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == ["all-MiniLM-L6-v2"]
    assert models.data[0].model_extra["dimensions"] == 384


def test_wrong_key_is_401_in_openais_envelope(gateway: str) -> None:
    bad = openai.OpenAI(base_url=f"{gateway}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as caught:
        bad.embeddings.create(model="all-MiniLM-L6-v2", input="hi")
    assert caught.value.status_code == 401
    body = caught.value.response.json()
    assert body["error"]["code"] == "invalid_api_key"
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert httpx.post(f"{gateway}/v1/embeddings", json={}).status_code == 401  # no key at all
    assert httpx.get(f"{gateway}/healthz").status_code == 200  # probes need none


def test_bad_model_is_404_model_not_found(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client.embeddings.create(model="text-embedding-3-small", input="hi")
    error = caught.value.response.json()["error"]
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert "all-MiniLM-L6-v2" in error["message"]


def test_bad_requests_are_400_and_a_body_over_the_limit_413(
    client: openai.OpenAI, gateway: str
) -> None:
    # OpenAI's 400 for too many inputs (the SDK's BadRequestError), as GATEWAY.md says
    with pytest.raises(openai.BadRequestError) as too_many:
        client.embeddings.create(model="all-MiniLM-L6-v2", input=["x"] * 301)
    assert too_many.value.response.json()["error"]["code"] == "too_many_inputs"
    with pytest.raises(openai.BadRequestError) as too_long:  # over the characters' limit
        client.embeddings.create(model="all-MiniLM-L6-v2", input="word " * 2000)
    assert (
        "EMBEDFLEET_GATEWAY_MAX_INPUT_CHARS" in too_long.value.response.json()["error"]["message"]
    )
    huge = httpx.post(
        f"{gateway}/v1/embeddings",
        headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"},
        content=b'{"model": "all-MiniLM-L6-v2", "input": "' + b"a" * (17 * 1024 * 1024) + b'"}',
    )
    assert huge.status_code == 413 and huge.json()["error"]["code"] == "request_too_large"
    with pytest.raises(openai.BadRequestError) as empty:
        client.embeddings.create(model="all-MiniLM-L6-v2", input="")
    assert empty.value.response.json()["error"]["param"] == "input"
    with pytest.raises(openai.BadRequestError) as dims:
        client.embeddings.create(model="all-MiniLM-L6-v2", input="hi", dimensions=1000)
    assert dims.value.response.json()["error"]["param"] == "dimensions"
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model="all-MiniLM-L6-v2", input=[{"not": "text"}])  # type: ignore


def test_an_input_over_the_models_maximum_is_400_unless_truncate_is_asked(
    client: openai.OpenAI, reference
) -> None:
    # OpenAI's answer to an input over the context: 400, nothing embedded from a cut text
    long = "word " * 400  # 400 tokens; the model reads 256
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model="all-MiniLM-L6-v2", input=["short", long])
    error = caught.value.response.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "input"
    assert "256 tokens" in error["message"] and "'input[1]'" in error["message"]
    assert '"truncate": true' in error["message"]
    # asked for: cut to fit as sentence-transformers cuts it, and counted as what was read
    cut = client.embeddings.create(
        model="all-MiniLM-L6-v2", input=[long], extra_body={"truncate": True}
    )
    vector = np.array([cut.data[0].embedding])
    assert min_cosine(vector, reference([long])) >= 0.999
    assert cut.usage.prompt_tokens == 256


def test_tei_client_gets_the_same_vectors(
    gateway: str, reference, monkeypatch: pytest.MonkeyPatch
) -> None:
    from huggingface_hub import InferenceClient, constants

    # the suite runs with HF_HUB_OFFLINE=1 (nothing from the Hub); this client only talks to
    # the local gateway
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)

    tei = InferenceClient(model=gateway, token=API_KEY)
    one = tei.feature_extraction(TEXTS[0])
    assert min_cosine(np.asarray(one).reshape(1, -1), reference(TEXTS[:1])) >= 0.999
    headers = {"Authorization": f"Bearer {API_KEY}"}
    many = httpx.post(f"{gateway}/embed", headers=headers, json={"inputs": TEXTS}).json()
    assert min_cosine(np.array(many), reference(TEXTS)) >= 0.999
    info = httpx.get(f"{gateway}/info", headers=headers).json()
    assert info["max_input_length"] == 256 and info["model_id"] == "all-MiniLM-L6-v2"
    # TEI's envelope: truncate=false refuses a text over the model's maximum (TEI's default,
    # auto-truncate, cuts it: tests/end_to_end/test_gateway_dialects.py)
    long = httpx.post(
        f"{gateway}/embed", headers=headers, json={"inputs": "word " * 400, "truncate": False}
    )
    assert long.status_code == 422
    assert long.json()["error_type"] == "Validation" and "256" in long.json()["error"]
    cut = httpx.post(
        f"{gateway}/embed", headers=headers, json={"inputs": "word " * 400, "truncate": True}
    )
    assert cut.status_code == 200 and len(cut.json()[0]) == 384
    bad = httpx.post(f"{gateway}/embed", headers=headers, json={"input": "wrong field"})
    assert bad.status_code == 422 and bad.json()["error_type"] == "Validation"


async def test_without_a_worker_a_request_waits_its_deadline_then_504s_leaving_nothing(
    fleet_settings: Settings,
) -> None:
    lonely = fleet_settings.model_copy(
        update={"namespace": f"gw{uuid.uuid4().hex[:8]}", "gateway_timeout_s": 1.5}
    )
    lane = lonely.keys.priority_streams
    redis = connect(lonely.effective_redis_url)
    try:
        with running_gateway(lonely) as url:
            # ready means the gateway and its Redis serve: a request sent now is enqueued
            assert httpx.get(f"{url}/readyz").json() == {
                "status": "ready",
                "live_workers": 0,
                "models": {"all-MiniLM-L6-v2": 0},
            }
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)
            for inputs in (["anyone?"], [f"many inputs {n}" for n in range(10)]):
                started = time.monotonic()
                with pytest.raises(openai.APIStatusError) as caught:
                    await client.embeddings.create(model="all-MiniLM-L6-v2", input=inputs)
                assert caught.value.status_code == 504, "it waited for a worker, not 503"
                assert time.monotonic() - started >= 1.5
                error = caught.value.response.json()["error"]
                assert error["code"] == "timeout"
                assert "no embedding worker is running" in error["message"], "the hint"
                # withdrawn on timeout: nothing is left for a late worker to embed
                assert await redis.xlen(lane.query) == 0
                assert await redis.xlen(lane.interactive) == 0
            assert httpx.get(f"{url}/health").status_code == 503, "TEI's health: can it answer"
    finally:
        await redis.aclose()


async def test_a_large_request_is_429_while_the_interactive_stream_is_full(
    fleet_settings: Settings,
) -> None:
    full = fleet_settings.model_copy(
        update={"namespace": f"gw{uuid.uuid4().hex[:8]}", "backlog_high_water": 20}
    )
    redis = connect(full.effective_redis_url)
    try:
        for _ in range(20):  # a backlog of large requests no worker has read
            await redis.xadd(full.keys.priority_streams.interactive, {"m": b"x"})
        with running_gateway(full) as url:
            client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)
            with pytest.raises(openai.RateLimitError) as caught:
                await client.embeddings.create(
                    model="all-MiniLM-L6-v2", input=[f"large {n}" for n in range(10)]
                )
            assert caught.value.status_code == 429
            assert caught.value.response.headers["retry-after"] == "5"
            assert "EMBEDFLEET_BACKLOG_HIGH_WATER" in caught.value.message
            assert "interactive stream" in caught.value.message
    finally:
        await redis.aclose()


async def test_a_large_request_during_a_bulk_backlog_answers_before_it_drains(
    fleet_settings: Settings, gateway: str, reference
) -> None:
    """Over the high-water mark even: the backlog neither refuses nor holds up a request."""
    marked = fleet_settings.model_copy(update={"backlog_high_water": 100})
    backlog = [chunk.text[:200] for chunk in builtin_corpus(BACKLOG)]  # over 1 window
    assert BACKLOG > BACKLOG_WINDOW > BACKLOG // 2
    large = [f"a request of many inputs, number {n}" for n in range(40)]
    redis = connect(marked.effective_redis_url)
    try:
        async with Producer(fleet_settings, redis) as producer:
            # the gateway first: the worker drains the backlog while a gateway starts (800
            # entries in the seconds one took beside another module, failing the assertion)
            with running_gateway(marked) as url:
                client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)
                await producer.enqueue(
                    ({"id": f"b{n}", "text": t} for n, t in enumerate(backlog)), job="backlog"
                )
                # once the worker is busy on the backlog (it has acknowledged some of it)
                while (await producer.progress("backlog")).done == 0:
                    await asyncio.sleep(0.05)
                response = await client.embeddings.create(model="all-MiniLM-L6-v2", input=large)
                progress = await producer.progress("backlog")
                still_queued = await redis.xlen(marked.keys.ingest)
            got = np.array([item.embedding for item in response.data])
            assert min_cosine(got, reference(large)) >= 0.999
            print(f"answered with {still_queued} backlog entries queued, {progress}")
            assert still_queued > 0 and progress.done < progress.enqueued // 2, (
                "answered well before the backlog drained"
            )
            await producer.wait_for_job("backlog", timeout=600)
    finally:
        await redis.aclose()


def test_files_dir_is_created(fleet_settings: Settings, gateway: str) -> None:
    assert Path(fleet_settings.files_dir).is_dir()


def _batch_line(custom_id: str, body_input: object, **extra: object) -> str:
    body = {"model": "all-MiniLM-L6-v2", "input": body_input, **extra}
    return json.dumps(
        {"custom_id": custom_id, "method": "POST", "url": "/v1/embeddings", "body": body}
    )


def test_batch_api_on_1000_lines_survives_a_gateway_restart(
    fleet_settings: Settings, gateway: str, reference, tmp_path: Path
) -> None:
    texts = [chunk.text[:160] for chunk in builtin_corpus(1000)]  # short: CI time
    lines = [_batch_line(f"req-{n}", text) for n, text in enumerate(texts[:997])]
    lines.append(_batch_line("multi", texts[997:999]))  # two inputs on one line
    lines.append(_batch_line("short", texts[999], dimensions=32, encoding_format="base64"))
    lines.append(
        _batch_line("tokens", "hello world")
    )  # token ids: tests/end_to_end/test_gateway_clients.py
    source = tmp_path / "batch.jsonl"
    source.write_text("\n".join(lines) + "\n")
    # created through one gateway, which then stops: another finishes it (state is in Redis
    # and the files directory, nothing in the process)
    with running_gateway(fleet_settings) as first_url:
        first = openai.OpenAI(base_url=f"{first_url}/v1", api_key=API_KEY, max_retries=0)
        uploaded = first.files.create(file=source.open("rb"), purpose="batch")
        assert uploaded.purpose == "batch" and uploaded.bytes == source.stat().st_size
        batch = first.batches.create(
            input_file_id=uploaded.id,
            endpoint="/v1/embeddings",
            completion_window="24h",
            metadata={"test": "restart"},
        )
        assert batch.status == "validating" and batch.request_counts.total == 1000
    client = openai.OpenAI(base_url=f"{gateway}/v1", api_key=API_KEY, max_retries=0)
    deadline = time.monotonic() + 600
    seen_statuses = set()
    while (batch := client.batches.retrieve(batch.id)).status not in ("completed", "failed"):
        seen_statuses.add(batch.status)
        assert time.monotonic() < deadline, f"batch still {batch.status}: {batch.request_counts}"
        time.sleep(0.5)
    assert batch.request_counts.completed == 1000 and batch.request_counts.failed == 0
    assert batch.error_file_id is None and batch.metadata == {"test": "restart"}
    assert batch.id in [b.id for b in client.batches.list()]
    output = client.files.content(batch.output_file_id).text.splitlines()
    records = [json.loads(line) for line in output]
    custom_ids = [record["custom_id"] for record in records]
    assert sorted(custom_ids) == sorted(
        [f"req-{n}" for n in range(997)] + ["multi", "short", "tokens"]
    )
    assert len(set(custom_ids)) == 1000  # every custom_id exactly once
    by_id = {record["custom_id"]: record for record in records}
    for record in records:
        assert record["error"] is None and record["id"].startswith("batch_req_")
        assert record["response"]["status_code"] == 200
    sample = [
        by_id[f"req-{n}"]["response"]["body"]["data"][0]["embedding"] for n in range(0, 997, 50)
    ]
    assert min_cosine(np.array(sample), reference(texts[0:997:50])) >= 0.999
    multi = by_id["multi"]["response"]["body"]
    assert [d["index"] for d in multi["data"]] == [0, 1]
    got = np.array([d["embedding"] for d in multi["data"]])
    assert min_cosine(got, reference(texts[997:999])) >= 0.999
    short = by_id["short"]["response"]["body"]["data"][0]["embedding"]
    assert np.frombuffer(base64.b64decode(short), dtype="<f4").shape == (32,)
    assert by_id["tokens"]["response"]["body"]["usage"]["prompt_tokens"] == 4


def test_batch_lines_are_validated_by_the_batch(client: openai.OpenAI, tmp_path: Path) -> None:
    """As OpenAI does: the upload is taken as it is, and the batch fails naming each bad line."""
    source = tmp_path / "bad.jsonl"
    source.write_text(
        "\n".join(
            [
                _batch_line("a", "fine"),
                _batch_line("a", "custom_id used twice"),
                json.dumps({"custom_id": "b", "method": "GET", "url": "/v1/embeddings"}),
                "not json",
                _batch_line("c", "x").replace("all-MiniLM-L6-v2", "gpt-4"),
            ]
        )
    )
    uploaded = client.files.create(file=source.open("rb"), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h"
    )
    deadline = time.monotonic() + 60
    while (batch := client.batches.retrieve(batch.id)).status == "validating":
        assert time.monotonic() < deadline, batch.status
        time.sleep(0.1)
    assert batch.status == "failed"
    messages = {error.line: error.message for error in batch.errors.data}
    assert sorted(messages) == [2, 3, 4, 5]
    assert "custom_id 'a' is used twice" in messages[2]
    assert "'method'" in messages[3] and "not JSON" in messages[4]
    assert "the model 'gpt-4'" in messages[5]
    with pytest.raises(openai.NotFoundError):
        client.batches.retrieve("batch_missing")


def test_a_cancelled_batch_ends_cancelled_with_what_was_done(
    fleet_settings: Settings, client: openai.OpenAI, tmp_path: Path
) -> None:
    source = tmp_path / "cancel.jsonl"
    source.write_text("\n".join(_batch_line(f"c{n}", f"text {n}") for n in range(3000)) + "\n")
    uploaded = client.files.create(file=source.open("rb"), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h"
    )
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status == "cancelling"
    deadline = time.monotonic() + 300
    while (batch := client.batches.retrieve(batch.id)).status != "cancelled":
        assert time.monotonic() < deadline, batch.status
        time.sleep(0.25)
    counts = batch.request_counts
    assert counts.total == 3000 and counts.completed + counts.failed == 3000
    assert batch.cancelled_at is not None and batch.error_file_id is not None
    errors = [
        json.loads(line) for line in client.files.content(batch.error_file_id).text.splitlines()
    ]
    assert all(e["error"]["code"] == "batch_cancelled" for e in errors)
    assert len(errors) == counts.failed
