"""The fleet's own gRPC API (embedfleet.v1) on the gateway, beside TEI's tei.v1 on the same
port: a client of the committed modules of fleet.proto, over a real gateway, a real Redis and a
real worker process (the packaged model). Its vectors are /v1/embeddings' vectors, as bytes of
the dtype asked for: float32 and float16 decoded equal the HTTP answer's floats, int8 and uint8
are its codes on the model's calibration ranges, binary and ubinary its signs' bits;
``dimensions`` cuts them. Refusals: the gateway's message with INVALID_ARGUMENT, and
UNAUTHENTICATED without the key."""

from __future__ import annotations

import base64

import grpc
import httpx
import numpy as np
import pytest
import redis

from embedfleet.gateway.fleet_grpc import fleet_pb2 as pb
from embedfleet.gateway.grpc_services import stub
from embedfleet.gateway.tei_grpc import tei_pb2
from embedfleet.shared.postprocess import quantize
from embedfleet.shared.protocol import STORAGE_DTYPES
from embedfleet.shared.settings import Settings
from embedfleet.workers.calibration import Calibration
from tests.gateway_support import GRPC_AUTH as AUTH
from tests.gateway_support import GrpcServed, min_cosine, module_grpc_fleet

# the slow tier (make test-full, CI): starts a worker process and a gateway
pytestmark = pytest.mark.slow

TEXTS = ["What is Deep Learning?", "A cat sat on the mat.", "Redis streams carry the chunks."]
DIM = 384  # the packaged model's

fleet_settings, worker, grpc_served = module_grpc_fleet("fleetgrpc")


class Fleet:
    def __init__(self, http: httpx.Client, channel: grpc.Channel, settings: Settings) -> None:
        self.http = http
        self.fleet = stub(channel, pb.DESCRIPTOR.services_by_name["Fleet"])
        self.tei = stub(channel, tei_pb2.DESCRIPTOR.services_by_name["Embed"])
        self.settings = settings

    def http_vectors(self, texts: list[str], **options: object) -> np.ndarray:
        """/v1/embeddings' answer, read from its base64 (float32 little-endian) form."""
        answer = self.http.post(
            "/v1/embeddings", json={"input": texts, "encoding_format": "base64", **options}
        )
        assert answer.status_code == 200, answer.text
        return np.array(
            [
                np.frombuffer(base64.b64decode(row["embedding"]), "<f4")
                for row in answer.json()["data"]
            ]
        )


@pytest.fixture(scope="module")
def fleet(grpc_served: GrpcServed, fleet_settings: Settings) -> Fleet:
    http, channel, _ = grpc_served
    return Fleet(http, channel, fleet_settings)


def decoded(answer: pb.EmbedResponse) -> np.ndarray:
    """The answer's vectors as numpy reads the protocol's bytes of its dtype."""
    dtype = pb.Dtype.Name(answer.dtype).removeprefix("DTYPE_").lower()
    return np.array([np.frombuffer(v.data, STORAGE_DTYPES[dtype]) for v in answer.vectors])


def test_info_is_the_model_card(fleet: Fleet) -> None:
    info = fleet.fleet.Info(pb.InfoRequest(), metadata=AUTH)
    (model,) = fleet.http.get("/v1/models").json()["data"]
    assert info.model == model["id"]
    assert info.dim == model["dimensions"] == DIM
    assert info.max_tokens == model["max_input_tokens"]
    assert info.normalize
    assert list(info.representations) == ["dense"]
    assert info.compute_dtype == fleet.http.get("/info").json()["model_dtype"]
    assert info.revision


def test_float_vectors_are_the_http_vectors(fleet: Fleet) -> None:
    answer = fleet.fleet.Embed(pb.EmbedRequest(inputs=TEXTS), metadata=AUTH)
    over_http = fleet.http_vectors(TEXTS)
    # unspecified is float32, 4 bytes a value
    assert answer.dtype == pb.DTYPE_FLOAT32
    assert answer.dim == DIM and [len(v.data) for v in answer.vectors] == [DIM * 4] * 3
    vectors = decoded(answer)
    assert round(min_cosine(vectors, over_http), 4) == 1.0
    np.testing.assert_allclose(vectors, over_http, atol=2e-3)
    usage = fleet.http.post("/v1/embeddings", json={"input": TEXTS}).json()["usage"]
    assert answer.prompt_tokens == usage["prompt_tokens"]
    assert answer.model == fleet.http.get("/v1/models").json()["data"][0]["id"]
    # float16: 2 bytes a value, the float32 answer's values in half precision
    half = fleet.fleet.Embed(pb.EmbedRequest(inputs=TEXTS, dtype=pb.DTYPE_FLOAT16), metadata=AUTH)
    assert half.dtype == pb.DTYPE_FLOAT16 and [len(v.data) for v in half.vectors] == [DIM * 2] * 3
    assert round(min_cosine(decoded(half).astype(np.float32), over_http), 4) == 1.0
    # dimensions: the Matryoshka cut, renormalised, as /v1/embeddings cuts it
    cut = fleet.fleet.Embed(pb.EmbedRequest(inputs=TEXTS, dimensions=64), metadata=AUTH)
    assert cut.dim == 64 and [len(v.data) for v in cut.vectors] == [64 * 4] * 3
    assert round(min_cosine(decoded(cut), fleet.http_vectors(TEXTS, dimensions=64)), 4) == 1.0
    np.testing.assert_allclose(np.linalg.norm(decoded(cut), axis=1), 1.0, atol=1e-5)


def test_quantized_dtypes_are_the_protocols(fleet: Fleet) -> None:
    """int8 and uint8: the HTTP vector's codes on the model's fixed calibration ranges (what the
    workers stored in Redis); binary and ubinary: its signs, packed 8 to a byte."""
    over_http = fleet.http_vectors(TEXTS)
    answers = {
        dtype: fleet.fleet.Embed(pb.EmbedRequest(inputs=TEXTS, dtype=number), metadata=AUTH)
        for dtype, number in [
            ("int8", pb.DTYPE_INT8),
            ("uint8", pb.DTYPE_UINT8),
            ("binary", pb.DTYPE_BINARY),
            ("ubinary", pb.DTYPE_UBINARY),
        ]
    }
    keys = fleet.settings.keys
    with redis.Redis.from_url(fleet.settings.redis_url) as client:
        (stored,) = client.keys(keys.calibration("*", str(DIM)))
        calibration = Calibration.from_json(client.get(stored), stored.decode())
    for dtype in ("int8", "uint8"):
        answer = answers[dtype]
        assert answer.dim == DIM and [len(v.data) for v in answer.vectors] == [DIM] * 3
        codes = decoded(answer)
        # the workers quantize their float32 vector, HTTP's crossed the wire as float16 (half a
        # thousandth of a unit vector's value at most): each code is one of those the values
        # within that of HTTP's give (several, in a dimension whose range is narrow)
        lowest, highest = (
            quantize(over_http + shift, dtype, calibration.ranges) for shift in (-1e-3, 1e-3)
        )
        assert ((lowest <= codes) & (codes <= highest)).all()
        assert (codes == quantize(over_http, dtype, calibration.ranges)).mean() > 0.95
    for dtype in ("binary", "ubinary"):
        answer = answers[dtype]
        assert answer.dim == DIM and [len(v.data) for v in answer.vectors] == [DIM // 8] * 3
        packed = decoded(answer).astype(np.int16) + (128 if dtype == "binary" else 0)
        signs = np.unpackbits(packed.astype(np.uint8), axis=1).astype(bool)
        # each dimension's bit is its sign, wherever the float16 wire cannot have flipped it (a
        # value within float16's rounding of zero: the workers' is their float32's sign)
        clear = np.abs(over_http) > 1e-3
        np.testing.assert_array_equal(signs[clear], (over_http > 0)[clear])
        assert clear.mean() > 0.95
    bits = fleet.fleet.Embed(
        pb.EmbedRequest(inputs=TEXTS, dtype=pb.DTYPE_UBINARY, dimensions=64), metadata=AUTH
    )
    assert bits.dim == 64 and [len(v.data) for v in bits.vectors] == [8] * 3
    cut = fleet.http_vectors(TEXTS, dimensions=64)
    clear = np.abs(cut) > 1e-3
    signs = np.unpackbits(decoded(bits), axis=1).astype(bool)
    np.testing.assert_array_equal(signs[clear], (cut > 0)[clear])


def test_embed_stream_answers_each_message_in_order(fleet: Fleet) -> None:
    texts = [f"stream message {i}: {'word ' * i}" for i in range(10)]
    messages = [pb.EmbedRequest(inputs=[text], dtype=pb.DTYPE_FLOAT16) for text in texts]
    answers = list(fleet.fleet.EmbedStream(iter(messages), metadata=AUTH))
    assert len(answers) == len(texts)
    vectors = np.vstack([decoded(answer) for answer in answers]).astype(np.float32)
    assert round(min_cosine(vectors, fleet.http_vectors(texts)), 4) == 1.0


def test_both_apis_share_the_port(fleet: Fleet) -> None:
    tei = fleet.tei.Embed(tei_pb2.EmbedRequest(inputs=TEXTS[0]), metadata=AUTH)
    ours = fleet.fleet.Embed(pb.EmbedRequest(inputs=TEXTS[:1]), metadata=AUTH)
    assert round(min_cosine(np.array(tei.embeddings), decoded(ours)), 4) == 1.0


def test_a_bad_option_is_invalid_argument_with_the_gateways_message(fleet: Fleet) -> None:
    too_long = "word " * 2000
    for request, body in [
        (pb.EmbedRequest(inputs=TEXTS, dimensions=100_000), {"dimensions": 100_000}),
        (pb.EmbedRequest(inputs=[""]), {"input": [""]}),
        (pb.EmbedRequest(inputs=[]), {"input": []}),
        (pb.EmbedRequest(inputs=[too_long]), {"input": [too_long]}),
    ]:
        with pytest.raises(grpc.RpcError) as refused:
            fleet.fleet.Embed(request, metadata=AUTH)
        assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT, request
        answer = fleet.http.post("/v1/embeddings", json={"input": TEXTS, **body})
        assert answer.status_code == 400, answer.text
        assert refused.value.details() == answer.json()["error"]["message"]
    # truncate: cut to fit, as over HTTP
    cut = fleet.fleet.Embed(pb.EmbedRequest(inputs=[too_long], truncate=True), metadata=AUTH)
    assert cut.dim == DIM
    # a dtype of a newer proto
    with pytest.raises(grpc.RpcError) as refused:
        fleet.fleet.Embed(pb.EmbedRequest(inputs=TEXTS, dtype=99), metadata=AUTH)  # type: ignore[arg-type]
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT
    assert "DTYPE_INT8" in refused.value.details()
    # a stream ends at its first refusal, after the answers before it
    answers = fleet.fleet.EmbedStream(
        iter([pb.EmbedRequest(inputs=TEXTS), pb.EmbedRequest(inputs=[""])]), metadata=AUTH
    )
    assert next(answers).dim == DIM
    with pytest.raises(grpc.RpcError) as refused:
        next(answers)
    assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize(
    "call",
    [
        lambda f, md: f.fleet.Info(pb.InfoRequest(), metadata=md),
        lambda f, md: f.fleet.Embed(pb.EmbedRequest(inputs=TEXTS), metadata=md),
        lambda f, md: list(f.fleet.EmbedStream(iter([pb.EmbedRequest(inputs=TEXTS)]), metadata=md)),
    ],
    ids=["Info", "Embed", "EmbedStream"],
)
@pytest.mark.parametrize("metadata", [(), (("authorization", "Bearer wrong"),)])
def test_a_call_without_the_key_is_unauthenticated(fleet: Fleet, call, metadata) -> None:
    with pytest.raises(grpc.RpcError) as refused:
        call(fleet, metadata)
    assert refused.value.code() is grpc.StatusCode.UNAUTHENTICATED
    assert "API key" in refused.value.details()


@pytest.mark.parametrize(
    "fields",
    [
        {"dimensions": 2**32 - 1},
        {"dimensions": 0},
        {"window_overlap": 2**32 - 1},  # past the protocol's bound (issue 54, fault 5)
        {"dtype": 2**31 - 1},
    ],
    ids=["dims-max", "dims-0", "overlap-max", "dtype-max"],
)
def test_an_out_of_range_number_is_invalid_argument(fleet: Fleet, fields: dict) -> None:
    """The proto's widest numbers (a uint32's whole range, an open enum's any int32), alone and
    in a stream: the caller's error, never INTERNAL or UNKNOWN."""
    message = pb.EmbedRequest(inputs=TEXTS[:1], **fields)
    for call in (
        lambda: fleet.fleet.Embed(message, metadata=AUTH),
        lambda: list(fleet.fleet.EmbedStream(iter([message]), metadata=AUTH)),
    ):
        with pytest.raises(grpc.RpcError) as refused:
            call()
        assert refused.value.code() is grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()
