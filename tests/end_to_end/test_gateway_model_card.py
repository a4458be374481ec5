"""The gateway describes and shapes vectors by the model card the workers publish, not by the
model's files: a model whose output dimension is not its hidden size (a Dense head) answers
through both dialects at parity with sentence-transformers, and a plain Hugging Face directory
is not normalised unless TEI's ``normalize`` asks.

Each test runs its own namespace (one model each), a real Redis, an in-process worker on the
test's event loop and the gateway in a thread; the clients are the async ones, so the worker
keeps running while a request waits.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from embedfleet.server import ServerProcess, isolated_settings
from embedfleet.shared.model_path import resolve_model_path
from embedfleet.shared.modelcard import read_card
from embedfleet.shared.redis_conn import connect
from embedfleet.shared.settings import Settings
from tests import gateway_support, model_zoo
from tests.conftest import WorkerLauncher
from tests.gateway_support import min_cosine, running_gateway

# the slow tier (make test-full, CI): starts processes or servers, or compiles a model
pytestmark = pytest.mark.slow

TEXTS = [
    *gateway_support.TEXTS,
    "A generator yields values one at a time.",
    "Dictionaries map keys to values.",
]
DENSE_DIM = 128  # MiniLM's hidden size is 384


@pytest.fixture(scope="module")
def dense_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The packaged MiniLM with a Dense head (384 -> 128) before its Normalize, saved by
    sentence-transformers itself: nothing from a hub."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.base.modules import Dense, Normalize

    minilm = SentenceTransformer(str(resolve_model_path("all-MiniLM-L6-v2")), device="cpu")
    transformer, pooling = minilm[0], minilm[1]
    torch.manual_seed(11)
    head = Dense(384, DENSE_DIM, activation_function=torch.nn.Tanh())
    model = SentenceTransformer(modules=[transformer, pooling, head, Normalize()], device="cpu")
    target = tmp_path_factory.mktemp("models") / "minilm-dense128"
    model.save(str(target))
    return target


def _settings(redis_server: ServerProcess, model_dir: Path, files: Path) -> Settings:
    return isolated_settings(
        redis_server.url,
        f"card{uuid.uuid4().hex[:8]}",
        model=str(model_dir),
        files_dir=str(files),
        gateway_lane_max_inputs=4,  # TEXTS (6) go through the ingest stream, fewer the lane
        frozen_queries=False,  # eager is enough here; the frozen graph is slow on a small CPU
        cpu_int8=False,
    )


@pytest.fixture
def launcher(tmp_path: Path, redis_server: ServerProcess) -> Iterator[WorkerLauncher]:
    launcher = WorkerLauncher(isolated_settings(redis_server.url), lambda: None, tmp_path)
    yield launcher
    launcher.stop_all()


async def test_a_dense_head_through_both_dialects(
    redis_server: ServerProcess, dense_model_dir: Path, launcher: WorkerLauncher, tmp_path: Path
) -> None:
    from sentence_transformers import SentenceTransformer

    from embedfleet.workers.model.encoder import Encoder

    settings = _settings(redis_server, dense_model_dir, tmp_path / "files")
    reference = SentenceTransformer(str(dense_model_dir), device="cpu")
    expected = reference.encode(TEXTS)
    assert expected.shape == (len(TEXTS), DENSE_DIM)
    name = dense_model_dir.name
    with running_gateway(settings) as url:
        async with httpx.AsyncClient(base_url=url, timeout=120) as http:
            # no worker has ever started here: /v1/models answers from the settings alone,
            # /info says what it waits for
            before = (await http.get("/v1/models")).json()["data"][0]
            assert before["id"] == name and "dimensions" not in before
            info = await http.get("/info")
            assert info.status_code == 503 and info.headers["retry-after"]
            assert "HGETALL" in info.json()["error"]

            encoder = Encoder(str(dense_model_dir), device="cpu")
            async with launcher.run(settings, encoder=encoder):
                card = await _published(settings)
                await _live(http)
                assert (card.dim, card.hidden_size, card.normalize) == (DENSE_DIM, 384, True)

                models = (await http.get("/v1/models")).json()["data"][0]
                assert models["dimensions"] == DENSE_DIM and models["max_input_tokens"] == 256
                info = (await http.get("/info")).json()
                assert info["max_input_length"] == 256 and info["model_id"] == name

                client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
                # the query stream (up to 4 inputs) and the ingest stream (more)
                for texts in (TEXTS[:2], TEXTS):
                    response = await client.embeddings.create(model=name, input=texts)
                    got = np.array([item.embedding for item in response.data])
                    assert got.shape == (len(texts), DENSE_DIM)
                    assert min_cosine(got, expected[: len(texts)]) >= 0.999
                    assert response.usage.prompt_tokens > len(texts)
                # Matryoshka on the Dense output: the first 32, renormalised
                cut = await client.embeddings.create(model=name, input=TEXTS[:2], dimensions=32)
                short = np.array([item.embedding for item in cut.data])
                assert short.shape == (2, 32)
                assert np.allclose(np.linalg.norm(short, axis=1), 1.0, atol=1e-5)
                assert min_cosine(short, expected[:2, :32]) >= 0.999
                with pytest.raises(openai.BadRequestError) as too_many:
                    await client.embeddings.create(model=name, input="hi", dimensions=384)
                assert too_many.value.response.json()["error"]["param"] == "dimensions"

                for texts in (TEXTS[:1], TEXTS):
                    tei = await http.post("/embed", json={"inputs": texts})
                    assert tei.status_code == 200, tei.text
                    got = np.array(tei.json())
                    assert got.shape == (len(texts), DENSE_DIM)
                    assert min_cosine(got, expected[: len(texts)]) >= 0.999
                # normalize=false: the vector before the model's Normalize (TEI's answer, issue
                # 42), here the Dense head's output as it is, not refused
                raw = await http.post("/embed", json={"inputs": TEXTS[:2], "normalize": False})
                assert raw.status_code == 200, raw.text
                unnormalised = np.array(raw.json())
                assert unnormalised.shape == (2, DENSE_DIM)
                assert type(reference[-1]).__name__ == "Normalize"
                before = SentenceTransformer(modules=list(reference)[:-1], device="cpu")
                wanted = before.encode(TEXTS[:2])
                assert min_cosine(unnormalised, wanted) >= 0.999
                assert np.allclose(
                    np.linalg.norm(unnormalised, axis=1), np.linalg.norm(wanted, axis=1), rtol=1e-2
                )


async def test_a_plain_hf_directory_is_not_normalised_unless_asked(
    redis_server: ServerProcess, launcher: WorkerLauncher, tmp_path: Path
) -> None:
    from sentence_transformers import SentenceTransformer

    from embedfleet.workers.model.encoder import Encoder

    plain_dir = model_zoo.hf_model_dir("bert", tmp_path)
    assert not (plain_dir / "modules.json").exists()
    settings = _settings(redis_server, plain_dir, tmp_path / "files")
    # sentence-transformers on a plain directory: mean pooling, no Normalize module
    raw = SentenceTransformer(str(plain_dir), device="cpu").encode(TEXTS[:3])
    assert not np.allclose(np.linalg.norm(raw, axis=1), 1.0, atol=1e-3)
    with running_gateway(settings) as url:
        async with launcher.run(settings, encoder=Encoder(str(plain_dir), device="cpu")):
            card = await _published(settings)
            assert not card.normalize and card.dim == card.hidden_size
            async with httpx.AsyncClient(base_url=url, timeout=120) as http:
                await _live(http)
                as_is = await http.post("/embed", json={"inputs": TEXTS[:3], "normalize": False})
                assert as_is.status_code == 200, as_is.text
                got = np.array(as_is.json())
                # the vectors as sentence-transformers gives them, lengths and all
                assert min_cosine(got, raw) >= 0.999
                assert np.allclose(
                    np.linalg.norm(got, axis=1), np.linalg.norm(raw, axis=1), rtol=2e-3
                )
                # TEI's default normalize=true: normalised once, here
                unit = np.array((await http.post("/embed", json={"inputs": TEXTS[:3]})).json())
                assert np.allclose(np.linalg.norm(unit, axis=1), 1.0, atol=1e-5)
                assert min_cosine(unit, raw) >= 0.999
                # OpenAI's dialect answers what the model gives: not normalised either
                client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
                response = await client.embeddings.create(model=plain_dir.name, input=TEXTS[:3])
                openai_got = np.array([item.embedding for item in response.data])
                assert np.allclose(openai_got, got, rtol=1e-3, atol=1e-4)


async def test_concatenated_pooling_is_answered_whole(
    redis_server: ServerProcess, launcher: WorkerLauncher, tmp_path: Path
) -> None:
    """mean + cls pooling: twice the hidden size, all of it in both dialects (the gateway once
    asked for the hidden size and cut the rest off)."""
    from sentence_transformers import SentenceTransformer

    from embedfleet.workers.model.encoder import Encoder

    model_dir = model_zoo.sentence_transformers_dir("bert", tmp_path, pooling=("mean", "cls"))
    settings = _settings(redis_server, model_dir, tmp_path / "files")
    reference = SentenceTransformer(str(model_dir), device="cpu")
    expected = reference.encode(TEXTS)
    with running_gateway(settings) as url:
        async with launcher.run(settings, encoder=Encoder(str(model_dir), device="cpu")):
            card = await _published(settings)
            assert card.dim == 2 * card.hidden_size == expected.shape[1]
            async with httpx.AsyncClient(base_url=url, timeout=120) as http:
                await _live(http)
                client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
                response = await client.embeddings.create(model=model_dir.name, input=TEXTS)
                got = np.array([item.embedding for item in response.data])
                assert got.shape == expected.shape and min_cosine(got, expected) >= 0.999
                tei = np.array((await http.post("/embed", json={"inputs": TEXTS[:2]})).json())
                assert tei.shape == (2, card.dim) and min_cosine(tei, expected[:2]) >= 0.999


async def _published(settings: Settings):
    """The card the worker wrote at start (it writes before it reads anything)."""
    client = connect(settings.effective_redis_url)
    try:
        async with asyncio.timeout(60):
            while (card := await read_card(client, settings.keys)) is None:
                await asyncio.sleep(0.05)  # polling the server's own state, not waiting blind
        return card
    finally:
        await client.aclose()


async def _live(http: httpx.AsyncClient) -> None:
    """Until TEI's /health says the gateway sees the worker's heartbeat."""
    async with asyncio.timeout(60):
        while (await http.get("/health")).status_code != 200:
            await asyncio.sleep(0.05)  # polling the gateway's own state, not waiting blind
