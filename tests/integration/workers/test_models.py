"""Several models in one namespace (issue 30): the registry of models and its one routing rule,
and two different models served by two worker sets on one Redis, each at parity with
sentence-transformers through the client, the gateway (the openai SDK, TEI's /embed) and the CLI.

The two models: the packaged all-MiniLM-L6-v2 (the namespace's default) and a tiny random-weight
BERT saved as a sentence-transformers directory (tests/model_zoo.py), served on the lane
``tiny``. Real workers (in this process, so the test waits on their events), a real Redis
server, the real gateway app.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import numpy as np
import openai
import pytest

from embedfleet.producer import Producer
from embedfleet.producer.client import EmbeddingOptions
from embedfleet.server import ServerProcess, isolated_settings
from embedfleet.shared.keys import Keys
from embedfleet.shared.model_registry import (
    UnknownModelError,
    read_registry,
    read_tokenizer_json,
    registered_lanes,
    route_model,
)
from embedfleet.shared.modelcard import read_card
from embedfleet.shared.redis_conn import connect
from embedfleet.shared.settings import PACKAGED_MODEL
from tests import model_zoo
from tests.conftest import WorkerLauncher, cli_env, reference_model, shared_encoder, start_cli
from tests.gateway_support import TEXTS, min_cosine, running_gateway

LANE = "tiny"


# --- the routing rule (pure) ----------------------------------------------------------------
def test_route_model_goes_to_the_registered_lane_the_default_or_refuses() -> None:
    keys = Keys(namespace="ns", partitions=2)
    registry = {
        PACKAGED_MODEL: keys.model,  # the default lane's worker registers its served name
        "code": keys.for_model("code").model,
        "bad:name": "ns:m:bad:name:model",  # written by hand: not a lane, ignored
        "forged": "ns:m:other:model",  # a card key that is not the name's: ignored
    }
    own = {PACKAGED_MODEL, f"sentence-transformers/{PACKAGED_MODEL}"}
    assert route_model(keys, None, registry, own) == keys
    assert route_model(keys, "code", registry, own) == keys.for_model("code")
    assert route_model(keys, "code", registry, own).partition(1).ingest.startswith("ns:m:code:{")
    assert route_model(keys, PACKAGED_MODEL, registry, own) == keys
    assert route_model(keys, f"sentence-transformers/{PACKAGED_MODEL}", {}, own) == keys
    assert route_model(keys, "sentence-transformers/code", registry, own).model_lane == "code"
    with pytest.raises(UnknownModelError, match=r"'gpt-4'.*served: 'all-MiniLM-L6-v2', 'code'"):
        route_model(keys, "gpt-4", registry, own)
    assert [lane.name for lane in registered_lanes(keys, registry)] == [PACKAGED_MODEL, "code"]
    # a lane's own producer: its lane's name routes to its keys before any worker registered
    lane_keys = keys.for_model("code")
    assert route_model(lane_keys, "code", {}, {"code"}) == lane_keys
    assert route_model(lane_keys, PACKAGED_MODEL, registry, {"code"}) == keys


# --- two models, two worker sets, one namespace ---------------------------------------------
@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return model_zoo.sentence_transformers_dir("bert", tmp_path_factory.mktemp("zoo"))


async def test_two_models_in_one_namespace_each_at_parity(
    redis_server: ServerProcess, workers: WorkerLauncher, tiny_dir: Path, tmp_path: Path
) -> None:
    from sentence_transformers import SentenceTransformer

    from embedfleet.workers.model.encoder import Encoder

    default = isolated_settings(
        redis_server.url, frozen_queries=False, files_dir=str(tmp_path / "files")
    )
    lane = default.model_copy(
        update={"model_lane": LANE, "model": str(tiny_dir), "consumer": f"{default.consumer}-t"}
    )
    tiny_reference = SentenceTransformer(str(tiny_dir), device="cpu")
    references = {
        PACKAGED_MODEL: lambda texts: reference_model().encode(list(texts)),
        LANE: lambda texts: tiny_reference.encode(list(texts)),
    }
    corpus = {
        name: [
            {"id": f"{name}-{i}", "text": f"{TEXTS[i % 4]} ({name} chunk {i})"} for i in range(30)
        ]
        for name in references
    }
    tiny_encoder = Encoder(str(tiny_dir), device="cpu", name=LANE)
    client = connect(default.effective_redis_url)
    try:
        async with (
            workers.run(default, encoder=shared_encoder()),
            workers.run(lane, encoder=tiny_encoder),
        ):
            # each worker set registered its model, with its card and tokenizer, on its lane
            registry = await read_registry(client, default.keys)
            assert registry == {
                PACKAGED_MODEL: default.keys.model,
                LANE: default.keys.for_model(LANE).model,
            }
            lane_card = await read_card(client, lane.keys)
            default_card = await read_card(client, default.keys)
            assert lane_card is not None and default_card is not None
            assert (lane_card.name, lane_card.dim) == (LANE, tiny_encoder.dim)
            assert (default_card.name, default_card.dim) == (PACKAGED_MODEL, 384)
            assert lane_card.dim != default_card.dim  # two different models, truly
            # the lane's tokenizer as its workers use it (their cut, issue 53), of the
            # directory's vocabulary
            published = await read_tokenizer_json(client, lane.keys)
            assert published == tiny_encoder.text.published
            own = json.loads((tiny_dir / "tokenizer.json").read_text())
            assert json.loads(published or "{}")["model"]["vocab"] == own["model"]["vocab"]

            # --- the client: bulk chunks and queries, each routed by model
            async with Producer(default, client) as producer:
                for name, chunks in corpus.items():
                    model = None if name == PACKAGED_MODEL else name
                    assert await producer.enqueue(chunks, job=f"job-{name}", model=model) == 30
                for name in corpus:
                    model = None if name == PACKAGED_MODEL else name
                    done = await producer.wait_for_job(f"job-{name}", timeout=120, model=model)
                    assert (done.done, done.dead) == (30, 0)
                for name, chunks in corpus.items():
                    lane_producer = await producer.for_model(name)
                    results = {r.id: r async for r in lane_producer.results(job=f"job-{name}")}
                    assert {r.model for r in results.values()} == {name}
                    got = np.array([results[c["id"]].vector for c in chunks], dtype=np.float32)
                    expected = references[name]([c["text"] for c in chunks])
                    assert got.shape == expected.shape and min_cosine(got, expected) >= 0.999
                    queries = await producer.embed_queries(TEXTS, model=name, timeout=60)
                    assert min_cosine(queries, references[name](TEXTS)) >= 0.999
                # a whole Producer for the lane, named at construction
                async with Producer(default, client, model=LANE) as only_tiny:
                    assert only_tiny.keys == default.keys.for_model(LANE)
                    texts = await only_tiny.embed_texts(TEXTS, timeout=60)
                    assert min_cosine(texts, references[LANE](TEXTS)) >= 0.999
                with pytest.raises(UnknownModelError, match="'nope' is not served"):
                    await producer.enqueue(corpus[LANE], job="lost", model="nope")
                with pytest.raises(UnknownModelError):
                    await producer.embed_query("x", model="nope", options=EmbeddingOptions())
                assert not await client.exists(default.keys.job("lost"))

            # --- the gateway: /v1/models lists both, requests route by model, both dialects
            with running_gateway(default) as url:
                sdk = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0)
                listed = {m.id: m for m in (await sdk.models.list()).data}
                assert set(listed) == {PACKAGED_MODEL, LANE}
                assert listed[LANE].dimensions == tiny_encoder.dim  # type: ignore[attr-defined]
                assert (await sdk.models.retrieve(LANE)).id == LANE
                for name, reference in references.items():
                    response = await sdk.embeddings.create(model=name, input=TEXTS)
                    got = np.array([item.embedding for item in response.data])
                    assert response.model == name
                    assert response.usage.prompt_tokens > 0
                    assert min_cosine(got, reference(TEXTS)) >= 0.999
                with pytest.raises(openai.NotFoundError) as refused:
                    await sdk.embeddings.create(model="text-embedding-3-small", input=TEXTS)
                error = refused.value.response.json()["error"]
                assert (error["code"], error["param"]) == ("model_not_found", "model")
                assert LANE in error["message"] and PACKAGED_MODEL in error["message"]
                async with httpx.AsyncClient(base_url=url, timeout=60) as http:
                    tei = await http.post("/embed", json={"inputs": TEXTS[:2], "model": LANE})
                    assert tei.status_code == 200, tei.text
                    got = np.array(tei.json())
                    assert min_cosine(got, references[LANE](TEXTS[:2])) >= 0.999
                    unknown = await http.post("/embed", json={"inputs": "x", "model": "nope"})
                    assert unknown.status_code == 404
                    assert unknown.json()["error_type"] == "Validation"
                    info = (await http.get("/info", params={"model": LANE})).json()
                    assert (info["model_id"], info["max_input_length"]) == (LANE, 48)
                    assert (await http.get("/health", params={"model": LANE})).status_code == 200
                    ready = (await http.get("/readyz")).json()
                    assert ready["models"] == {PACKAGED_MODEL: 1, LANE: 1}

            # --- the CLI: status by model, a query and an enqueue naming one
            env = cli_env(default)
            status = await _cli(env, "status", "--json", "--sample", "0")
            rows = {row["model"]: row for row in json.loads(status)["models"]}
            assert set(rows) == {PACKAGED_MODEL, LANE}
            assert rows[LANE]["ingest_key"] == lane.keys.ingest and not rows[LANE]["default"]
            assert rows[PACKAGED_MODEL]["default"]
            assert [j["job"] for j in rows[LANE]["jobs"]] == [f"job-{LANE}"]
            assert rows[LANE]["jobs"][0]["done"] == 30 and rows[LANE]["backlog"] == 0
            query = json.loads(await _cli(env, "query", TEXTS[0], "--model", LANE, "--json"))
            assert query["model"] == LANE and query["dim"] == tiny_encoder.dim
            vector = np.array(query["vector"], dtype=np.float32)
            assert min_cosine(vector, references[LANE](TEXTS[:1])) >= 0.999
            process = await start_cli(env, "enqueue", "-", "--model", "nope", stdin=-1)
            _, stderr = await process.communicate(b'{"id": "a", "text": "b"}\n')
            assert process.returncode == 1 and b"'nope' is not served" in stderr
    finally:
        await client.aclose()


async def _cli(env: dict[str, str], *args: str) -> str:
    process = await start_cli(env, *args)
    stdout, stderr = await asyncio.wait_for(process.communicate(), timeout=120)
    assert process.returncode == 0, stderr.decode(errors="replace")
    return stdout.decode()
