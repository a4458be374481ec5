"""TEI's gRPC API (tei.v1) on the gateway, called as TEI's users call it: a client generated from
TEI's published proto (the vendored copy's modules), over a real gateway, a real Redis and a real
worker. Each answer is the HTTP route's answer to the same question (the gRPC door calls it):
Info, Embed and EmbedStream, Tokenize and Decode (and their streams) on the packaged model in a
worker process; Rerank, RerankStream, Predict and PredictPair on a cross-encoder, EmbedSparse on
a SPLADE model (tiny random-weight models, tests/model_zoo.py, in-process workers). Refusals end
with TEI's codes: UNAUTHENTICATED without the key, INVALID_ARGUMENT for a bad request,
FAILED_PRECONDITION for what the served model does not give. EmbedAll answers the dense
model's token states."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import grpc
import httpx
import numpy as np
import pytest

from embedfleet.gateway.grpc_services import stub
from embedfleet.gateway.tei_grpc import tei_pb2 as pb
from embedfleet.server import ServerProcess, isolated_settings
from embedfleet.shared.settings import Settings
from embedfleet.workers.model.encoder import Encoder
from tests.conftest import WorkerLauncher
from tests.gateway_support import GATEWAY_KEY as KEY
from tests.gateway_support import GRPC_AUTH as AUTH
from tests.gateway_support import GrpcServed, grpc_gateway, min_cosine, module_grpc_fleet
from tests.model_zoo import cross_encoder_dir, splade_dir

# the slow tier (make test-full, CI): starts a worker process and gateways
pytestmark = pytest.mark.slow

TEXT = "What is Deep Learning?"

# float32, so EmbedAll's token states compare with sentence-transformers' to float32's
# tolerance (EMBEDFLEET_DTYPE=auto may keep bfloat16 on a CPU that runs it natively)
fleet_settings, worker, grpc_served = module_grpc_fleet("grpc", EMBEDFLEET_DTYPE="float32")


class Fleet:
    """A gateway's HTTP client and the gRPC stubs of TEI's services on the same gateway."""

    def __init__(self, http: httpx.Client, channel: grpc.Channel, target: str) -> None:
        self.http = http
        self.target = target  # host:port of the gRPC server
        services = pb.DESCRIPTOR.services_by_name
        self.info = stub(channel, services["Info"])
        self.embed = stub(channel, services["Embed"])
        self.tokenize = stub(channel, services["Tokenize"])
        self.rerank = stub(channel, services["Rerank"])
        self.predict = stub(channel, services["Predict"])


@contextlib.contextmanager
def tei_gateway(settings: Settings) -> Iterator[Fleet]:
    """A gateway for ``settings`` serving gRPC on a port of its own, and clients of both."""
    with grpc_gateway(settings) as (http, channel, target):
        yield Fleet(http, channel, target)


@pytest.fixture(scope="module")
def fleet(grpc_served: GrpcServed) -> Fleet:
    return Fleet(*grpc_served)


def test_info_is_the_http_info(fleet: Fleet) -> None:
    answer = fleet.info.Info(pb.InfoRequest(), metadata=AUTH)
    facts = fleet.http.get("/info").json()
    assert answer.model_id == facts["model_id"]
    assert answer.model_type == pb.MODEL_TYPE_EMBEDDING
    assert answer.max_input_length == facts["max_input_length"]
    assert answer.max_client_batch_size == facts["max_client_batch_size"]
    assert answer.max_batch_tokens == facts["max_batch_tokens"]
    assert answer.version == facts["version"]


def test_embed_is_the_http_embed(fleet: Fleet) -> None:
    answer = fleet.embed.Embed(pb.EmbedRequest(inputs=TEXT), metadata=AUTH)
    (over_http,) = fleet.http.post("/embed", json={"inputs": TEXT}).json()
    assert len(answer.embeddings) == len(over_http)
    assert min_cosine(np.array(answer.embeddings), np.array(over_http)) > 0.99995
    # normalize absent is true, as TEI reads the optional field
    assert np.linalg.norm(answer.embeddings) == pytest.approx(1.0, abs=1e-3)
    assert answer.metadata.compute_chars == len(TEXT)
    assert answer.metadata.compute_tokens > 0
    assert answer.metadata.total_time_ns >= answer.metadata.inference_time_ns > 0
    # TEI's options travel: a prompt-less Matryoshka cut, un-normalised
    cut = fleet.embed.Embed(
        pb.EmbedRequest(inputs=TEXT, dimensions=64, normalize=False), metadata=AUTH
    )
    (cut_http,) = fleet.http.post(
        "/embed", json={"inputs": TEXT, "dimensions": 64, "normalize": False}
    ).json()
    assert len(cut.embeddings) == 64
    np.testing.assert_allclose(cut.embeddings, cut_http, rtol=1e-6)


# a TEI user's own client: protoc's messages and service stubs of TEI's proto, generated apart
# from the package (which keeps only the messages and reads the services off their descriptors),
# run as a program of its own (the package's tei.v1 messages in this process would clash)
TEI_CLIENT = """
import json, sys
import grpc
import tei_pb2, tei_pb2_grpc
target, key, text = sys.argv[1:]
metadata = (("authorization", f"Bearer {key}"),)
with grpc.insecure_channel(target) as channel:
    info = tei_pb2_grpc.InfoStub(channel).Info(tei_pb2.InfoRequest(), metadata=metadata)
    embed = tei_pb2_grpc.EmbedStub(channel)
    answer = embed.Embed(tei_pb2.EmbedRequest(inputs=text), metadata=metadata)
    streamed = list(embed.EmbedStream(iter([tei_pb2.EmbedRequest(inputs=text)] * 2),
                                      metadata=metadata))
print(json.dumps({"model_id": info.model_id, "embedding": list(answer.embeddings),
                  "streamed": [list(s.embeddings) for s in streamed]}))
"""


def test_a_client_generated_from_teis_proto_embeds(fleet: Fleet, tmp_path: Path) -> None:
    proto = tmp_path / "tei.proto"
    proto.write_bytes((Path(pb.__file__).parent / "third_party" / "tei.proto").read_bytes())
    generated = subprocess.run(
        [
            sys.executable,
            "-m",
            "grpc_tools.protoc",
            f"-I{tmp_path}",
            f"--python_out={tmp_path}",
            f"--grpc_python_out={tmp_path}",
            str(proto),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert generated.returncode == 0, generated.stderr
    (tmp_path / "client.py").write_text(TEI_CLIENT)
    ran = subprocess.run(
        [sys.executable, "client.py", fleet.target, KEY, TEXT],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert ran.returncode == 0, ran.stderr
    answer = json.loads(ran.stdout)
    assert answer["model_id"] == fleet.http.get("/info").json()["model_id"]
    (over_http,) = fleet.http.post("/embed", json={"inputs": TEXT}).json()
    assert min_cosine(np.array(answer["embedding"]), np.array(over_http)) > 0.99995
    assert len(answer["streamed"]) == 2
    for streamed in answer["streamed"]:
        assert min_cosine(np.array(streamed), np.array(over_http)) > 0.99995


def test_embed_stream_answers_each_message_in_order(fleet: Fleet) -> None:
    texts = [f"stream message {i}: {'word ' * i}" for i in range(12)]
    answers = list(
        fleet.embed.EmbedStream(iter(pb.EmbedRequest(inputs=t) for t in texts), metadata=AUTH)
    )
    assert len(answers) == len(texts)
    over_http = fleet.http.post("/embed", json={"inputs": texts}).json()
    vectors = np.array([a.embeddings for a in answers])
    assert min_cosine(vectors, np.array(over_http)) > 0.99995
    assert [a.metadata.compute_chars for a in answers] == [len(t) for t in texts]


def test_tokenize_and_decode_are_the_http_routes(fleet: Fleet) -> None:
    tokens = fleet.tokenize.Tokenize(
        pb.EncodeRequest(inputs="Héllo wörld", add_special_tokens=True), metadata=AUTH
    ).tokens
    (over_http,) = fleet.http.post("/tokenize", json={"inputs": "Héllo wörld"}).json()
    assert [
        {
            "id": t.id,
            "text": t.text,
            "special": t.special,
            "start": t.start if t.HasField("start") else None,
            "stop": t.stop if t.HasField("stop") else None,
        }
        for t in tokens
    ] == over_http
    ids = [t.id for t in tokens]
    text = fleet.tokenize.Decode(
        pb.DecodeRequest(ids=ids, skip_special_tokens=True), metadata=AUTH
    ).text
    assert [text] == fleet.http.post("/decode", json={"ids": [ids]}).json()
    streamed = list(
        fleet.tokenize.TokenizeStream(
            iter([pb.EncodeRequest(inputs="a b"), pb.EncodeRequest(inputs="c")]), metadata=AUTH
        )
    )
    assert [[t.text for t in answer.tokens] for answer in streamed] == [["a", "b"], ["c"]]
    decoded = list(
        fleet.tokenize.DecodeStream(
            iter([pb.DecodeRequest(ids=ids, skip_special_tokens=True)] * 2), metadata=AUTH
        )
    )
    assert [d.text for d in decoded] == [text, text]


@pytest.mark.parametrize(
    "call",
    [
        lambda f, md: f.info.Info(pb.InfoRequest(), metadata=md),
        lambda f, md: f.embed.Embed(pb.EmbedRequest(inputs=TEXT), metadata=md),
        lambda f, md: list(f.embed.EmbedStream(iter([pb.EmbedRequest(inputs=TEXT)]), metadata=md)),
        lambda f, md: f.tokenize.Decode(pb.DecodeRequest(ids=[101]), metadata=md),
        lambda f, md: f.rerank.RerankStream(
            iter([pb.RerankStreamRequest(query="q", text="a")]), metadata=md
        ),
    ],
    ids=["Info", "Embed", "EmbedStream", "Decode", "RerankStream"],
)
@pytest.mark.parametrize(
    "metadata", [(), (("authorization", "Bearer wrong"),), (("authorization", KEY),)]
)
def test_a_call_without_the_key_is_unauthenticated(fleet: Fleet, call, metadata) -> None:
    with pytest.raises(grpc.RpcError) as refused:
        call(fleet, metadata)
    assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
    assert "API key" in refused.value.details()


def test_a_bad_request_is_invalid_argument(fleet: Fleet) -> None:
    too_long = "word " * 2000
    for request, says in [
        (pb.EmbedRequest(inputs=""), "is empty"),
        # proto3's truncate is false unless set: an input over the model's maximum is refused
        (pb.EmbedRequest(inputs=too_long), "token"),
        (pb.EmbedRequest(inputs=TEXT, dimensions=100_000), "dimensions"),
        (pb.EmbedRequest(inputs=TEXT, prompt_name="nope"), "nope"),
    ]:
        with pytest.raises(grpc.RpcError) as refused:
            fleet.embed.Embed(request, metadata=AUTH)
        assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT, request
        assert says in refused.value.details()
    cut = fleet.embed.Embed(pb.EmbedRequest(inputs=too_long, truncate=True), metadata=AUTH)
    assert len(cut.embeddings) == 384
    with pytest.raises(grpc.RpcError) as refused:
        fleet.tokenize.Decode(pb.DecodeRequest(ids=[10**9]), metadata=AUTH)
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    # a stream ends at its first refusal, with its code, after the answers before it
    answers = fleet.embed.EmbedStream(
        iter([pb.EmbedRequest(inputs=TEXT), pb.EmbedRequest(inputs="")]), metadata=AUTH
    )
    assert len(next(answers).embeddings) == 384
    with pytest.raises(grpc.RpcError) as refused:
        next(answers)
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT


def _metrics(fleet: Fleet) -> dict[str, float]:
    """/metrics' samples by their whole selector, as a dashboard's query reads them."""
    samples = {}
    for line in fleet.http.get("/metrics").text.splitlines():
        if line and not line.startswith("#"):
            selector, _, value = line.rpartition(" ")
            samples[selector] = float(value)
    return samples


def test_an_answered_call_moves_teis_series_and_the_fleets(fleet: Fleet) -> None:
    """An answered Embed is a TEI request (count, success, timings, inputs) and one gRPC call in
    the fleet's request series; a stream's messages record their timings and inputs, as TEI's
    do, but no request each (the stream is the fleet series' one call)."""
    before = _metrics(fleet)
    fleet.embed.Embed(pb.EmbedRequest(inputs=TEXT), metadata=AUTH)
    texts = [pb.EmbedRequest(inputs=text) for text in ("one", "two")]
    assert len(list(fleet.embed.EmbedStream(iter(texts), metadata=AUTH))) == 2
    after = _metrics(fleet)

    def moved(selector: str) -> float:
        return after.get(selector, 0.0) - before.get(selector, 0.0)

    assert moved('te_request_count{method="single"}') == 1
    assert moved('te_request_success{method="single"}') == 1
    for timing in ("duration", "tokenization_duration", "queue_duration", "inference_duration"):
        assert moved(f"te_request_{timing}_count") == 3, timing
    assert moved("te_embed_success") == 3
    assert moved("te_request_input_length_count") == 3
    assert moved("te_batch_next_size_count") == 3
    series = (
        'embedfleet_gateway_requests_total{method="gRPC",route="/tei.v1.Embed/%s",status="200"}'
    )
    assert moved(series % "Embed") == 1
    assert moved(series % "EmbedStream") == 1


# proto3 lets these through: an enum's any int32, a uint32's whole range
OUT_OF_RANGE = [
    (lambda f: f.embed.Embed(pb.EmbedRequest(inputs=TEXT, truncation_direction=99), metadata=AUTH)),
    (lambda f: f.embed.Embed(pb.EmbedRequest(inputs=TEXT, truncation_direction=-1), metadata=AUTH)),
    (lambda f: f.embed.Embed(pb.EmbedRequest(inputs=TEXT, dimensions=2**32 - 1), metadata=AUTH)),
    (lambda f: f.embed.Embed(pb.EmbedRequest(inputs=TEXT, dimensions=0), metadata=AUTH)),
    (
        lambda f: f.embed.EmbedAll(
            pb.EmbedAllRequest(inputs=TEXT, truncation_direction=2**31 - 1), metadata=AUTH
        )
    ),
    (
        lambda f: list(
            f.embed.EmbedStream(
                iter([pb.EmbedRequest(inputs=TEXT, truncation_direction=7)]), metadata=AUTH
            )
        )
    ),
    (lambda f: f.tokenize.Decode(pb.DecodeRequest(ids=[2**32 - 1]), metadata=AUTH)),
]


@pytest.mark.parametrize(
    "call",
    OUT_OF_RANGE,
    ids=["direction-99", "direction-neg", "dims-max", "dims-0", "all-dir", "stream-dir", "id-max"],
)
def test_an_out_of_range_number_is_invalid_argument(fleet: Fleet, call) -> None:
    """Issue 54 fault 5's numbers over gRPC: the caller's error, never INTERNAL or UNKNOWN."""
    with pytest.raises(grpc.RpcError) as refused:
        call(fleet)
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()


def test_embed_all_answers_the_token_states(fleet: Fleet) -> None:
    """EmbedAll on the dense MiniLM (FAILED_PRECONDITION before): one TokenEmbedding per token,
    [CLS] and [SEP] included, each the token's last hidden state before pooling, as
    sentence-transformers' ``output_value="token_embeddings"`` gives it in float32, and the HTTP
    /embed_all's answer; EmbedAllStream answers each message in order."""
    from sentence_transformers import SentenceTransformer

    from embedfleet.shared.model_path import resolve_model_path

    model = SentenceTransformer(str(resolve_model_path("all-MiniLM-L6-v2")), device="cpu")
    answer = fleet.embed.EmbedAll(pb.EmbedAllRequest(inputs=TEXT), metadata=AUTH)
    ours = np.array([token.embeddings for token in answer.token_embeddings], dtype=np.float32)
    theirs = model.encode([TEXT], output_value="token_embeddings")[0].numpy()
    assert ours.shape == theirs.shape and ours.shape[1] == 384
    assert min_cosine(ours, theirs) >= 0.9999
    np.testing.assert_allclose(ours, theirs, atol=1e-4, rtol=1e-4)
    (over_http,) = fleet.http.post("/embed_all", json={"inputs": TEXT}).json()
    np.testing.assert_allclose(ours, over_http, rtol=1e-6)
    assert answer.metadata.compute_tokens == ours.shape[0]
    texts = ["a b", TEXT]
    streamed = fleet.embed.EmbedAllStream(
        iter([pb.EmbedAllRequest(inputs=text) for text in texts]), metadata=AUTH
    )
    for text, each in zip(texts, streamed, strict=True):
        states = model.encode([text], output_value="token_embeddings")[0].numpy()
        rows = np.array([token.embeddings for token in each.token_embeddings], np.float32)
        np.testing.assert_allclose(rows, states, atol=1e-4, rtol=1e-4)


def test_what_the_model_does_not_give_is_a_failed_precondition(fleet: Fleet) -> None:
    """TEI's Backend type: a rerank, a prediction or sparse weights of an embedding model (the
    HTTP routes' 424)."""
    for call in [
        lambda: fleet.rerank.Rerank(pb.RerankRequest(query="q", texts=["a"]), metadata=AUTH),
        lambda: fleet.predict.Predict(pb.PredictRequest(inputs="a"), metadata=AUTH),
        lambda: fleet.embed.EmbedSparse(pb.EmbedSparseRequest(inputs="a"), metadata=AUTH),
    ]:
        with pytest.raises(grpc.RpcError) as refused:
            call()
        assert refused.value.code() is grpc.StatusCode.FAILED_PRECONDITION
        assert "dense" in refused.value.details()


# --- the other representations: tiny models in an in-process worker ---------------------------


@pytest.fixture(scope="module")
def zoo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("zoo-grpc")


@contextlib.asynccontextmanager
async def zoo_fleet(
    redis_server: ServerProcess, tmp_path: Path, model_dir: Path
) -> AsyncIterator[Fleet]:
    """A worker serving ``model_dir`` on this loop, and a gateway with gRPC for it (no keys)."""
    settings = isolated_settings(
        redis_server.url, model=str(model_dir), block_ms=100, files_dir=str(tmp_path / "files")
    )
    encoder = Encoder(str(model_dir), device="cpu")
    async with WorkerLauncher(settings, lambda: encoder, tmp_path).run(settings, encoder=encoder):
        with tei_gateway(settings) as started:
            yield started


async def test_rerank_and_predict_are_the_http_routes(
    redis_server: ServerProcess, tmp_path: Path, zoo: Path
) -> None:
    texts = ["try except finally", "a loop over a list", "exceptions are caught by try"]
    query = "How do I catch an exception?"
    async with zoo_fleet(redis_server, tmp_path, cross_encoder_dir(zoo)) as fleet:
        # the gRPC client blocks: off this loop, which runs the worker
        ranks = await asyncio.to_thread(
            fleet.rerank.Rerank, pb.RerankRequest(query=query, texts=texts, return_text=True)
        )
        streamed = await asyncio.to_thread(
            fleet.rerank.RerankStream,
            iter([pb.RerankStreamRequest(query=query, text=t) for t in texts]),
        )
        over_http = (
            await asyncio.to_thread(
                fleet.http.post, "/rerank", json={"query": query, "texts": texts}
            )
        ).json()
        predicted = await asyncio.to_thread(
            fleet.predict.PredictPair, pb.PredictPairRequest(inputs=[query, texts[0]])
        )
        alone = await asyncio.to_thread(fleet.predict.Predict, pb.PredictRequest(inputs=texts[1]))
        predicted_http = (
            await asyncio.to_thread(
                fleet.http.post, "/predict", json={"inputs": [[query, texts[0]], [texts[1]]]}
            )
        ).json()
        with pytest.raises(grpc.RpcError) as refused:
            await asyncio.to_thread(
                fleet.predict.PredictPair, pb.PredictPairRequest(inputs=["a", "b", "c"])
            )
    # the same pairs batched otherwise (one request, a stream, HTTP) agree to float32's noise
    assert [r.index for r in ranks.ranks] == [r["index"] for r in over_http]
    np.testing.assert_allclose(
        [r.score for r in ranks.ranks], [r["score"] for r in over_http], rtol=1e-4
    )
    assert [r.text for r in ranks.ranks] == [texts[r["index"]] for r in over_http]
    assert [r.index for r in streamed.ranks] == [r.index for r in ranks.ranks]
    np.testing.assert_allclose(
        [r.score for r in streamed.ranks], [r.score for r in ranks.ranks], rtol=1e-4
    )
    assert not any(r.HasField("text") for r in streamed.ranks)
    for answer, expected in zip([predicted, alone], predicted_http, strict=True):
        assert [p.label for p in answer.predictions] == [e["label"] for e in expected]
        np.testing.assert_allclose(
            [p.score for p in answer.predictions], [e["score"] for e in expected], rtol=1e-4
        )
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT


async def test_embed_sparse_is_the_http_route(
    redis_server: ServerProcess, tmp_path: Path, zoo: Path
) -> None:
    inputs = ["hi", "try except finally"]
    async with zoo_fleet(redis_server, tmp_path, splade_dir(zoo)) as fleet:
        answers = [
            await asyncio.to_thread(fleet.embed.EmbedSparse, pb.EmbedSparseRequest(inputs=text))
            for text in inputs
        ]
        streamed = await asyncio.to_thread(
            lambda: list(
                fleet.embed.EmbedSparseStream(iter(pb.EmbedSparseRequest(inputs=t) for t in inputs))
            )
        )
        over_http = (
            await asyncio.to_thread(fleet.http.post, "/embed_sparse", json={"inputs": inputs})
        ).json()
    # one input per message: batched with others or alone, its weights agree to float32's noise
    for answer, stream_answer, expected in zip(answers, streamed, over_http, strict=True):
        for weights in (answer.sparse_embeddings, stream_answer.sparse_embeddings):
            assert [w.index for w in weights] == [e["index"] for e in expected]
            np.testing.assert_allclose(
                [w.value for w in weights], [e["value"] for e in expected], rtol=1e-4
            )
