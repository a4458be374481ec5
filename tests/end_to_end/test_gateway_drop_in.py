"""The routes an app moved from TEI, Infinity, SageMaker or Vertex calls, with the clients it
uses, against `embedfleet serve` with a real worker process and a real Redis server: TEI's
/similarity (``huggingface_hub.InferenceClient.sentence_similarity``, at parity with
sentence-transformers' cosine), OpenAI's /embeddings without /v1 (the `openai` SDK), SageMaker's
/invocations and /ping, Vertex's /vertex, the Swagger UI at /docs, CORS (a browser's preflight,
and the setting of allowed origins) and TEI's timing headers."""

from __future__ import annotations

import uuid

import httpx
import numpy as np
import openai
import pytest

from embedfleet.gateway.timing_headers import HEADERS
from embedfleet.producer.tokens import ModelTokenizer
from embedfleet.shared.model_path import resolve_model_path
from embedfleet.shared.settings import Settings
from tests.gateway_support import (
    min_cosine,
    module_fleet_settings,
    module_gateway_url,
    module_sentence_transformer,
    module_worker,
    running_gateway,
)

# the slow tier (make test-full, CI): starts a worker process and gateways
pytestmark = pytest.mark.slow

API_KEY = "sk-drop-in-" + uuid.uuid4().hex
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MODEL = "all-MiniLM-L6-v2"
SOURCE = "How do I open a file in Python?"
SENTENCES = [
    "Use the built-in open() function to read a file.",
    "The quick brown fox jumps over the lazy dog.",
    "Files are opened with open(path, mode) and closed with close().",
    "Redis streams make a durable queue.",
]

fleet_settings = module_fleet_settings("di", api_keys=API_KEY, gateway_max_inputs=64)
# float32 on the worker: /similarity's parity bar (1e-3 on each cosine) is the route's own; in
# bfloat16 (DTYPE=auto on a CPU with AMX) the model's own rounding moved a cosine by 1.1e-3
worker = module_worker("di", EMBEDFLEET_DTYPE="float32")


gateway = module_gateway_url()


model_st = module_sentence_transformer(MODEL)


@pytest.fixture
def hub_online(monkeypatch: pytest.MonkeyPatch) -> None:
    """huggingface_hub refuses every call under HF_HUB_OFFLINE=1; here it only talks to the
    local gateway."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)


def test_inference_client_sentence_similarity_at_parity(
    gateway: str, model_st, hub_online: None
) -> None:
    """`InferenceClient(base_url).sentence_similarity` posts TEI's SimilarityRequest to the base
    URL itself (POST /, the default route, which tells it by its shape) or, given /similarity,
    there: both are sentence-transformers' cosine on the same sentences."""
    from huggingface_hub import InferenceClient
    from sentence_transformers import util

    expected = util.cos_sim(model_st.encode([SOURCE]), model_st.encode(SENTENCES))[0].numpy()
    for base_url in (gateway, f"{gateway}/similarity"):
        scores = InferenceClient(base_url=base_url, api_key=API_KEY).sentence_similarity(
            SOURCE, SENTENCES
        )
        assert len(scores) == len(SENTENCES)
        assert np.abs(np.asarray(scores) - expected).max() <= 1e-3, (base_url, scores, expected)
    # TEI's request with its parameters; an empty list is TEI's 400 Empty
    raw = httpx.post(
        f"{gateway}/similarity",
        headers=AUTH,
        json={
            "inputs": {"source_sentence": SOURCE, "sentences": SENTENCES[:1]},
            "parameters": {"truncate": True, "truncation_direction": "right"},
        },
    )
    assert raw.status_code == 200 and abs(raw.json()[0] - expected[0]) <= 1e-3
    empty = httpx.post(
        f"{gateway}/similarity",
        headers=AUTH,
        json={"inputs": {"source_sentence": SOURCE, "sentences": []}},
    )
    assert empty.status_code == 400 and empty.json()["error_type"] == "Empty"


def test_openai_sdk_on_a_base_url_without_v1(gateway: str, model_st) -> None:
    """TEI and Infinity serve OpenAI's route as /embeddings too: the SDK given the bare base URL
    gets the same vectors, and errors in OpenAI's envelope."""
    client = openai.OpenAI(base_url=gateway, api_key=API_KEY, max_retries=0)
    answer = client.embeddings.create(model=MODEL, input=SENTENCES)
    got = np.array([item.embedding for item in answer.data])
    assert min_cosine(got, model_st.encode(SENTENCES)) >= 0.999
    assert answer.usage.prompt_tokens > 0 and answer.model == MODEL
    with pytest.raises(openai.NotFoundError) as unknown:
        client.embeddings.create(model="no-such-model", input="hi")
    assert unknown.value.body["code"] == "model_not_found"  # type: ignore[index]


def test_sagemaker_invocations_and_ping(gateway: str, model_st) -> None:
    """SageMaker calls POST /invocations (the served model's default route: /embed for an
    embedding model, as TEI routes it) and GET /ping (TEI's /health, public)."""
    with httpx.Client(base_url=gateway, headers=AUTH) as http:
        one = http.post("/invocations", json={"inputs": SOURCE})
        many = http.post("/invocations", json={"inputs": SENTENCES, "normalize": True})
        assert one.status_code == 200 and many.status_code == 200
        assert min_cosine(np.array(one.json()), model_st.encode([SOURCE])) >= 0.999
        assert min_cosine(np.array(many.json()), model_st.encode(SENTENCES)) >= 0.999
        # a rerank body (the one shape TEI tells apart) on an embedding model: /rerank's refusal
        rerank = http.post("/invocations", json={"query": SOURCE, "texts": SENTENCES})
        assert rerank.status_code == 424 and rerank.json()["error_type"] == "Backend"
        bad = http.post("/invocations", json={"inputs": 5})  # /embed's validation, TEI's shape
        assert bad.status_code == 422 and "error_type" in bad.json()
    assert httpx.get(f"{gateway}/ping").status_code == 200  # no key: a probe has none


def test_vertex_instances_to_predictions(gateway: str, model_st) -> None:
    """Vertex's body: each instance is the default route's request, each prediction its
    answer (TEI's /vertex)."""
    answer = httpx.post(
        f"{gateway}/vertex",
        headers=AUTH,
        json={"instances": [{"inputs": SOURCE}, {"inputs": SENTENCES[:2]}]},
    )
    assert answer.status_code == 200, answer.text
    first, second = answer.json()["predictions"]
    assert min_cosine(np.array(first), model_st.encode([SOURCE])) >= 0.999
    assert min_cosine(np.array(second), model_st.encode(SENTENCES[:2])) >= 0.999
    refused = httpx.post(f"{gateway}/vertex", headers=AUTH, json={"instances": "no"})
    assert refused.status_code == 422 and "error_type" in refused.json()


def test_swagger_ui_over_the_openapi_page(gateway: str) -> None:
    page = httpx.get(f"{gateway}/docs", headers=AUTH)
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert "SwaggerUIBundle" in page.text and "/openapi.json" in page.text
    paths = httpx.get(f"{gateway}/openapi.json", headers=AUTH).json()["paths"]
    for path in ("/similarity", "/embeddings", "/invocations", "/vertex", "/embed"):
        assert path in paths, path


def test_tei_timing_headers_with_the_gateways_figures(gateway: str) -> None:
    """TEI's headers, whole milliseconds: the request's total, its time before the fleet, the
    fleet's round trip; the characters and tokens it sent (the model's tokenizer's count)."""
    tokenizer = ModelTokenizer(resolve_model_path(MODEL))
    answer = httpx.post(f"{gateway}/embed", headers=AUTH, json={"inputs": SENTENCES})
    assert answer.status_code == 200
    figures = {name: answer.headers[name] for name in HEADERS}
    assert figures["x-compute-type"] == "cpu"
    times = {name: int(value) for name, value in figures.items() if name.endswith("-time")}
    assert all(value >= 0 for value in times.values())
    assert times["x-total-time"] == times["x-compute-time"]
    parts = times["x-tokenization-time"] + times["x-queue-time"] + times["x-inference-time"]
    assert parts <= times["x-total-time"] + 3  # each rounded down on its own
    assert int(figures["x-compute-characters"]) == sum(len(text) for text in SENTENCES)
    assert int(figures["x-compute-tokens"]) == tokenizer.usage(SENTENCES, 256)
    similarity = httpx.post(
        f"{gateway}/similarity",
        headers=AUTH,
        json={"inputs": {"source_sentence": SOURCE, "sentences": SENTENCES}},
    )
    assert int(similarity.headers["x-compute-characters"]) == len(SOURCE) + sum(
        len(text) for text in SENTENCES
    )
    # what never reached the fleet has none, nor OpenAI's routes (their usage counts tokens)
    openai_route = httpx.post(
        f"{gateway}/v1/embeddings", headers=AUTH, json={"model": MODEL, "input": SENTENCES}
    )
    assert openai_route.status_code == 200 and "x-compute-time" not in openai_route.headers
    assert "x-compute-time" not in httpx.get(f"{gateway}/info", headers=AUTH).headers
    refused = httpx.post(f"{gateway}/embed", headers=AUTH, json={"inputs": []})
    assert refused.status_code >= 400 and "x-compute-time" not in refused.headers


def preflight(url: str, origin: str, path: str = "/embed") -> httpx.Response:
    return httpx.options(
        f"{url}{path}",
        headers={
            "Origin": origin,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "content-type,authorization",
        },
    )


def test_cors_any_origin_by_default_as_tei(gateway: str) -> None:
    """EMBEDFLEET_GATEWAY_CORS_ALLOW_ORIGINS unset: any origin, as TEI. The preflight carries
    no key and is answered; the answer itself carries the origin header and exposes TEI's
    timing headers to the page."""
    answer = preflight(gateway, "https://app.example.com")
    assert answer.status_code == 200, answer.text
    assert answer.headers["access-control-allow-origin"] == "*"
    assert "POST" in answer.headers["access-control-allow-methods"]
    assert "authorization" in answer.headers["access-control-allow-headers"].lower()
    embedded = httpx.post(
        f"{gateway}/embed",
        headers={**AUTH, "Origin": "https://app.example.com"},
        json={"inputs": "hi"},
    )
    assert embedded.status_code == 200
    assert embedded.headers["access-control-allow-origin"] == "*"
    assert "x-compute-time" in embedded.headers["access-control-expose-headers"]


def test_cors_allowed_origins_setting(fleet_settings: Settings) -> None:
    """A list of origins: those allowed, any other refused (Starlette's 400 on a preflight);
    an empty value: CORS off, a preflight is refused (401 here: this gateway wants a key, and
    a preflight carries none; 405 on an open one). No worker is needed for either."""
    allowed = "https://app.example.com, http://localhost:3000"
    listed = fleet_settings.model_copy(update={"gateway_cors_allow_origins": allowed})
    with running_gateway(listed) as url:
        ok = preflight(url, "http://localhost:3000")
        assert ok.status_code == 200
        assert ok.headers["access-control-allow-origin"] == "http://localhost:3000"
        assert preflight(url, "https://evil.example").status_code == 400
    off = fleet_settings.model_copy(update={"gateway_cors_allow_origins": ""})
    with running_gateway(off) as url:
        answer = preflight(url, "https://app.example.com")
        assert answer.status_code == 401
        assert "access-control-allow-origin" not in answer.headers
