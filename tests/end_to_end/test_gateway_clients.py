"""The dialects as their clients use them: the `openai` SDK, LangChain's `OpenAIEmbeddings`,
LlamaIndex's TEI embedding and `huggingface_hub.InferenceClient`, against `embedfleet serve`
with a real worker process and a real Redis server, each at parity with sentence-transformers;
and TEI's routes and statuses, every error in its route's envelope."""

from __future__ import annotations

import base64
import json
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest

from embedfleet.producer.tokens import ModelTokenizer
from embedfleet.server import ServerProcess
from embedfleet.shared.model_path import resolve_model_path
from embedfleet.shared.settings import PACKAGED_MODEL as MODEL
from embedfleet.shared.settings import Settings
from tests.conftest import _server_binary
from tests.gateway_support import GATEWAY_AUTH as AUTH
from tests.gateway_support import GATEWAY_KEY as API_KEY
from tests.gateway_support import (
    TEXTS,
    min_cosine,
    module_sentence_transformer,
    module_served,
    running_gateway,
    wait_for_worker,
)

# the slow tier (make test-full, CI): starts processes or servers, or compiles a model
pytestmark = pytest.mark.slow

MAX_INPUTS = 64


fleet_settings, worker, gateway = module_served(
    "gc", api_keys=API_KEY, gateway_max_inputs=MAX_INPUTS
)
model_st = module_sentence_transformer(MODEL)


@pytest.fixture(scope="module")
def reference(model_st):
    """sentence-transformers itself on the same model directory: the vectors to match."""
    return lambda texts: model_st.encode(list(texts), normalize_embeddings=False)


@pytest.fixture(scope="module")
def tokenizer() -> ModelTokenizer:
    return ModelTokenizer(resolve_model_path(MODEL))


@pytest.fixture
def client(gateway: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway}/v1", api_key=API_KEY, max_retries=0)


def long_text_with_a_different_end() -> tuple[str, str]:
    """A text over the model's 256 tokens whose start and end are about different things, and
    its end, whole words of a few hundred tokens."""
    head = " ".join(["The quick brown fox jumps over the lazy dog."] * 40)
    tail = " ".join(["Cats and dogs play in the park every day."] * 30)  # one token a word
    return f"{head} {tail}", tail


# --- the openai SDK -------------------------------------------------------------------------


def test_openai_sdk_float_base64_and_dimensions(client: openai.OpenAI, reference) -> None:
    expected = reference(TEXTS)
    default = client.embeddings.create(model=MODEL, input=TEXTS)  # the SDK asks for base64
    floats = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    for response in (default, floats):
        assert [item.index for item in response.data] == list(range(len(TEXTS)))
        assert min_cosine(np.array([d.embedding for d in response.data]), expected) >= 0.999
    # asked for explicitly, the SDK hands the base64 over as it came: little-endian float32
    raw = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="base64")
    decoded = np.array([np.frombuffer(base64.b64decode(d.embedding), "<f4") for d in raw.data])
    assert min_cosine(decoded, expected) >= 0.999
    cut = client.embeddings.create(model=MODEL, input=TEXTS, dimensions=128)
    got = np.array([d.embedding for d in cut.data])
    assert got.shape == (4, 128) and np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    assert min_cosine(got, expected[:, :128]) >= 0.999


def test_openai_sdk_gets_token_ids_refused_with_the_fix_named(client: openai.OpenAI) -> None:
    for ids in ([9906, 1917], [[9906, 1917], [15339, 1917]]):
        with pytest.raises(openai.BadRequestError) as caught:
            client.embeddings.create(model=MODEL, input=ids)
        error = caught.value
        assert error.status_code == 400 and error.code == "token_ids_not_accepted"
        assert error.param == "input"
        assert "check_embedding_ctx_length=False" in error.message
        assert "EMBEDFLEET_GATEWAY_ACCEPT_TOKEN_IDS" in error.message


def test_the_models_own_token_ids_behind_the_setting(
    fleet_settings: Settings,
    client: openai.OpenAI,
    tokenizer: ModelTokenizer,
    reference,
    tmp_path: Path,
) -> None:
    accepting = fleet_settings.model_copy(update={"gateway_accept_token_ids": True})
    ids = [tokenizer.tokenizer.encode(t, add_special_tokens=False).ids for t in TEXTS[:2]]
    lines = [
        {"custom_id": "ids", "method": "POST", "url": "/v1/embeddings"},
        {"custom_id": "text", "method": "POST", "url": "/v1/embeddings"},
    ]
    lines[0]["body"] = {"model": MODEL, "input": ids}
    lines[1]["body"] = {"model": MODEL, "input": TEXTS[2]}
    batch_file = tmp_path / "ids.jsonl"
    batch_file.write_text("".join(json.dumps(line) + "\n" for line in lines))
    # a batch line of token ids: accepted at upload, as OpenAI does, then refused on its own
    # (the online endpoint's 400, in the error file) while the batch completes with the rest
    refused = finished_batch(
        client, client.files.create(file=batch_file.open("rb"), purpose="batch")
    )
    assert refused.status == "completed" and refused.errors is None, refused
    counts = refused.request_counts
    assert (counts.total, counts.completed, counts.failed) == (2, 1, 1)
    assert refused.output_file_id and refused.error_file_id
    [error_line] = batch_records(client, refused.error_file_id)
    [text_line] = batch_records(client, refused.output_file_id)
    assert error_line["custom_id"] == "ids" and error_line["response"]["status_code"] == 400
    error = error_line["response"]["body"]["error"]
    assert (error["code"], error["param"]) == ("token_ids_not_accepted", "body.input")
    assert "check_embedding_ctx_length=False" in error["message"]
    assert "EMBEDFLEET_GATEWAY_ACCEPT_TOKEN_IDS" in error["message"]
    assert text_line["custom_id"] == "text" and text_line["response"]["status_code"] == 200
    text_vector = [d["embedding"] for d in text_line["response"]["body"]["data"]]
    with running_gateway(accepting) as url:
        wait_for_worker(url)
        sdk = openai.OpenAI(base_url=f"{url}/v1", api_key=API_KEY, max_retries=0)
        many = sdk.embeddings.create(model=MODEL, input=ids, encoding_format="float")
        one = sdk.embeddings.create(model=MODEL, input=ids[0])
        tei = httpx.post(f"{url}/embed", headers=AUTH, json={"inputs": ids}).json()
        # batch lines follow the same setting: both lines embedded, none refused
        accepted = finished_batch(
            sdk, sdk.files.create(file=batch_file.open("rb"), purpose="batch")
        )
        assert accepted.status == "completed", accepted.errors
        assert accepted.request_counts.failed == 0 and accepted.error_file_id is None
        by_id = {r["custom_id"]: r for r in batch_records(sdk, accepted.output_file_id)}
    expected = reference(TEXTS[:3])
    assert min_cosine(np.array([d.embedding for d in many.data]), expected[:2]) >= 0.999
    assert min_cosine(np.array(one.data[0].embedding), expected[:1]) >= 0.999
    assert min_cosine(np.array(tei), expected[:2]) >= 0.999
    batch_ids = [d["embedding"] for d in by_id["ids"]["response"]["body"]["data"]]
    assert min_cosine(np.array(batch_ids), expected[:2]) >= 0.999
    assert min_cosine(np.array(text_vector), expected[2:3]) >= 0.999


def batch_records(client: openai.OpenAI, file_id: str) -> list[dict[str, Any]]:
    """A batch's output or error file, one record a line."""
    return [json.loads(line) for line in client.files.content(file_id).text.splitlines()]


def finished_batch(client: openai.OpenAI, uploaded: Any, timeout: float = 120.0) -> Any:
    """Run a batch of the uploaded file to its end (completed, failed, expired, cancelled)."""
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h"
    )
    deadline = time.monotonic() + timeout
    while batch.status not in ("completed", "failed", "expired", "cancelled"):
        assert time.monotonic() < deadline, f"batch {batch.id} still {batch.status}"
        time.sleep(0.1)  # polling the batch's state, as its clients do
        batch = client.batches.retrieve(batch.id)
    return batch


# --- LangChain ------------------------------------------------------------------------------


def test_langchain_as_documented_for_other_servers(gateway: str, reference) -> None:
    from langchain_openai import OpenAIEmbeddings

    # langchain-openai's documentation for OpenAI-compatible servers: send the text itself
    embeddings = OpenAIEmbeddings(
        model=MODEL,
        base_url=f"{gateway}/v1",
        api_key=API_KEY,
        check_embedding_ctx_length=False,
        max_retries=0,
    )
    documents = embeddings.embed_documents(TEXTS)
    assert min_cosine(np.array(documents), reference(TEXTS)) >= 0.999
    query = embeddings.embed_query(TEXTS[2])
    assert min_cosine(np.array(query), reference(TEXTS[2:3])) >= 0.999


def test_langchain_defaults_get_the_clear_error_not_wrong_vectors(
    gateway: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    import llama_index.core
    from langchain_openai import OpenAIEmbeddings

    # LangChain's defaults tokenize with tiktoken's cl100k_base; its file comes from a wheel
    # (llama-index-core ships it), as nothing is downloaded here
    cache = Path(llama_index.core.__file__).parent / "_static" / "tiktoken_cache"
    assert any(cache.iterdir()), f"no tiktoken cache in {cache}"
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(cache))
    embeddings = OpenAIEmbeddings(
        model=MODEL, base_url=f"{gateway}/v1", api_key=API_KEY, max_retries=0
    )
    with pytest.raises(openai.BadRequestError) as caught:
        embeddings.embed_documents(TEXTS)
    assert caught.value.code == "token_ids_not_accepted"
    assert "check_embedding_ctx_length=False" in caught.value.message
    with pytest.raises(openai.BadRequestError):
        embeddings.embed_query(TEXTS[0])


# --- LlamaIndex -----------------------------------------------------------------------------


def test_llamaindex_tei_embedding(gateway: str, reference) -> None:
    from llama_index.embeddings.text_embeddings_inference import TextEmbeddingsInference

    embed_model = TextEmbeddingsInference(model_name=MODEL, base_url=gateway, auth_token=API_KEY)
    documents = embed_model.get_text_embedding_batch(TEXTS)
    assert min_cosine(np.array(documents), reference(TEXTS)) >= 0.999
    query = embed_model.get_query_embedding(TEXTS[1])
    assert min_cosine(np.array(query), reference(TEXTS[1:2])) >= 0.999
    # it sends truncate=true: a long text is cut to fit, as sentence-transformers cuts it
    long, _ = long_text_with_a_different_end()
    assert min_cosine(np.array(embed_model.get_text_embedding(long)), reference([long])) >= 0.999


# --- huggingface_hub ------------------------------------------------------------------------


def test_inference_client_feature_extraction(
    gateway: str, reference, tokenizer: ModelTokenizer, hub_online: None
) -> None:
    from huggingface_hub import InferenceClient
    from huggingface_hub.errors import HfHubHTTPError

    tei = InferenceClient(base_url=gateway, api_key=API_KEY)
    one = tei.feature_extraction(TEXTS[0])
    assert min_cosine(one.reshape(1, -1), reference(TEXTS[:1])) >= 0.999
    normalized = tei.feature_extraction(TEXTS[1], normalize=True)
    assert np.isclose(np.linalg.norm(normalized), 1.0, atol=1e-3)
    long, tail = long_text_with_a_different_end()
    right = tei.feature_extraction(long, truncate=True, truncation_direction="right")
    left = tei.feature_extraction(long, truncate=True, truncation_direction="left")
    assert min_cosine(right.reshape(1, -1), reference([long])) >= 0.999
    # the last tokens that fit, as sentence-transformers reads them
    budget = 256 - tokenizer.special_tokens  # the model card's max_length (/info, below)
    last_ids = tokenizer.tokenizer.encode(long, add_special_tokens=False).ids[-budget:]
    kept = tokenizer.tokenizer.decode(last_ids)
    assert tail.lower().endswith(kept)
    assert min_cosine(left.reshape(1, -1), reference([kept])) >= 0.999
    assert min_cosine(left.reshape(1, -1), right.reshape(1, -1)) < 0.95  # another end
    with pytest.raises(HfHubHTTPError) as too_long:
        tei.feature_extraction(long, truncate=False)
    assert too_long.value.response.status_code == 422
    # this model's pipeline ends in Normalize: normalize=false is the vector before it, as TEI
    # answers (parity with the model's modules: tests/end_to_end/test_gateway_dialects.py)
    raw = tei.feature_extraction(TEXTS[0], normalize=False)
    assert min_cosine(raw.reshape(1, -1), reference(TEXTS[:1])) >= 0.999
    assert not np.isclose(np.linalg.norm(raw), 1.0, atol=1e-2)


# --- TEI's routes ---------------------------------------------------------------------------


def test_tei_info_has_resolved_values(gateway: str, fleet_settings: Settings) -> None:
    info = httpx.get(f"{gateway}/info", headers=AUTH).json()
    assert info["model_id"] == MODEL and info["served_model_name"] == MODEL
    assert info["max_input_length"] == 256 and info["max_client_batch_size"] == MAX_INPUTS
    resolved = fleet_settings.batching("cpu")
    assert info["max_batch_tokens"] == resolved.token_budget > 0
    assert info["max_batch_requests"] == resolved.max_batch > 0
    assert info["auto_truncate"] is True  # TEI's default (EMBEDFLEET_GATEWAY_AUTO_TRUNCATE)
    # what the worker computes in (its card's: EMBEDFLEET_DTYPE auto, a CPU's), and the
    # prompt names sentence-transformers gives every model
    assert info["model_dtype"] in ("float32", "bfloat16")
    assert info["prompts"] == {"query": "", "document": ""}
    assert "embedding" in info["model_type"]
    assert httpx.get(f"{gateway}/info").status_code == 401  # not a public route


def test_tei_health_routes_are_public(gateway: str) -> None:
    for path in ("/health", "/ping", "/"):
        answer = httpx.get(f"{gateway}{path}")  # no key: probes have none
        assert answer.status_code == 200, path
    assert httpx.post(f"{gateway}/", json={"inputs": "hi"}).status_code == 401  # POST embeds
    embedded = httpx.post(f"{gateway}/", headers=AUTH, json={"inputs": "hi"})
    assert embedded.status_code == 200 and len(embedded.json()[0]) == 384


def test_tei_tokenize_and_decode_round_trip(gateway: str, tokenizer: ModelTokenizer) -> None:
    texts = ["Hello, wörld: naïve café!", TEXTS[0]]
    tokens = httpx.post(f"{gateway}/tokenize", headers=AUTH, json={"inputs": texts}).json()
    assert len(tokens) == 2
    for text, row in zip(texts, tokens, strict=True):
        assert [t["id"] for t in row] == tokenizer.tokenizer.encode(text).ids
        assert row[0] == {"id": 101, "text": "[CLS]", "special": True, "start": None, "stop": None}
        raw = text.encode()
        for token in row[1:-1]:  # byte offsets into the input, as TEI counts them
            assert raw[token["start"] : token["stop"]].decode() == token["text"]
    plain = httpx.post(
        f"{gateway}/tokenize",
        headers=AUTH,
        json={"inputs": TEXTS[1], "add_special_tokens": False},
    ).json()
    assert not any(t["special"] for t in plain[0])
    ids = [[t["id"] for t in row] for row in tokens]
    decoded = httpx.post(f"{gateway}/decode", headers=AUTH, json={"ids": ids}).json()
    assert decoded == [tokenizer.tokenizer.decode(row) for row in ids]
    assert decoded[1] == TEXTS[0].lower()  # uncased: the text, lower-cased
    single = httpx.post(
        f"{gateway}/decode", headers=AUTH, json={"ids": ids[1], "skip_special_tokens": False}
    ).json()
    assert single[0].startswith("[CLS]") and single[0].endswith("[SEP]")
    outside = httpx.post(f"{gateway}/decode", headers=AUTH, json={"ids": [10**7]})
    assert outside.status_code == 422 and outside.json()["error_type"] == "Validation"


def test_tei_statuses_as_tei_answers_them(gateway: str) -> None:
    def post(path: str, body: object) -> httpx.Response:
        return httpx.post(f"{gateway}{path}", headers=AUTH, json=body)

    cases = [
        (post("/embed", {"inputs": ["x"] * (MAX_INPUTS + 1)}), 422, "Validation"),
        (post("/embed", {"inputs": []}), 400, "Empty"),
        (post("/embed", {"inputs": "word " * 400, "truncate": False}), 422, "Validation"),
        (post("/embed", {"input": "wrong field"}), 422, "Validation"),
        (post("/embed", {"inputs": "hi", "dimensions": 1000}), 422, "Validation"),
        (post("/embed", {"inputs": "hi", "truncation_direction": "Middle"}), 422, "Validation"),
        (post("/tokenize", {"inputs": []}), 400, "Empty"),
        (httpx.get(f"{gateway}/embed", headers=AUTH), 405, "Validation"),
        # served now (SPLADE models); a dense model cannot answer it, as TEI's backend cannot
        (post("/embed_sparse", {"inputs": "hi"}), 424, "Backend"),
    ]
    for answer, status, error_type in cases:
        assert answer.status_code == status, answer.text
        body = answer.json()
        assert set(body) == {"error", "error_type"} and body["error_type"] == error_type
        assert body["error"]
    assert "must have less than 256 tokens" in cases[2][0].json()["error"]
    assert cases[7][0].headers["allow"] == "POST"


def test_openai_routes_answer_every_status_in_openais_envelope(
    gateway: str, client: openai.OpenAI
) -> None:
    answers = [
        (httpx.post(f"{gateway}/v1/nothing", headers=AUTH, json={}), 404),
        (httpx.get(f"{gateway}/v1/embeddings", headers=AUTH), 405),
        (httpx.post(f"{gateway}/v1/embeddings", headers=AUTH, json={"model": MODEL}), 400),
        (
            httpx.post(
                f"{gateway}/v1/embeddings",
                headers={**AUTH, "Content-Type": "application/json"},
                content=b"{not json",
            ),
            400,
        ),
    ]
    for answer, status in answers:
        assert answer.status_code == status, answer.text
        assert set(answer.json()["error"]) == {"message", "type", "param", "code"}
    assert "Invalid URL (POST /v1/nothing)" in answers[0][0].json()["error"]["message"]
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("text-embedding-3-small")


def test_redis_faults_are_503_with_retry_after_in_each_envelope(
    fleet_settings: Settings,
) -> None:
    with ServerProcess(_server_binary()) as own_redis:
        settings = fleet_settings.model_copy(
            update={"redis_url": own_redis.url, "gateway_retry_after_s": 7}
        )
        with running_gateway(settings) as url:
            own_redis.stop()
            openai_answer = httpx.post(
                f"{url}/v1/embeddings", headers=AUTH, json={"model": MODEL, "input": "hi"}
            )
            tei_answer = httpx.post(f"{url}/embed", headers=AUTH, json={"inputs": "hi"})
            health = httpx.get(f"{url}/health")
    assert openai_answer.status_code == 503 and openai_answer.headers["retry-after"] == "7"
    error = openai_answer.json()["error"]
    assert error["code"] == "queue_unavailable" and error["type"] == "server_error"
    assert "Redis" in error["message"]
    for answer in (tei_answer, health):
        assert answer.status_code == 503 and answer.headers["retry-after"] == "7"
        assert answer.json()["error_type"] == "Unhealthy"
