"""The routes an app moved from TEI, Infinity, SageMaker or Vertex calls, with the clients it
uses, against `embedfleet serve` with a real worker process and a real Redis server: TEI's
/similarity (``huggingface_hub.InferenceClient.sentence_similarity``, at parity with
sentence-transformers' cosine), OpenAI's /embeddings without /v1 (the `openai` SDK), SageMaker's
/invocations and /ping, Vertex's /vertex, the Swagger UI at /docs, CORS (a browser's preflight,
and the setting of allowed origins) and TEI's timing headers."""

from __future__ import annotations

from typing import Any

import httpx
import numpy as np
import openai
import pytest

from embedfleet.gateway.timing_headers import HEADERS
from embedfleet.producer.tokens import ModelTokenizer
from embedfleet.shared.model_path import resolve_model_path
from embedfleet.shared.settings import PACKAGED_MODEL as MODEL
from embedfleet.shared.settings import Settings
from tests.gateway_support import GATEWAY_AUTH as AUTH
from tests.gateway_support import GATEWAY_KEY as API_KEY
from tests.gateway_support import (
    min_cosine,
    module_sentence_transformer,
    module_served,
    running_gateway,
)

# the slow tier (make test-full, CI): starts a worker process and gateways
pytestmark = pytest.mark.slow

SOURCE = "How do I open a file in Python?"
SENTENCES = [
    "Use the built-in open() function to read a file.",
    "The quick brown fox jumps over the lazy dog.",
    "Files are opened with open(path, mode) and closed with close().",
    "Redis streams make a durable queue.",
]

# float32 on the worker: /similarity's parity bar (1e-3 on each cosine) is the route's own; in
# bfloat16 (DTYPE=auto on a CPU with AMX) the model's own rounding moved a cosine by 1.1e-3
fleet_settings, worker, gateway = module_served(
    "di", {"EMBEDFLEET_DTYPE": "float32"}, api_keys=API_KEY, gateway_max_inputs=64
)
model_st = module_sentence_transformer(MODEL)


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


# TEI's series, as text-embeddings-inference's router and core name them (metrics::counter!,
# histogram!, gauge! in router/src/http/server.rs, router/src/lib.rs, core/src/infer.rs,
# core/src/queue.rs, core/src/tokenization.rs): name -> (type, label names)
TEI_SERIES = {
    "te_request_count": ("counter", {"method"}),
    "te_request_success": ("counter", {"method"}),
    "te_request_failure": ("counter", {"err"}),
    "te_embed_count": ("counter", set()),
    "te_embed_success": ("counter", set()),
    "te_predict_count": ("counter", set()),
    "te_predict_success": ("counter", set()),
    **{
        f"te_{family}_{timing}": ("histogram", set())
        for family in ("request", "embed", "predict")
        for timing in ("duration", "tokenization_duration", "queue_duration", "inference_duration")
    },
    "te_request_input_length": ("histogram", set()),
    "te_batch_next_size": ("histogram", set()),
    "te_batch_next_tokens": ("histogram", set()),
    "te_queue_size": ("gauge", set()),
}


def scrape(gateway: str) -> tuple[str, dict[str, Any]]:
    """/metrics' text and its families by name (prometheus_client's own parser)."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"{gateway}/metrics").text
    return text, {family.name: family for family in text_string_to_metric_families(text)}


def sample(families: dict[str, Any], name: str, suffix: str = "", **labels: str) -> float:
    """One sample's value (0 where the series has no such sample yet)."""
    family = families.get(name)
    if family is None:
        return 0.0
    wanted = name + (suffix or ("_total" if family.type == "counter" else ""))
    for item in family.samples:
        if item.name == wanted and all(item.labels.get(k) == v for k, v in labels.items()):
            return float(item.value)
    return 0.0


def test_tei_prometheus_series_under_teis_names_move_with_requests(gateway: str) -> None:
    """/metrics has TEI's series beside the fleet's: TEI's names, types, labels and buckets, in
    TEI's exposition (a counter's sample under its own name, which is what a TEI dashboard's
    ``rate(te_request_count[1m])`` selects), counting this gateway's requests: a single input,
    a batch, a refused request (TEI's ``validation``) and one of a kind the model does not
    serve (``model_type``)."""
    _, before = scrape(gateway)
    with httpx.Client(base_url=gateway, headers=AUTH, timeout=60) as http:
        assert http.post("/embed", json={"inputs": SOURCE}).status_code == 200
        assert http.post("/embed", json={"inputs": SENTENCES}).status_code == 200
        too_long = http.post("/embed", json={"inputs": SOURCE, "dimensions": 10**6})
        assert too_long.status_code == 422
        assert http.post("/rerank", json={"query": "q", "texts": ["a"]}).status_code == 424
    text, after = scrape(gateway)
    for name, (kind, labels) in TEI_SERIES.items():
        assert name in after, f"{name} missing from /metrics"
        assert after[name].type == kind, (name, after[name].type)
        names = {label for item in after[name].samples for label in item.labels} - {"le"}
        assert names == labels, (name, names)
    # the counters' samples carry TEI's bare names, not prometheus_client's _total
    assert 'te_request_count{method="single"}' in text
    assert "te_request_count_total" not in text and "te_embed_count_total" not in text

    def moved(name: str, suffix: str = "", **labels: str) -> float:
        return sample(after, name, suffix, **labels) - sample(before, name, suffix, **labels)

    assert moved("te_request_count", method="single") == 2  # the text, the one too wide
    assert moved("te_request_count", method="batch") == 2  # the list, the rerank
    assert moved("te_request_success", method="single") == 1
    assert moved("te_request_success", method="batch") == 1
    assert moved("te_request_failure", err="validation") == 1
    assert moved("te_request_failure", err="model_type") == 1
    assert moved("te_embed_count") == 1 + len(SENTENCES) + 1
    assert moved("te_embed_success") == 1 + len(SENTENCES)
    assert moved("te_request_duration", "_count") == 2
    assert moved("te_embed_inference_duration", "_count") == 1 + len(SENTENCES)
    assert moved("te_request_input_length", "_count") == 1 + len(SENTENCES)
    assert moved("te_batch_next_size", "_count") == 2
    assert moved("te_batch_next_size", "_sum") == 1 + len(SENTENCES)
    assert moved("te_batch_next_tokens", "_sum") == moved("te_request_input_length", "_sum") > 0
    # TEI's buckets: durations from 15 µs by 1.5 (35), input lengths 2^k up to the model's 256
    bounds = [
        float(item.labels["le"])
        for item in after["te_request_duration"].samples
        if item.name.endswith("_bucket")
    ]
    np.testing.assert_allclose(bounds[:-1], [1e-5 * 1.5**k for k in range(1, 36)], rtol=1e-9)
    assert bounds[-1] == float("inf")
    lengths = [
        item.labels["le"]
        for item in after["te_request_input_length"].samples
        if item.name.endswith("_bucket")
    ]
    assert lengths == [*(str(float(2**k)) for k in range(9)), "+Inf"]
    # the fleet's own series are still there
    assert "embedfleet_gateway_requests_total" in text
