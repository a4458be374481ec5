"""Images through the gateway's doors (issue 56): base64 data URIs to /v1/embeddings (the
`openai` SDK), TEI's /embed and Infinity's /embeddings_image (httpx) on a CLIP lane come back as
``CLIPModel.get_image_features`` after its own image processor, and the texts beside them as
``get_text_features`` (cosine >= 0.9999, float32); each bad image answers a 4xx in each dialect:
a malformed data URI or one over EMBEDFLEET_MAX_IMAGE_BYTES before anything reaches the queue,
an undecodable, truncated or bomb image as the worker's dead letter; a text-only lane refuses a
data URI with the options verifier's words, and nothing is ever fetched from a URL. Batch API
lines take data URIs too (the `openai` SDK's files and batches).

One worker process (the tiny random-weight CLIP model of tests/image_models.py) and one gateway
for the module, on a real Redis; the text-only lane is a namespace whose card says so (no
worker: it refuses before the fleet)."""

from __future__ import annotations

import asyncio
import base64
import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest
import redis.asyncio as aioredis

from embedfleet.server import ServerProcess, isolated_settings
from embedfleet.shared.dead_letters import DeadLetter, DeadReason
from embedfleet.shared.modelcard import ModelCard, publish_card
from embedfleet.shared.settings import Settings
from tests.conftest import WorkerProcess
from tests.gateway_support import gateway_worker, module_gateway_url, running_gateway
from tests.image_models import (
    dual_model_dir,
    image_bytes,
    min_cosine,
    reference_image_features,
    reference_text_features,
)
from tests.integration.gateway.batch.test_api import create_batch, jsonl, upload, wait_final
from tests.unit.workers.test_images import png_claiming

# the slow tier (make test-full, CI): starts a worker process and a gateway
pytestmark = pytest.mark.slow

MAX_IMAGE_BYTES = 64 * 1024  # small enough for a test image to pass it
TEXTS = ["a red bicycle", "a photo of a cat"]
FORMATS = {"png": "PNG", "jpeg": "JPEG", "webp": "WEBP", "gif": "GIF"}
IMAGES = {
    subtype: image_bytes(n, (30 + 7 * n, 50 - 5 * n), fmt)
    for n, (subtype, fmt) in enumerate(FORMATS.items())
}


def data_uri(data: bytes, subtype: str = "png") -> str:
    return f"data:image/{subtype};base64,{base64.b64encode(data).decode()}"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return dual_model_dir("clip", tmp_path_factory.mktemp("gateway-images"))


@pytest.fixture(scope="module")
def fleet_settings(
    redis_server: ServerProcess, tmp_path_factory: pytest.TempPathFactory, model_dir: Path
) -> Settings:
    return isolated_settings(
        redis_server.url,
        f"gi{uuid.uuid4().hex[:8]}",
        model=str(model_dir),
        files_dir=str(tmp_path_factory.mktemp("files")),
        block_ms=200,
        max_image_bytes=MAX_IMAGE_BYTES,
    )


@pytest.fixture(scope="module")
def worker(
    fleet_settings: Settings, tmp_path_factory: pytest.TempPathFactory, model_dir: Path
) -> Iterator[WorkerProcess]:
    yield from gateway_worker(
        fleet_settings,
        tmp_path_factory,
        "gi",
        EMBEDFLEET_MODEL=str(model_dir),
        EMBEDFLEET_DEVICE="cpu",
        EMBEDFLEET_DTYPE="float32",  # the parity bar is float32's
        EMBEDFLEET_CPU_INT8="false",
        EMBEDFLEET_FROZEN_BULK="false",
        EMBEDFLEET_MAX_IMAGE_BYTES=str(MAX_IMAGE_BYTES),
    )


gateway = module_gateway_url()


@pytest.fixture(scope="module")
def references(model_dir: Path) -> dict[str, np.ndarray]:
    """What transformers alone answers: each image's features by its subtype, each text's."""
    images = reference_image_features(model_dir, list(IMAGES.values()))
    texts = reference_text_features(model_dir, TEXTS)
    return {**dict(zip(IMAGES, images, strict=True)), **dict(zip(TEXTS, texts, strict=True))}


def expected(references: dict[str, np.ndarray], names: list[str]) -> np.ndarray:
    return np.stack([references[name] for name in names])


def test_openai_sdk_embeds_images_beside_texts(
    gateway: str, model_dir: Path, references: dict[str, np.ndarray]
) -> None:
    client = openai.OpenAI(base_url=f"{gateway}/v1", api_key="unused", max_retries=0)
    names = ["png", TEXTS[0], "jpeg", "webp", "gif", TEXTS[1]]
    inputs = [data_uri(IMAGES[n], n) if n in IMAGES else n for n in names]
    answer = client.embeddings.create(input=inputs, model=model_dir.name)
    got = np.array([item.embedding for item in answer.data], dtype=np.float32)
    assert [item.index for item in answer.data] == list(range(len(names)))
    assert min_cosine(got, expected(references, names)) >= 0.9999
    # the texts' tokens alone: an image counts none
    texts_alone = client.embeddings.create(input=TEXTS, model=model_dir.name)
    assert answer.usage.prompt_tokens == texts_alone.usage.prompt_tokens > 0
    # one image alone, base64-encoded floats (the SDK's default asks for them), with
    # Infinity's "modality": "image" (its client's extra_body: images alone)
    one = client.embeddings.create(
        input=data_uri(IMAGES["webp"], "webp"),
        model=model_dir.name,
        extra_body={"modality": "image"},
    )
    assert min_cosine(np.array([one.data[0].embedding]), references["webp"][None]) >= 0.9999


def test_tei_embed_and_infinity_embeddings_image(
    gateway: str, model_dir: Path, references: dict[str, np.ndarray]
) -> None:
    with httpx.Client(base_url=gateway, timeout=120) as http:
        names = [TEXTS[1], "gif", "png"]
        inputs = [data_uri(IMAGES[n], n) if n in IMAGES else n for n in names]
        tei = http.post("/embed", json={"inputs": inputs})
        assert tei.status_code == 200, tei.text
        assert min_cosine(np.array(tei.json()), expected(references, names)) >= 0.9999
        single = http.post("/embed", json={"inputs": data_uri(IMAGES["jpeg"], "jpeg")})
        assert single.status_code == 200, single.text
        assert min_cosine(np.array(single.json()), references["jpeg"][None]) >= 0.9999

        names = ["jpeg", "png", "webp"]
        body = {"model": model_dir.name, "input": [data_uri(IMAGES[n], n) for n in names]}
        infinity = http.post("/embeddings_image", json=body)
        assert infinity.status_code == 200, infinity.text
        answer = infinity.json()
        assert answer["model"] == model_dir.name and answer["object"] == "list"
        got = np.array([item["embedding"] for item in answer["data"]])
        assert min_cosine(got, expected(references, names)) >= 0.9999


async def entries_added(settings: Settings) -> int:
    """Every entry ever added to the request streams (query and interactive) of ``settings``."""
    client = aioredis.from_url(settings.effective_redis_url)
    try:
        streams = settings.keys.priority_streams
        total = 0
        for key in (streams.query, streams.interactive):
            if await client.exists(key):
                total += int((await client.xinfo_stream(key))["entries-added"])
        return total
    finally:
        await client.aclose()


# (route, the body of one input, the status OpenAI's dialect answers, TEI's)
DOORS = [
    ("/v1/embeddings", lambda uri: {"input": [uri, "a red bicycle"]}, 400),
    ("/embed", lambda uri: {"inputs": ["a red bicycle", uri]}, 422),
    ("/embeddings_image", lambda uri: {"input": uri}, 400),
]


def error_of(answer: httpx.Response, status: int) -> tuple[str, str | None]:
    """The message and code of an error answer in either dialect, after its status."""
    assert answer.status_code == status, answer.text
    body = answer.json()
    if isinstance(body["error"], dict):  # OpenAI's envelope
        return body["error"]["message"], body["error"]["code"]
    return body["error"], body["error_type"]


def test_a_bad_data_uri_is_refused_in_each_dialect_before_the_queue(
    gateway: str, fleet_settings: Settings
) -> None:
    malformed = {
        "not base64": "data:image/png;base64,iVBORw0K!!!",
        "over the cap": data_uri(b"\x89PNG" + bytes(MAX_IMAGE_BYTES)),
        "another type": "data:image/tiff;base64,SUkqAA==",
    }
    before = asyncio.run(entries_added(fleet_settings))
    with httpx.Client(base_url=gateway, timeout=120) as http:
        for path, body, status in DOORS:
            for what, uri in malformed.items():
                message, _ = error_of(http.post(path, json=body(uri)), status)
                assert "EMBEDFLEET_MAX_IMAGE_BYTES" in message or what != "over the cap"
        # a text over the tiny model's 32 tokens beside an image: named by its place
        long = ["many words " * 40]
        v1 = http.post("/v1/embeddings", json={"input": [data_uri(IMAGES["png"]), *long]})
        assert "'input[1]' has more" in error_of(v1, 400)[0]
        tei = {"inputs": [data_uri(IMAGES["png"]), *long], "truncate": False}
        assert "(`inputs[1]`)" in error_of(http.post("/embed", json=tei), 422)[0]
        url = {"input": "https://example.com/cat.png"}
        message, code = error_of(http.post("/embeddings_image", json=url), 400)
        assert code == "url_not_accepted" and "only data URIs are accepted" in message
    assert asyncio.run(entries_added(fleet_settings)) == before  # nothing reached the queue


async def dead_reasons(settings: Settings) -> list[DeadReason]:
    """The reason of every dead letter of ``settings``' namespace, oldest first."""
    client = aioredis.from_url(settings.effective_redis_url)
    try:
        entries = await client.xrange(settings.keys.dead)
        return [DeadLetter.from_fields(at, fields).reason for at, fields in entries]
    finally:
        await client.aclose()


def test_an_image_the_worker_refuses_is_a_4xx_in_each_dialect(
    gateway: str, fleet_settings: Settings
) -> None:
    bad = {
        "undecodable": b"\x89PNG\r\n\x1a\nthis is no image at all",
        "truncated": image_bytes(7, (64, 64), "PNG")[:300],
        "a decompression bomb": png_claiming(30_000, 30_000),
    }
    before = len(asyncio.run(dead_reasons(fleet_settings)))
    with httpx.Client(base_url=gateway, timeout=120) as http:
        for path, body, status in DOORS:
            for what, data in bad.items():
                message, _ = error_of(http.post(path, json=body(data_uri(data))), status)
                assert "the worker rejected an input" in message, what
                words = "decompression bomb" if what == "a decompression bomb" else "decode"
                assert words in message, (what, message)
        # the lane goes on: a good image after them
        good = http.post("/embed", json={"inputs": data_uri(IMAGES["png"])})
        assert good.status_code == 200, good.text
    # each a dead letter with its reason (written with the reply the gateway answered from)
    reasons = asyncio.run(dead_reasons(fleet_settings))[before:]
    expected_reasons = [DeadReason.INVALID, DeadReason.INVALID, DeadReason.TOO_LARGE] * len(DOORS)
    assert sorted(reasons) == sorted(expected_reasons)


@pytest.fixture(scope="module")
def text_lane(
    redis_server: ServerProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[str]:
    """A gateway on a lane whose card says its model embeds text alone (no worker runs)."""
    settings = isolated_settings(
        redis_server.url,
        f"gt{uuid.uuid4().hex[:8]}",
        files_dir=str(tmp_path_factory.mktemp("text-files")),
    )
    card = ModelCard(name="all-MiniLM-L6-v2", dim=384, max_length=256, normalize=True)
    assert card.modalities == ("text",)

    async def publish() -> None:
        client = aioredis.from_url(settings.effective_redis_url)
        try:
            await publish_card(client, settings.keys, card)
        finally:
            await client.aclose()

    asyncio.run(publish())
    with running_gateway(settings) as url:
        yield url


def test_a_text_only_lane_refuses_a_data_uri(text_lane: str) -> None:
    with httpx.Client(base_url=text_lane, timeout=60) as http:
        for path, body, status in DOORS:
            message, _ = error_of(http.post(path, json=body(data_uri(IMAGES["png"]))), status)
            assert "this model embeds text only, not image input" in message, path


def test_a_batch_embeds_images_beside_texts(
    gateway: str, model_dir: Path, references: dict[str, np.ndarray], tmp_path: Path
) -> None:
    """Batch API lines with data URIs, through the openai SDK's files and batches: embedded as
    online; a malformed one refused on its own (400 in the error file, as online), an image
    the worker cannot decode answered as a dead letter, and the batch completes."""
    client = openai.OpenAI(base_url=f"{gateway}/v1", api_key="unused", max_retries=0)

    def line(custom_id: str, inputs: object) -> str:
        body = {"model": model_dir.name, "input": inputs}
        return json.dumps(
            {"custom_id": custom_id, "method": "POST", "url": "/v1/embeddings", "body": body}
        )

    mixed = ["png", TEXTS[0], "gif"]
    lines = [
        line("mixed", [data_uri(IMAGES[n], n) if n in IMAGES else n for n in mixed]),
        line("one", data_uri(IMAGES["webp"], "webp")),
        line("malformed", [TEXTS[1], "data:image/png;base64,iVBORw0K!!!"]),
        line("undecodable", data_uri(b"\x89PNG\r\n\x1a\nthis is no image at all")),
    ]
    batch = create_batch(client, upload(client, tmp_path / "images.jsonl", lines).id)
    batch = wait_final(client, batch.id)
    assert batch.status == "completed", batch
    output = {record["custom_id"]: record for record in jsonl(client, batch.output_file_id)}
    errors = {record["custom_id"]: record for record in jsonl(client, batch.error_file_id)}
    assert sorted(output) == ["mixed", "one"] and sorted(errors) == ["malformed", "undecodable"]
    got = np.array([item["embedding"] for item in output["mixed"]["response"]["body"]["data"]])
    assert min_cosine(got, expected(references, mixed)) >= 0.9999
    one = output["one"]["response"]["body"]["data"][0]["embedding"]
    assert min_cosine(np.array([one]), references["webp"][None]) >= 0.9999
    refused = errors["malformed"]["response"]
    assert refused["status_code"] == 400
    assert refused["body"]["error"]["code"] == "invalid_image"
    assert "'body.input[1]' is not valid base64" in refused["body"]["error"]["message"]
    dead = errors["undecodable"]["response"]
    assert dead["status_code"] == 400, "answered as the online endpoint answers a dead letter"
    assert dead["body"]["error"]["code"] == "input_rejected"
    assert "does not decode" in dead["body"]["error"]["message"]
