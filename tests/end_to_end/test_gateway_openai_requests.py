"""What OpenAI's and TEI's clients send that the gateway used to refuse or take wrongly (issue 54),
against `embedfleet serve` with a real worker process and a real Redis server, vectors at parity
with sentence-transformers: token ids of a tiktoken encoding (one the test builds, and
LangChain's `OpenAIEmbeddings` with its defaults, offline) decoded and their text embedded; a
request without `model`, and names mapped by EMBEDFLEET_GATEWAY_MODEL_ALIASES; OpenAI's
300,000-token request limit; a Batch object's `model` and `usage`."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import redis

from embedfleet.producer.tokens import ModelTokenizer
from embedfleet.shared.model_path import resolve_model_path
from embedfleet.shared.settings import Settings
from tests.end_to_end.test_gateway_clients import batch_records, finished_batch
from tests.gateway_support import (
    min_cosine,
    module_fleet_settings,
    module_sentence_transformer,
    module_worker,
    openai_gateway,
    running_gateway,
    wait_for_worker,
)
from tests.tiktoken_support import built_encoding, cl100k_cache, write_encoding

# the slow tier (make test-full, CI): starts a worker process and gateways
pytestmark = pytest.mark.slow

MODEL = "all-MiniLM-L6-v2"
TEXTS = [
    "How do I open a file in Python?",
    "The quick brown fox jumps over the lazy dog.",
    "naïve café: ünïcode survives the round trip",
]

fleet_settings = module_fleet_settings("oq")
worker = module_worker("oq")
model_st = module_sentence_transformer(MODEL)


@pytest.fixture(scope="module")
def reference(model_st):
    return lambda texts: model_st.encode(list(texts))


def vectors_of(answer) -> np.ndarray:
    return np.array([item.embedding for item in answer.data])


def test_token_ids_of_a_named_tiktoken_encoding_embed_their_text(
    fleet_settings: Settings, worker, reference, tmp_path: Path
) -> None:
    encoding = built_encoding()
    ids = [encoding.encode(text) for text in TEXTS]
    # unset: the 400 names the setting
    with openai_gateway(fleet_settings) as plain, pytest.raises(openai.BadRequestError) as refused:
        plain.embeddings.create(model=MODEL, input=ids)
    assert refused.value.code == "token_ids_not_accepted"
    assert "EMBEDFLEET_GATEWAY_TIKTOKEN_ENCODING" in refused.value.message
    reading = fleet_settings.model_copy(
        update={"gateway_tiktoken_encoding": str(write_encoding(tmp_path))}
    )
    with openai_gateway(reading) as client:
        many = client.embeddings.create(model=MODEL, input=ids, encoding_format="float")
        one = client.embeddings.create(model=MODEL, input=ids[0], encoding_format="float")
        with pytest.raises(openai.BadRequestError) as outside:
            client.embeddings.create(model=MODEL, input=[[1, encoding.n_vocab + 5]])
    assert outside.value.code == "invalid_input"
    assert min_cosine(vectors_of(many), reference(TEXTS)) >= 0.999
    assert min_cosine(vectors_of(one), reference(TEXTS[:1])) >= 0.999
    # the usage counts the model's tokens of the texts, not the encoding's ids
    tokenizer = ModelTokenizer(resolve_model_path(MODEL))
    assert many.usage.prompt_tokens == tokenizer.usage(TEXTS, 256)


def test_langchains_defaults_get_the_vectors_of_their_texts(
    fleet_settings: Settings, worker, reference, monkeypatch: pytest.MonkeyPatch
) -> None:
    from langchain_openai import OpenAIEmbeddings

    # offline: LangChain and the gateway read cl100k_base from the same cache (a wheel's)
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(cl100k_cache()))
    reading = fleet_settings.model_copy(update={"gateway_tiktoken_encoding": "cl100k_base"})
    with running_gateway(reading) as url:
        wait_for_worker(url)
        # check_embedding_ctx_length=True (the default): the texts go as cl100k_base's ids
        embeddings = OpenAIEmbeddings(
            model=MODEL, base_url=f"{url}/v1", api_key="unused", max_retries=0
        )
        documents = embeddings.embed_documents(TEXTS)
        query = embeddings.embed_query(TEXTS[1])
    assert min_cosine(np.array(documents), reference(TEXTS)) >= 0.999
    assert min_cosine(np.array(query), reference(TEXTS[1:2])) >= 0.999


def test_a_request_without_model_and_aliased_names(
    fleet_settings: Settings, worker, reference
) -> None:
    aliased = fleet_settings.model_copy(
        update={"gateway_model_aliases": f"text-embedding-ada-002={MODEL}"}
    )
    with running_gateway(aliased) as url:
        wait_for_worker(url)
        # TEI's users leave `model` out: the one model served
        bare = httpx.post(f"{url}/v1/embeddings", json={"input": TEXTS}, timeout=60)
        assert bare.status_code == 200, bare.text
        assert bare.json()["model"] == MODEL
        got = np.array([item["embedding"] for item in bare.json()["data"]])
        assert min_cosine(got, reference(TEXTS)) >= 0.999
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
        answer = client.embeddings.create(model="text-embedding-ada-002", input=TEXTS[:1])
        assert answer.model == MODEL
        assert min_cosine(vectors_of(answer), reference(TEXTS[:1])) >= 0.999
        with pytest.raises(openai.NotFoundError) as unknown:  # OpenAI's answer stays
            client.embeddings.create(model="text-embedding-3-large", input="hi")
        assert unknown.value.code == "model_not_found"
    # no alias: OpenAI's 404, as before
    with openai_gateway(fleet_settings) as plain, pytest.raises(openai.NotFoundError):
        plain.embeddings.create(model="text-embedding-ada-002", input="hi")
    # a namespace of several models: which one is the request's to say
    keys = fleet_settings.keys
    other = keys.for_model("other")
    with redis.Redis.from_url(fleet_settings.redis_url) as client_redis:
        client_redis.hset(keys.models, "other", other.model)
        try:
            with running_gateway(fleet_settings) as url:
                several = httpx.post(f"{url}/v1/embeddings", json={"input": "hi"}, timeout=60)
        finally:
            client_redis.hdel(keys.models, "other")
    assert several.status_code == 400
    error = several.json()["error"]
    assert (error["code"], error["param"]) == ("model_required", "model")
    assert "'other'" in error["message"] and MODEL in error["message"]


def test_a_request_over_openais_token_limit_gets_openais_400(
    fleet_settings: Settings, worker
) -> None:
    # 1,300 inputs of 252 tokens (250 words, CLS and SEP): 327,600 tokens, all within the
    # model's 256 each and the 2,048 inputs
    texts = ["hello " * 250] * 1300
    with openai_gateway(fleet_settings) as client, pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model=MODEL, input=texts)
    error = caught.value
    assert error.status_code == 400
    assert error.body == {
        "message": "Requested 327600 tokens, max 300000 tokens per request",
        "type": "max_tokens_per_request",
        "param": None,
        "code": "max_tokens_per_request",
    }


def test_a_batch_object_has_its_model_and_usage(
    fleet_settings: Settings, worker, tmp_path: Path
) -> None:
    lines = [
        {"custom_id": f"r{n}", "method": "POST", "url": "/v1/embeddings", "body": body}
        for n, body in enumerate(
            [{"model": MODEL, "input": TEXTS[:2]}, {"model": MODEL, "input": TEXTS[2]}]
        )
    ]
    batch_file = tmp_path / "batch.jsonl"
    batch_file.write_text("".join(json.dumps(line) + "\n" for line in lines))
    with openai_gateway(fleet_settings) as client:
        uploaded = client.files.create(file=batch_file.open("rb"), purpose="batch")
        batch = finished_batch(client, uploaded)
        records = batch_records(client, batch.output_file_id)
    assert batch.status == "completed" and batch.model == MODEL
    answered = sum(record["response"]["body"]["usage"]["prompt_tokens"] for record in records)
    assert answered > 0 and batch.usage is not None
    assert batch.usage.input_tokens == batch.usage.total_tokens == answered
    assert batch.usage.output_tokens == 0
