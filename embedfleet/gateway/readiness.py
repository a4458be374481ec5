"""Whether a gateway is ready: the one owner of the answer HTTP's /readyz and gRPC's health
service (grpc_server.py, ``grpc.health.v1``) both give. Ready means this gateway serves and its
Redis (or cluster) answers, so a request sent here is enqueued; it does not mean a worker is
alive (with scale-to-zero none is until KEDA sees what the gateway enqueued, and a request waits
for one within EMBEDFLEET_GATEWAY_TIMEOUT_S): TEI's /health, and TEI's per-service gRPC health,
answer that."""

from __future__ import annotations

from dataclasses import dataclass

from embedfleet.gateway.state import Gateway
from embedfleet.shared.redis_conn import redis_deadline
from embedfleet.shared.streams import live_workers


@dataclass(frozen=True)
class Ready:
    """What a ready gateway reports, for people: the live workers of its own model, and of
    each model of the namespace (name -> live workers, from each lane's heartbeats)."""

    live_workers: int
    models: dict[str, int]


async def readiness(gateway: Gateway) -> Ready:
    """The gateway's readiness, within EMBEDFLEET_GATEWAY_REDIS_TIMEOUT_S (a hung Redis is not
    ready); raises what Redis raised, or redis-py's TimeoutError past that bound, when it is
    not ready."""
    settings = gateway.settings
    async with redis_deadline(settings.gateway_redis_timeout_s, "check the gateway's readiness"):
        await gateway.client.ping()
        workers = await gateway.fleet.live_workers()
        models: dict[str, int] = {}
        for lane in await gateway.models():
            models[lane.name] = await live_workers(
                gateway.client, lane.keys, settings.gateway_worker_idle_ms
            )
    return Ready(workers, models)
