"""TEI's gRPC door: the committed modules are protoc's output of the vendored proto, and each
refusal ends a call with the code TEI's gRPC server gives its error type
(router/src/grpc/server.rs); on a real gateway and Redis without a worker, every call of either
door is counted on /metrics, and health and reflection answer as TEI's server registers them.
The calls a worker answers: tests/end_to_end/test_gateway_grpc.py."""

from __future__ import annotations

import uuid
from pathlib import Path

import httpx
import pytest
from redis.exceptions import RedisError

grpc = pytest.importorskip("grpc")  # the gateway's extra

from embedfleet.gateway.errors import APIError  # noqa: E402
from embedfleet.gateway.tei_grpc.server import grpc_code  # noqa: E402
from embedfleet.server import ServerProcess, free_port  # noqa: E402
from embedfleet.shared.settings import Settings  # noqa: E402
from tests.gateway_support import running_gateway  # noqa: E402

Code = grpc.StatusCode


def test_the_committed_modules_are_what_protoc_makes_of_the_proto() -> None:
    pytest.importorskip("grpc_tools")  # the dev extra's protoc
    from embedfleet.gateway.tei_grpc import generate

    assert generate.stale() == [], "run python -m embedfleet.gateway.tei_grpc.generate --write"


@pytest.mark.parametrize(
    ("status", "code", "expected"),
    [
        # TEI's error types: Empty and Validation are INVALID_ARGUMENT
        (400, "empty_input", Code.INVALID_ARGUMENT),
        (400, "invalid_input", Code.INVALID_ARGUMENT),
        (422, "invalid_prompt", Code.INVALID_ARGUMENT),
        (413, "too_many_inputs", Code.INVALID_ARGUMENT),
        # Backend (what the served model does not give), Overloaded, Unhealthy
        (424, "representation_not_served", Code.FAILED_PRECONDITION),
        (429, "rate_limit_exceeded", Code.RESOURCE_EXHAUSTED),
        (503, "queue_unavailable", Code.UNAVAILABLE),
        (503, "no_model_card", Code.UNAVAILABLE),
        # what TEI has no error type for: gRPC's own codes
        (401, "invalid_api_key", Code.UNAUTHENTICATED),
        (504, None, Code.DEADLINE_EXCEEDED),
        (500, "internal_error", Code.INTERNAL),
    ],
)
def test_a_refusal_ends_the_call_with_teis_code(
    status: int, code: str | None, expected: object
) -> None:
    assert grpc_code(APIError(status, "refused", code=code)) is expected


# --- the server's own parts on a real gateway and Redis, no worker -------------------------------
# Every call is counted once, in the gateway's request series, whichever door (tei.v1 or
# embedfleet.v1); TEI's calls also in TEI's series, as TEI counts them; health and reflection as
# TEI's gRPC server registers them. What needs a worker (an answered Embed's timings, SERVING
# for Embed): tests/end_to_end/test_gateway_grpc.py.

KEY = "unit-grpc-key"
AUTH = (("authorization", f"Bearer {KEY}"),)


class Served:
    def __init__(self, url: str, channel: object) -> None:
        self.url = url
        self.channel = channel

    def metrics(self) -> dict[str, float]:
        """/metrics' samples, by their whole selector (name and labels as written)."""
        text = httpx.get(f"{self.url}/metrics").text
        samples = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                selector, _, value = line.rpartition(" ")
                samples[selector] = float(value)
        return samples


@pytest.fixture(scope="module")
def served(redis_server: ServerProcess, tmp_path_factory: pytest.TempPathFactory):
    settings = Settings(
        redis_url=redis_server.url,
        namespace=f"ug{uuid.uuid4().hex[:8]}",
        files_dir=str(tmp_path_factory.mktemp("unit-grpc-files")),
        api_keys=KEY,
        gateway_grpc_port=free_port(),
    )
    with (
        running_gateway(settings) as url,
        grpc.insecure_channel(f"127.0.0.1:{settings.gateway_grpc_port}") as channel,
    ):
        yield Served(url, channel)


def _moved(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {
        key: after[key] - before.get(key, 0.0) for key in after if after[key] != before.get(key)
    }


def test_every_grpc_call_is_counted_once_for_both_doors(served: Served) -> None:
    from embedfleet.gateway.fleet_grpc import fleet_pb2
    from embedfleet.gateway.grpc_services import stub
    from embedfleet.gateway.tei_grpc import tei_pb2

    tei = stub(served.channel, tei_pb2.DESCRIPTOR.services_by_name["Embed"])
    fleet = stub(served.channel, fleet_pb2.DESCRIPTOR.services_by_name["Fleet"])
    before = served.metrics()
    refused = [
        lambda: tei.Embed(tei_pb2.EmbedRequest(inputs=""), metadata=AUTH),
        lambda: tei.Embed(tei_pb2.EmbedRequest(inputs="a text")),  # no key
        lambda: list(tei.EmbedStream(iter([tei_pb2.EmbedRequest(inputs="")]), metadata=AUTH)),
        lambda: fleet.Embed(fleet_pb2.EmbedRequest(inputs=[""]), metadata=AUTH),
    ]
    for call in refused:
        with pytest.raises(grpc.RpcError):
            call()
    moved = _moved(before, served.metrics())
    series = "embedfleet_gateway_requests_total"
    # the fleet's own series: one sample per call, its status the HTTP equivalent
    assert moved[f'{series}{{method="gRPC",route="/tei.v1.Embed/Embed",status="400"}}'] == 1
    assert moved[f'{series}{{method="gRPC",route="/tei.v1.Embed/Embed",status="401"}}'] == 1
    assert moved[f'{series}{{method="gRPC",route="/tei.v1.Embed/EmbedStream",status="400"}}'] == 1
    assert moved[f'{series}{{method="gRPC",route="/embedfleet.v1.Fleet/Embed",status="400"}}'] == 1
    # TEI's: the unary Embed is a request; the stream's message only a failure (as TEI counts a
    # stream's messages); a call refused for its key reaches no route (TEI's interceptor); the
    # fleet's door is /v1/embeddings', which TEI's series do not count
    assert moved['te_request_count{method="single"}'] == 1
    assert moved['te_request_failure{err="validation"}'] == 2
    assert moved["te_embed_count"] == 2


def test_grpc_health_is_the_gateways_readiness_and_teis_per_service(served: Served) -> None:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    health = health_pb2_grpc.HealthStub(served.channel)
    Serving = health_pb2.HealthCheckResponse

    def status(service: str) -> int:
        return health.Check(health_pb2.HealthCheckRequest(service=service)).status

    # no key needed (probes carry none), as TEI's; ready: Redis answers (/readyz's 200)
    assert httpx.get(f"{served.url}/readyz").status_code == 200
    for service in ("", "tei.v1.Info", "tei.v1.Tokenize", "embedfleet.v1.Fleet"):
        assert status(service) == Serving.SERVING, service
    # TEI's model services: while a worker is alive (/health's 503 here: none is)
    assert httpx.get(f"{served.url}/health").status_code == 503
    for service in ("tei.v1.Embed", "tei.v1.Predict", "tei.v1.Rerank"):
        assert status(service) == Serving.NOT_SERVING, service
    with pytest.raises(grpc.RpcError) as unknown:
        status("no.such.Service")
    assert unknown.value.code() is grpc.StatusCode.NOT_FOUND
    watched = health.Watch(health_pb2.HealthCheckRequest(service=""))
    assert next(watched).status == Serving.SERVING
    watched.cancel()


async def test_grpc_health_is_not_serving_while_redis_does_not_answer(tmp_path: Path) -> None:
    from embedfleet.gateway.app import build_gateway
    from embedfleet.gateway.grpc_server import GatewayHealth
    from embedfleet.gateway.readiness import readiness

    closed = f"redis://127.0.0.1:{free_port()}"  # nothing listens there
    settings = Settings(redis_url=closed, files_dir=str(tmp_path), gateway_redis_timeout_s=2)
    gateway = build_gateway(settings)
    try:
        with pytest.raises(RedisError):  # /readyz's 503
            await readiness(gateway)
        health = GatewayHealth(gateway)
        assert await health.status("") == health_status("NOT_SERVING")
        assert await health.status("tei.v1.Embed") == health_status("NOT_SERVING")
        assert await health.status("no.such.Service") is None
    finally:
        await gateway.client.aclose()


def health_status(name: str) -> int:
    from grpc_health.v1 import health_pb2

    return health_pb2.HealthCheckResponse.ServingStatus.Value(name)


def test_reflection_lists_and_describes_every_service(served: Served) -> None:
    from google.protobuf import descriptor_pb2
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    stub = reflection_pb2_grpc.ServerReflectionStub(served.channel)
    asks = [
        reflection_pb2.ServerReflectionRequest(list_services=""),
        reflection_pb2.ServerReflectionRequest(file_containing_symbol="tei.v1.Embed"),
        reflection_pb2.ServerReflectionRequest(file_containing_symbol="embedfleet.v1.Fleet"),
    ]
    listed, tei_file, fleet_file = list(stub.ServerReflectionInfo(iter(asks)))
    names = {service.name for service in listed.list_services_response.service}
    assert {
        "tei.v1.Info",
        "tei.v1.Embed",
        "tei.v1.Predict",
        "tei.v1.Rerank",
        "tei.v1.Tokenize",
        "embedfleet.v1.Fleet",
        "grpc.health.v1.Health",
        "grpc.reflection.v1alpha.ServerReflection",
    } <= names
    for answer, package, service in [
        (tei_file, "tei.v1", "Embed"),
        (fleet_file, "embedfleet.v1", "Fleet"),
    ]:
        (proto,) = answer.file_descriptor_response.file_descriptor_proto[:1]
        described = descriptor_pb2.FileDescriptorProto.FromString(proto)
        assert described.package == package
        assert service in {s.name for s in described.service}
