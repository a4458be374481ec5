"""Issue 42: a drop-in for apps moved from TEI or OpenAI, with their defaults and statuses,
through a running gateway, a real worker process and Redis, with the real clients (the `openai`
SDK, huggingface_hub's InferenceClient):

- TEI's routes cut an over-long text by default (TEI's router defaults --auto-truncate on) and
  /info says so; /v1 refuses it (OpenAI's 400) unless EMBEDFLEET_GATEWAY_OPENAI_TRUNCATE;
- a text over the characters' limit is cut (characters, then tokens) when truncating;
- each dialect's documented status: 2,049 inputs on /v1 400, "" on /embed 400 ``Empty``, a body
  that is not JSON 400, whitespace embedded;
- TEI's ``normalize: false`` on a model whose last module is Normalize: the pooled vector before
  it, as a SentenceTransformer of the model's modules without that one computes it.

The worker computes in float32 (EMBEDFLEET_DTYPE), so /info's model_dtype is known and the
parity bar is float32's."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import numpy as np
import openai
import pytest

from embedfleet.producer.tokens import ModelTokenizer
from embedfleet.shared.model_path import resolve_model_path
from embedfleet.shared.settings import Settings
from tests.conftest import WorkerProcess
from tests.gateway_support import (
    gateway_worker,
    min_cosine,
    module_fleet_settings,
    module_gateway,
    module_gateway_url,
)

# the slow tier (make test-full, CI): starts a worker process and gateways
pytestmark = pytest.mark.slow

MODEL = "all-MiniLM-L6-v2"
fleet_settings = module_fleet_settings("gd")  # no API keys: the SDK's client needs none


@pytest.fixture(scope="module")
def worker(
    fleet_settings: Settings, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[WorkerProcess]:
    """The module's worker, computing in float32 (not ``auto``'s bf16 where the CPU has it)."""
    yield from gateway_worker(fleet_settings, tmp_path_factory, "gd", EMBEDFLEET_DTYPE="float32")


gateway = module_gateway()  # ``with gateway(**settings) as client``: another gateway


url = module_gateway_url("url")  # a gateway with the defaults


@pytest.fixture(scope="module")
def tokenizer() -> ModelTokenizer:
    return ModelTokenizer(resolve_model_path(MODEL))


@pytest.fixture(scope="module")
def reference():
    """sentence-transformers on the same model directory (it cuts at the model's 256 tokens)."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(resolve_model_path(MODEL)), device="cpu")
    return lambda texts: model.encode(list(texts), normalize_embeddings=False)


def long_text(tokenizer: ModelTokenizer) -> str:
    """2,562 tokens with the special tokens: ten times the model's 256."""
    text = " ".join(["word", "text"] * 1280)
    assert len(tokenizer.tokenizer.encode(text).ids) == 2562
    return text


def test_tei_routes_cut_an_over_long_text_by_default_and_info_says_so(
    url: str, tokenizer: ModelTokenizer, reference, hub_online: None
) -> None:
    from huggingface_hub import InferenceClient
    from huggingface_hub.errors import HfHubHTTPError

    text = long_text(tokenizer)
    info = httpx.get(f"{url}/info").json()
    assert info["auto_truncate"] is True and info["max_input_length"] == 256
    assert info["model_dtype"] == "float32"  # what the worker computes in (EMBEDFLEET_DTYPE)
    assert info["prompts"] == {"query": "", "document": ""}
    embedded = httpx.post(f"{url}/embed", json={"inputs": text})
    assert embedded.status_code == 200, embedded.text
    assert min_cosine(np.array(embedded.json()), reference([text])) >= 0.999
    tei = InferenceClient(base_url=url)
    vector = tei.feature_extraction(text)  # the client sends no truncate: the server's default
    assert min_cosine(vector.reshape(1, -1), reference([text])) >= 0.999
    # the request's own truncate=false still refuses it, as in TEI
    with pytest.raises(HfHubHTTPError) as refused:
        tei.feature_extraction(text, truncate=False)
    assert refused.value.response.status_code == 422
    assert refused.value.response.json()["error_type"] == "Validation"


def test_v1_refuses_an_over_long_input_by_default_and_cuts_it_with_the_setting(
    url: str, gateway, tokenizer: ModelTokenizer, reference
) -> None:
    text = long_text(tokenizer)
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.BadRequestError) as refused:
        client.embeddings.create(model=MODEL, input=text)
    assert refused.value.response.json()["error"]["code"] == "context_length_exceeded"
    with gateway(gateway_openai_truncate=True) as cutting:
        cut = cutting.embeddings.create(model=MODEL, input=text)
        assert min_cosine(np.array([cut.data[0].embedding]), reference([text])) >= 0.999
        assert cut.usage.prompt_tokens == 256  # what the model read
        # and a request's own truncate=false refuses it there
        with pytest.raises(openai.BadRequestError):
            cutting.embeddings.create(model=MODEL, input=text, extra_body={"truncate": False})
    with gateway(gateway_auto_truncate=False) as strict:
        info = httpx.get(str(strict.base_url).removesuffix("/v1/") + "/info").json()
        assert info["auto_truncate"] is False
        refused_tei = httpx.post(
            str(strict.base_url).removesuffix("/v1/") + "/embed", json={"inputs": text}
        )
        assert refused_tei.status_code == 422


def test_a_text_over_the_character_limit_is_cut_and_embedded_when_truncating(
    url: str, reference
) -> None:
    sentence = "The quick brown fox jumps over the lazy dog near the bank."  # 12 words
    text = " ".join([sentence] * 5000)  # 60,000 words
    assert len(text) > Settings().gateway_max_input_chars  # over 100,000 characters
    embedded = httpx.post(f"{url}/embed", json={"inputs": [text, "short"]}, timeout=120)
    assert embedded.status_code == 200, embedded.text
    assert min_cosine(np.array(embedded.json()), reference([text, "short"])) >= 0.999
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    cut = client.embeddings.create(model=MODEL, input=text, extra_body={"truncate": True})
    assert min_cosine(np.array([cut.data[0].embedding]), reference([text])) >= 0.999
    with pytest.raises(openai.BadRequestError) as refused:  # not truncating: refused
        client.embeddings.create(model=MODEL, input=text)
    assert "EMBEDFLEET_GATEWAY_MAX_INPUT_CHARS" in refused.value.response.json()["error"]["message"]


def test_each_dialects_documented_statuses(url: str, reference, hub_online: None) -> None:
    from huggingface_hub import InferenceClient
    from huggingface_hub.errors import HfHubHTTPError

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    # OpenAI: 2,049 inputs (one over its 2,048) is a 400, the SDK's BadRequestError
    with pytest.raises(openai.BadRequestError) as too_many:
        client.embeddings.create(model=MODEL, input=["x"] * 2049)
    assert too_many.value.response.json()["error"]["code"] == "too_many_inputs"
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model=MODEL, input="")
    # TEI: the empty string is 400 Empty, from the client and on the wire
    with pytest.raises(HfHubHTTPError) as empty:
        InferenceClient(base_url=url).feature_extraction("")
    assert empty.value.response.status_code == 400
    assert empty.value.response.json()["error_type"] == "Empty"
    # a body that is not JSON: TEI's 400
    broken = httpx.post(
        f"{url}/embed", content=b'{"inputs": "hi"', headers={"Content-Type": "application/json"}
    )
    assert broken.status_code == 400 and set(broken.json()) == {"error", "error_type"}
    # whitespace is text: embedded on both routes, as sentence-transformers embeds it
    blank = [" ", "\n\t "]
    tei = httpx.post(f"{url}/embed", json={"inputs": blank})
    assert tei.status_code == 200, tei.text
    assert min_cosine(np.array(tei.json()), reference(blank)) >= 0.999
    v1 = client.embeddings.create(model=MODEL, input=blank)
    assert min_cosine(np.array([d.embedding for d in v1.data]), reference(blank)) >= 0.999


def test_normalize_false_answers_the_pooled_vector_before_normalize(
    url: str, hub_online: None
) -> None:
    from huggingface_hub import InferenceClient
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.models import Normalize

    model = SentenceTransformer(str(resolve_model_path(MODEL)), device="cpu")
    assert isinstance(model[len(model) - 1], Normalize) and len(model) == 3
    before = SentenceTransformer(modules=[model[0], model[1]], device="cpu")
    # 4 texts ride the query stream, 40 the interactive one (bulk batches): both paths
    texts = [
        "How do I open a file in Python?",
        "The quick brown fox jumps over the lazy dog.",
        "Embeddings map text to vectors.",
        " ".join(["word", "text"] * 200),  # over the model's 256 tokens: cut, then pooled
    ]
    many = [f"{text} ({i})" for i in range(10) for text in texts]
    for batch in (texts, many):
        answer = httpx.post(f"{url}/embed", json={"inputs": batch, "normalize": False}, timeout=120)
        assert answer.status_code == 200, answer.text
        got = np.array(answer.json())
        expected = before.encode(batch)
        assert min_cosine(got, expected) >= 0.9999
        np.testing.assert_allclose(
            np.linalg.norm(got, axis=1), np.linalg.norm(expected, axis=1), rtol=2e-3
        )
        assert not np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-2)  # not normalised
        # normalize=true (TEI's default) is the model's whole pipeline, unit length
        unit = np.array(httpx.post(f"{url}/embed", json={"inputs": batch}, timeout=120).json())
        assert min_cosine(unit, model.encode(batch)) >= 0.9999
        np.testing.assert_allclose(np.linalg.norm(unit, axis=1), 1.0, atol=1e-3)
    # Matryoshka dimensions: the first values of that vector, not renormalised
    cut = httpx.post(f"{url}/embed", json={"inputs": texts, "normalize": False, "dimensions": 128})
    assert cut.status_code == 200, cut.text
    expected = before.encode(texts)[:, :128]
    assert min_cosine(np.array(cut.json()), expected) >= 0.9999
    np.testing.assert_allclose(
        np.linalg.norm(cut.json(), axis=1), np.linalg.norm(expected, axis=1), rtol=2e-3
    )
    one = InferenceClient(base_url=url).feature_extraction(texts[0], normalize=False)
    assert min_cosine(one.reshape(1, -1), before.encode(texts[:1])) >= 0.9999


def test_normalize_false_comes_back_in_float32_not_rounded_through_float16(url: str) -> None:
    """The vector before Normalize crosses the wire in float32 (its values are not bounded by 1,
    and fp16's rounding, 5e-4 relative, was all the answer's error): sentence-transformers' own
    values to float32's tolerance, on the query stream (4 inputs) and the interactive one (40).
    A unit vector (normalize=true) keeps the fp16 wire: within fp16's rounding, no closer."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(resolve_model_path(MODEL)), device="cpu")
    before = SentenceTransformer(modules=[model[0], model[1]], device="cpu")
    texts = [
        "How do I open a file in Python?",
        "The quick brown fox jumps over the lazy dog.",
        "Embeddings map text to vectors.",
        "Redis streams make a durable queue.",
    ]
    many = [f"{text} ({i})" for i in range(10) for text in texts]
    for batch in (texts, many):
        answer = httpx.post(f"{url}/embed", json={"inputs": batch, "normalize": False}, timeout=120)
        assert answer.status_code == 200, answer.text
        got = np.array(answer.json(), dtype=np.float32)
        expected = before.encode(batch, normalize_embeddings=False)
        # fp16 on the wire put values 1e-4..1e-3 apart (relative): float32 is ~1e-6
        np.testing.assert_allclose(got, expected, rtol=2e-5, atol=2e-6)
    unit = np.array(httpx.post(f"{url}/embed", json={"inputs": texts}).json(), dtype=np.float32)
    reference = model.encode(texts)
    np.testing.assert_allclose(unit, reference, atol=2e-3)
    assert np.abs(unit - reference).max() > 1e-5  # the fp16 wire, as the docs promise


def test_token_ids_as_inputs_embed_as_their_text(
    url: str, tokenizer: ModelTokenizer, hub_online: None
) -> None:
    """TEI's ``inputs`` take token ids (one sequence or a batch), the model's own tokenizer's:
    each embeds as the text they stand for (cosine 1.0000). An id outside the vocabulary is
    TEI's 422 ``Validation``, in its error shape."""
    texts = ["How do I open a file in Python?", "Redis streams make a durable queue."]
    ids = [tokenizer.tokenizer.encode(text).ids for text in texts]  # [CLS] ... [SEP], as TEI's
    of_texts = np.array(httpx.post(f"{url}/embed", json={"inputs": texts}).json())
    batch = httpx.post(f"{url}/embed", json={"inputs": ids})
    one = httpx.post(f"{url}/embed", json={"inputs": ids[0]})
    assert batch.status_code == 200 and one.status_code == 200, batch.text + one.text
    assert round(min_cosine(np.array(batch.json()), of_texts), 4) == 1.0
    assert round(min_cosine(np.array(one.json()), of_texts[:1]), 4) == 1.0
    for bad in ([101, 10**9, 102], [[101, 2023, 102], [-1]]):
        refused = httpx.post(f"{url}/embed", json={"inputs": bad})
        assert refused.status_code == 422, refused.text
        assert refused.json()["error_type"] == "Validation", refused.text
        assert "vocabulary" in refused.json()["error"]
