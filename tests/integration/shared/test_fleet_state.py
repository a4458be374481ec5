"""One reader of the fleet's state (shared/fleet.py), two renderings: `embedfleet status` and the
worker's stream gauges, checked against each other and against redis-cli's own commands."""

from __future__ import annotations

import math

import redis.asyncio as aioredis

from embedfleet.ops.status import report, take_snapshot
from embedfleet.shared.fleet import FLEET_STREAMS, INPUT_STREAMS, read_fleet
from embedfleet.shared.protocol import PAYLOAD_FIELD, Chunk, encode_chunk
from embedfleet.shared.redis_conn import ensure_group
from embedfleet.shared.settings import Settings
from embedfleet.workers.metrics import StreamGauges, WorkerMetrics


def _gauge(metrics: WorkerMetrics, name: str, stream: str) -> float:
    labels = {"model": metrics.model, "stream": stream}
    value = metrics.registry.get_sample_value(f"embedfleet_{name}", labels)
    assert value is not None, (name, stream)
    return value


async def test_status_and_gauges_render_the_same_read(
    settings: Settings, client: aioredis.Redis
) -> None:
    keys = settings.keys
    for n in range(7):
        chunk = Chunk(id=f"c{n}", text="some text", job="j")
        await client.xadd(keys.ingest, {PAYLOAD_FIELD: encode_chunk(chunk)})
    await client.xadd(keys.query, {PAYLOAD_FIELD: encode_chunk(Chunk(id="q", text="query"))})
    await ensure_group(client, keys, keys.ingest)
    await client.xreadgroup(settings.group, "reader-a", {keys.ingest: ">"}, count=3)
    await client.xadd(keys.dead, {"reason": "invalid", "id": "bad"})
    # the query stream has no group yet: all of it is lag

    state = await read_fleet(client, keys)
    assert [state.streams[s].length for s in FLEET_STREAMS] == [7, 1, 0, 0, 1]
    ingest, query = state.streams["ingest"], state.streams["query"]
    assert (ingest.lag, ingest.pending, ingest.group_consumers) == (4, 3, 1)
    assert (query.group, query.lag, query.pending) == (None, 1, 0)
    assert state.jobs == () and state.dead_latest == ()  # the gauges' read asks for no more
    info = await client.xinfo_groups(keys.ingest)
    assert (info[0]["lag"], info[0]["pending"]) == (ingest.lag, ingest.pending)

    metrics = WorkerMetrics()
    assert await StreamGauges(metrics, client, keys).refresh()
    data = report(await take_snapshot(client, keys), None, settings)
    for stream in FLEET_STREAMS:
        assert _gauge(metrics, "stream_length", stream) == data["streams"][stream]["length"]
    for stream in INPUT_STREAMS:
        shown = data["streams"][stream]
        assert _gauge(metrics, "stream_lag", stream) == shown["lag"]
        assert _gauge(metrics, "stream_pending", stream) == shown["pending"]
        assert _gauge(metrics, "group_consumers", stream) == len(shown["consumers"])
    # the status view's fuller read: consumers, jobs and dead letters, from the same reader
    assert [c["name"] for c in data["streams"]["ingest"]["consumers"]] == ["reader-a"]
    assert data["dead_letters"]["latest"][0]["id"] == "bad"
    assert not math.isnan(_gauge(metrics, "stream_lag", "query"))
