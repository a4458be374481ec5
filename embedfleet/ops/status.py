"""`embedfleet status`: the fleet's backlog, consumers, throughput and jobs, read from Redis.

Everything comes from the same commands an operator would type (the README's Operations section
lists them): XLEN, XINFO GROUPS, XINFO CONSUMERS, XREVRANGE on the dead-letter stream, and the
job hashes, read by ``shared/fleet.py``, the same reader the worker's stream gauges use; and
CONFIG GET maxmemory-policy, checked by ``shared/eviction.py``. This module renders what it
reads as tables and JSON.

Throughput is measured, not guessed: Redis (>= 7) counts, per consumer group, the entries ever
delivered (``entries-read``); minus the ones still pending, that is the number of entries the
fleet has finished (embedded or dead-lettered) since the group was created. Two snapshots give a
rate. ``--watch`` keeps the snapshots of the last minute and reports the rate over that minute;
a single ``status`` takes two snapshots ``--sample`` seconds apart. It works with any sink (the
counters live in the consumer group, not in the results stream) and costs Redis nothing extra.
The time to drain is the backlog (lag + pending) divided by that rate.

A namespace serving several models (shared/model_registry.py) is shown model by model: the
top of the view is the settings' own model (the default one, or EMBEDFLEET_MODEL_LANE's), and
``models`` has a row for every model in the registry (``{ns}:models``): its streams' backlog,
consumers, throughput, time to drain, jobs and dead letters, read from its lane's keys.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import signal
import sys
from collections import deque
from collections.abc import Awaitable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, TypeVar

import click
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from embedfleet.ops.sparkline import Trend
from embedfleet.ops.waiting import (
    StderrNotice,
    redis_url_option,
    run_client,
    seconds_option,
    verb_settings,
)
from embedfleet.shared.eviction import EvictionPolicy, check_eviction_policy
from embedfleet.shared.fleet import (
    FLEET_STREAMS,
    INPUT_STREAMS,
    FleetState,
    StreamState,
    Usage,
    read_fleet,
)
from embedfleet.shared.keys import Keys
from embedfleet.shared.model_registry import read_registry, registered_lanes
from embedfleet.shared.redis_conn import connect_client_settings, redact_url
from embedfleet.shared.retry import RedisRetry
from embedfleet.shared.settings import Settings
from embedfleet.shared.tenants import TenantPolicy

T = TypeVar("T")
THROUGHPUT_WINDOW_S = 60.0
DEAD_LETTERS_SHOWN = 3
METHOD = (
    "entries finished (embedded or dead-lettered) per second: the change of the consumer "
    "group's entries-read minus pending (XINFO GROUPS) between snapshots"
)


@dataclass(frozen=True)
class Throughput:
    per_s: float
    by_stream: dict[str, float]
    window_s: float
    # ingest entries finished per second in each partition (absent where it cannot be told)
    by_partition: dict[int, float] = field(default_factory=dict)


# The status view is the fleet reader's fullest read; the worker's gauges are its other rendering.
Snapshot = FleetState


async def take_snapshot(client: aioredis.Redis, keys: Keys) -> Snapshot:
    """Everything the status view shows: streams, consumers, jobs, the latest dead letters."""
    return await read_fleet(
        client, keys, consumers=True, jobs=True, dead_latest=DEAD_LETTERS_SHOWN, usage=True
    )


async def take_model_snapshots(client: aioredis.Redis, keys: Keys) -> dict[str, Snapshot]:
    """A snapshot of every model in the namespace's registry (``{ns}:models``), by name."""
    lanes = registered_lanes(keys, await read_registry(client, keys))
    return {lane.name: await take_snapshot(client, lane.keys) for lane in lanes}


class ModelHistories:
    """One ``History`` per model, for ``--watch``'s rates model by model."""

    def __init__(self) -> None:
        self._histories: dict[str, History] = {}

    def add(self, snapshots: dict[str, Snapshot]) -> dict[str, tuple[Snapshot, Throughput | None]]:
        rated: dict[str, tuple[Snapshot, Throughput | None]] = {}
        for name, snapshot in snapshots.items():
            history = self._histories.setdefault(name, History())
            history.add(snapshot)
            rated[name] = (snapshot, history.throughput())
        return rated


def rated_models(
    older: dict[str, Snapshot], newer: dict[str, Snapshot]
) -> dict[str, tuple[Snapshot, Throughput | None]]:
    """Each model's latest snapshot with its rate between the two reads (None where it was
    read once)."""
    return {
        name: (snapshot, throughput(older[name], snapshot) if name in older else None)
        for name, snapshot in newer.items()
    }


def every_lanes_usage(
    snapshot: Snapshot, models: dict[str, tuple[Snapshot, Throughput | None]]
) -> list[Usage]:
    """The usage rows of the settings' own lane (``snapshot``) and of every other registered
    lane (``models``): each lane's workers count in that lane's own usage hashes."""
    seen = {snapshot.streams["ingest"].key}
    rows = list(snapshot.usage)
    for _, (lane, _rate) in sorted(models.items()):
        if lane.streams["ingest"].key not in seen:
            seen.add(lane.streams["ingest"].key)
            rows.extend(lane.usage)
    return rows


def model_rows(
    models: dict[str, tuple[Snapshot, Throughput | None]], keys: Keys
) -> list[dict[str, Any]]:
    """The ``models`` of the report: per registered model, what the view shows of a fleet."""
    rows = []
    for name, (snapshot, rate) in sorted(models.items()):
        ingest, query = snapshot.streams["ingest"], snapshot.streams["query"]
        eta = eta_seconds(snapshot, rate)
        consumers = {c.name for stream in INPUT_STREAMS for c in snapshot.streams[stream].consumers}
        lane = snapshot.streams["ingest"].key
        rows.append(
            {
                "model": name,
                "default": not lane.startswith(f"{keys.namespace}:m:"),
                "ingest_key": lane,
                "lag": ingest.lag,
                "pending": ingest.pending,
                "query_lag": query.lag,
                "backlog": backlog(snapshot),
                "consumers": len(consumers),
                "results": snapshot.streams["results"].length,
                "dead": snapshot.streams["dead"].length,
                "per_s": None if rate is None else round(rate.per_s, 3),
                "eta_s": None if eta is None or math.isinf(eta) else round(eta, 1),
                "stalled": eta is not None and math.isinf(eta),
                "jobs": [
                    {
                        "job": j.job,
                        "enqueued": j.enqueued,
                        "done": j.done,
                        "dead": j.dead,
                        "remaining": j.remaining,
                    }
                    for j in snapshot.jobs
                ],
            }
        )
    return rows


def throughput(older: Snapshot, newer: Snapshot) -> Throughput | None:
    """Entries finished per second between two snapshots; None when it cannot be told.

    A counter that went backwards (the stream or group was deleted and created again) or that
    Redis does not keep makes that stream's rate unknown, never a wrong number.
    """
    window = newer.monotonic - older.monotonic
    if window <= 0:
        return None
    by_stream: dict[str, float] = {}
    for name in INPUT_STREAMS:
        before, after = older.streams[name].finished, newer.streams[name].finished
        if before is None or after is None or after < before:
            return None
        by_stream[name] = (after - before) / window
    by_partition: dict[int, float] = {}
    for old, new in zip(older.partitions, newer.partitions, strict=False):
        before, after = old.ingest.finished, new.ingest.finished
        if old.index == new.index and before is not None and after is not None and after >= before:
            by_partition[new.index] = (after - before) / window
    return Throughput(
        per_s=sum(by_stream.values()),
        by_stream=by_stream,
        window_s=window,
        by_partition=by_partition,
    )


class History:
    """The snapshots of the last ``window_s`` seconds, for a rate over that window."""

    def __init__(self, window_s: float = THROUGHPUT_WINDOW_S) -> None:
        self.window_s = window_s
        self._snapshots: deque[Snapshot] = deque()

    def add(self, snapshot: Snapshot) -> None:
        self._snapshots.append(snapshot)
        # Keep the newest snapshot that is at least window_s old, so the rate spans the window.
        while (
            len(self._snapshots) > 2
            and snapshot.monotonic - self._snapshots[1].monotonic >= self.window_s
        ):
            self._snapshots.popleft()

    def throughput(self) -> Throughput | None:
        if len(self._snapshots) < 2:
            return None
        return throughput(self._snapshots[0], self._snapshots[-1])


def backlog(snapshot: Snapshot) -> int | None:
    """Entries still to do: undelivered plus delivered-but-unacknowledged, on both inputs."""
    total = 0
    for name in INPUT_STREAMS:
        stream = snapshot.streams[name]
        if stream.lag is None:
            return None
        total += stream.lag + stream.pending
    return total


def eta_seconds(snapshot: Snapshot, rate: Throughput | None) -> float | None:
    """Seconds to drain the backlog at the measured rate: 0 when empty, inf when stalled."""
    remaining = backlog(snapshot)
    if remaining is None:
        return None
    if remaining == 0:
        return 0.0
    if rate is None:
        return None
    return math.inf if rate.per_s <= 0 else remaining / rate.per_s


# --- output ---------------------------------------------------------------------------
def report(
    snapshot: Snapshot,
    rate: Throughput | None,
    settings: Settings,
    *,
    measuring: bool = False,
    eviction: EvictionPolicy | None = None,
    models: dict[str, tuple[Snapshot, Throughput | None]] | None = None,
) -> dict[str, Any]:
    """The JSON object ``--json`` prints (and the text view renders). ``eviction``: Redis's
    maxmemory-policy as checked (None: not checked); ``models``: each registered model's
    snapshot and rate (``take_model_snapshots``), its row in ``models``. Each section is one
    step below, in the order the object lists them."""
    eta = eta_seconds(snapshot, rate)
    return {
        "time": datetime.fromtimestamp(snapshot.taken_at, UTC).isoformat(timespec="seconds"),
        "redis": redact_url(settings.effective_redis_url),
        "namespace": settings.namespace,
        "group": settings.group,
        "eviction_policy": None if eviction is None else eviction.as_json(),
        "streams": _streams_section(snapshot),
        "partitions": _partitions_section(snapshot, rate),
        "dead_letters": _dead_letters_section(snapshot),
        "throughput": _throughput_section(rate, measuring),
        "backlog": backlog(snapshot),
        # the partitions whose results stream is at EMBEDFLEET_RESULTS_MAX_ENTRIES: their
        # workers wait for a consuming reader (embedfleet/sinks/redis_stream.py)
        "results_max_entries": settings.results_max_entries,
        "results_full": _full_results_partitions(snapshot, settings.results_max_entries),
        # JSON has no infinity: a stalled fleet (backlog, no progress) has eta null + stalled.
        "eta_s": None if eta is None or math.isinf(eta) else round(eta, 1),
        "stalled": eta is not None and math.isinf(eta),
        # the vector cache (shared/vector_cache.py): chunks answered without the model
        "vector_cache": {
            "max_mb": settings.vector_cache_mb,
            **(snapshot.cache.as_dict() if snapshot.cache is not None else {}),
        },
        "jobs": _jobs_section(snapshot),
        "model": settings.model_lane,
        "models": model_rows(models or {}, settings.keys),
        # issue 30: each tenant's ingest streams (summed over the partitions) and share
        "tenants": _tenants_section(snapshot, settings.tenant_policy),
        # what each tenant used, per model and job (the usage hashes, Keys.usage): every
        # lane's, as each lane counts in its own hash
        "usage": _usage_section(snapshot, models or {}, settings.tenant_policy),
    }


def _streams_section(snapshot: Snapshot) -> dict[str, Any]:
    """Each stream's key and length; an input stream's group, backlog and consumers too."""
    streams: dict[str, Any] = {}
    for name, stream in snapshot.streams.items():
        entry: dict[str, Any] = {"key": stream.key, "length": stream.length}
        if name in INPUT_STREAMS:
            entry |= _input_stream_entry(stream)
        streams[name] = entry
    return streams


def _input_stream_entry(stream: StreamState) -> dict[str, Any]:
    """What an input stream's consumer group says of it: lag, pending, read and consumers."""
    group = stream.group
    return {
        "group_exists": group is not None,
        "lag": stream.lag,
        "pending": stream.pending,
        "entries_read": None if group is None else group.entries_read,
        "last_delivered_id": None if group is None else group.last_delivered_id,
        "consumers": [
            {
                "name": c.name,
                "pending": c.pending,
                "idle_ms": c.idle_ms,
                "inactive_ms": c.inactive_ms,
            }
            for c in stream.consumers
        ],
    }


def _partitions_section(snapshot: Snapshot, rate: Throughput | None) -> list[dict[str, Any]]:
    """One row per partition: its ingest stream, where it lives, its results and dead letters,
    and its own rate where it could be told."""
    return [
        {
            "partition": p.index,
            "key": p.ingest.key,
            "slot": p.slot,
            "node": p.node,
            "length": p.ingest.length,
            "lag": p.ingest.lag,
            "pending": p.ingest.pending,
            "consumers": p.ingest.group_consumers,
            "entries_read": None if p.ingest.group is None else p.ingest.group.entries_read,
            "last_delivered_id": None
            if p.ingest.group is None
            else p.ingest.group.last_delivered_id,
            "results": p.results_length,
            "dead": p.dead_length,
            "per_s": None
            if rate is None or p.index not in rate.by_partition
            else round(rate.by_partition[p.index], 3),
        }
        for p in snapshot.partitions
    ]


def _dead_letters_section(snapshot: Snapshot) -> dict[str, Any]:
    """How many dead letters, and the latest few."""
    return {
        "count": snapshot.streams["dead"].length,
        "latest": [
            {
                "entry_id": d.dead_id,
                "reason": d.reason.value,
                "detail": d.detail,
                "id": d.chunk_id,
                "stream": d.stream,
            }
            for d in snapshot.dead_latest
        ],
    }


def _throughput_section(rate: Throughput | None, measuring: bool) -> dict[str, Any]:
    """The measured rate (None while it cannot be told), per stream, and how it is measured."""
    return {
        "per_s": None if rate is None else round(rate.per_s, 3),
        "by_stream": None
        if rate is None
        else {name: round(value, 3) for name, value in rate.by_stream.items()},
        "window_s": None if rate is None else round(rate.window_s, 3),
        "measuring": measuring,
        "method": METHOD,
    }


def _full_results_partitions(snapshot: Snapshot, max_entries: int) -> list[int]:
    """The partitions whose results stream holds ``max_entries`` or more (none with 0: no cap)."""
    return [p.index for p in snapshot.partitions if max_entries and p.results_length >= max_entries]


def _jobs_section(snapshot: Snapshot) -> list[dict[str, Any]]:
    """Each job's counters, with what the vector cache answered for it."""
    return [
        {
            "job": j.job,
            "enqueued": j.enqueued,
            "done": j.done,
            "dead": j.dead,
            "remaining": j.remaining,
            "cache_hits": j.cache_hits,
            "cache_misses": j.cache_misses,
            "tokens_saved": j.tokens_saved,
        }
        for j in snapshot.jobs
    ]


def _tenants_section(snapshot: Snapshot, policy: TenantPolicy) -> list[dict[str, Any]]:
    """Each tenant's policy (weight, limits) and its ingest streams' figures, by name."""
    return [
        {
            "tenant": policy.named(tenant),
            "weight": policy.weight(policy.named(tenant)),
            "max_backlog": policy.backlog_limit(policy.named(tenant)),
            "token_rate": policy.rate(policy.named(tenant)),
            "key": stream.key,
            "length": stream.length,
            "lag": stream.lag,
            "pending": stream.pending,
        }
        for tenant, stream in sorted(
            snapshot.tenants.items(), key=lambda item: policy.named(item[0])
        )
    ]


def _usage_section(
    snapshot: Snapshot,
    models: dict[str, tuple[Snapshot, Throughput | None]],
    policy: TenantPolicy,
) -> list[dict[str, Any]]:
    """What each tenant used, per model and job, over every lane's usage hashes."""
    return [
        {
            "tenant": policy.named(u.tenant),
            "model": u.model,
            "job": u.job,
            "chunks": u.chunks,
            "tokens": u.tokens,
            "model_seconds": round(u.model_seconds, 6),
            "dead": u.dead,
            "expired": u.expired,
        }
        for u in every_lanes_usage(snapshot, models)
    ]


def _n(value: int | None) -> str:
    return "?" if value is None else f"{value:,}"


def human_duration(seconds: float | None) -> str:
    if seconds is None:
        return "?"
    if math.isinf(seconds):
        return "never at this rate"
    if seconds < 10:
        return f"{seconds:.1f}s"
    if seconds < 60:
        return f"{seconds:.0f}s"
    minutes, secs = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours}h{minutes:02d}m"
    return f"{hours // 24}d{hours % 24:02d}h"


def _table(rows: list[list[str]], right: set[int], indent: str = "") -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for row in rows:
        cells = [
            cell.rjust(widths[i]) if i in right else cell.ljust(widths[i])
            for i, cell in enumerate(row)
        ]
        lines.append(indent + "  ".join(cells).rstrip())
    return lines


def render(data: dict[str, Any], *, consumers_shown: int = 10, jobs_shown: int = 10) -> str:
    """The text view of ``report()``: aligned tables a person can read at a glance."""
    lines = [
        f"embedfleet status  {data['time']}  redis {data['redis']}  "
        f"namespace {data['namespace']}  group {data['group']}",
        "",
    ]
    streams = data["streams"]
    lines += _render_streams(streams)
    lines.append("")
    if len(data["partitions"]) > 1:
        lines += _render_partitions(data["partitions"])
    lines += _render_progress(data)
    lines.append("")
    lines += _render_eviction(data.get("eviction_policy"))
    lines += _render_models(data.get("models", []))
    lines += _render_cache(data.get("vector_cache"))
    lines += _render_consumers(streams, consumers_shown)
    lines += _render_jobs(data["jobs"], jobs_shown)
    lines += _render_tenants(data.get("tenants", []), data.get("usage", []))
    lines += _render_dead_letters(data["dead_letters"], streams["dead"]["key"])
    return "\n".join(lines)


def _render_streams(streams: dict[str, Any]) -> list[str]:
    """One row per fleet stream; lag, pending and consumers only for the input streams."""
    rows = [["stream", "key", "length", "lag", "pending", "consumers"]]
    for name in FLEET_STREAMS:
        s = streams[name]
        if name in INPUT_STREAMS:
            consumers = str(len(s["consumers"])) if s["group_exists"] else "no group yet"
            rows.append(
                [name, s["key"], _n(s["length"]), _n(s["lag"]), _n(s["pending"]), consumers]
            )
        else:
            rows.append([name, s["key"], _n(s["length"]), "", "", ""])
    return _table(rows, right={2, 3, 4, 5})


def _render_progress(data: dict[str, Any]) -> list[str]:
    """The throughput, a full results stream's warning and the drain estimate."""
    lines = []
    rate = data["throughput"]
    if rate["per_s"] is not None:
        split = ", ".join(f"{k} {v:,.1f}/s" for k, v in rate["by_stream"].items())
        lines.append(
            f"throughput  {rate['per_s']:,.1f} entries/s over the last "
            f"{human_duration(rate['window_s'])}  ({split})"
        )
    elif rate["measuring"]:
        lines.append("throughput  measuring (needs a second snapshot)")
    else:
        lines.append("throughput  not measured (--sample 0)")
    if data.get("results_full"):
        lines.append(
            f"results     WARNING: at EMBEDFLEET_RESULTS_MAX_ENTRIES "
            f"({_n(data['results_max_entries'])}) on partition(s) "
            f"{', '.join(str(i) for i in data['results_full'])}: workers wait until a reader "
            "drains it (embedfleet results --out FILE --consume)"
        )
    lines.append(_render_drain(data))
    return lines


def _render_drain(data: dict[str, Any]) -> str:
    if data["backlog"] == 0:
        return "drain       nothing to do: no lag, nothing pending"
    if data["stalled"]:
        return (
            f"drain       {_n(data['backlog'])} entries waiting and none finished in the window:"
            " are workers running?"
        )
    if data["eta_s"] is None:
        return f"drain       {_n(data['backlog'])} entries to do (lag + pending)"
    eta = human_duration(data["eta_s"])
    return f"drain       ~{eta} for {_n(data['backlog'])} entries (lag + pending)"


def _render_eviction(eviction: dict[str, Any] | None) -> list[str]:
    """Redis's eviction policy, where the report could read it (nothing otherwise)."""
    if eviction is None:
        return []
    if eviction["warning"] is None:
        return [f"eviction    {eviction['policy']} (a full Redis refuses writes: safe)", ""]
    return [f"eviction    WARNING: {eviction['warning']}", ""]


def _render_dead_letters(dead: dict[str, Any], key: str) -> list[str]:
    if not dead["count"]:
        return ["dead letters  none"]
    lines = [f"dead letters  {dead['count']:,} in {key}; latest:"]
    for item in dead["latest"]:
        said = f"{item['reason']}: {item['detail']}" if item.get("detail") else item["reason"]
        said = said if len(said) <= 90 else said[:87] + "..."
        lines.append(f"  {item['entry_id']}  {item['id'] or '-'}: {said}")
    lines.append("  all of them: embedfleet dead list (replay them: embedfleet dead replay)")
    return lines


def _render_models(models: list[dict[str, Any]]) -> list[str]:
    """One row per model of the namespace, once more than one is registered."""
    if len(models) < 2:
        return []
    rows = [["model", "ingest", "lag", "pending", "backlog", "consumers", "rate", "drain", "jobs"]]
    for m in models:
        if m["backlog"] == 0:
            drain = "done"
        elif m["stalled"]:
            drain = "stalled"
        else:
            drain = human_duration(m["eta_s"])
        rows.append(
            [
                m["model"],
                m["ingest_key"],
                _n(m["lag"]),
                _n(m["pending"]),
                _n(m["backlog"]),
                str(m["consumers"]),
                "-" if m["per_s"] is None else f"{m['per_s']:,.1f}/s",
                drain,
                str(len(m["jobs"])),
            ]
        )
    return [*_table(rows, right={2, 3, 4, 5, 6, 8}), ""]


def _render_tenants(tenants: list[dict[str, Any]], usage: list[dict[str, Any]]) -> list[str]:
    """The tenants' backlogs and weights, then what each used per model and job (shown once
    there is more than the default tenant's plain stream, or any usage)."""
    lines: list[str] = []
    if len(tenants) > 1 or any(t["max_backlog"] or t["token_rate"] for t in tenants):
        rows = [["tenant", "weight", "length", "lag", "pending", "max backlog", "tokens/s"]]
        for t in tenants:
            rows.append(
                [
                    t["tenant"],
                    f"{t['weight']:g}",
                    _n(t["length"]),
                    _n(t["lag"]),
                    _n(t["pending"]),
                    "-" if t["max_backlog"] is None else _n(t["max_backlog"]),
                    "-" if t["token_rate"] is None else f"{t['token_rate']:,.0f}",
                ]
            )
        lines += [*_table(rows, right={1, 2, 3, 4, 5, 6}), ""]
    if usage:
        rows = [["usage: tenant", "model", "job", "chunks", "tokens", "model s", "dead"]]
        for u in usage:
            rows.append(
                [
                    u["tenant"],
                    u["model"] or "-",
                    u["job"] or "-",
                    _n(u["chunks"]),
                    _n(u["tokens"]),
                    f"{u['model_seconds']:,.1f}",
                    _n(u["dead"]),
                ]
            )
        lines += [*_table(rows, right={3, 4, 5, 6}), ""]
    return lines


def _render_partitions(partitions: list[dict[str, Any]]) -> list[str]:
    rows = [["partition", "key", "node", "length", "lag", "pending", "consumers", "rate"]]
    for p in partitions:
        rows.append(
            [
                str(p["partition"]),
                p["key"],
                p["node"] or "-",
                _n(p["length"]),
                _n(p["lag"]),
                _n(p["pending"]),
                _n(p["consumers"]),
                "-" if p["per_s"] is None else f"{p['per_s']:,.1f}/s",
            ]
        )
    return [*_table(rows, right={3, 4, 5, 6, 7}), ""]


def _render_consumers(streams: dict[str, Any], shown: int) -> list[str]:
    # One row per consumer name: a worker reads both input streams under the same name.
    merged: dict[str, dict[str, Any]] = {}
    for name in INPUT_STREAMS:
        for c in streams[name]["consumers"]:
            row = merged.setdefault(
                c["name"], {"ingest": 0, "query": 0, "idle_ms": None, "inactive_ms": None}
            )
            row[name] = c["pending"]
            for key in ("idle_ms", "inactive_ms"):
                if c[key] is not None:
                    row[key] = c[key] if row[key] is None else min(row[key], c[key])
    if not merged:
        return ["consumers  none yet (no worker has read from the group)", ""]
    ordered = sorted(merged.items(), key=lambda item: (item[1]["idle_ms"] or 0, item[0]))
    rows = [["consumer", "pending ingest", "pending query", "idle", "inactive"]]
    for consumer, row in ordered[:shown]:
        rows.append(
            [
                consumer,
                _n(row["ingest"]),
                _n(row["query"]),
                human_duration(row["idle_ms"] / 1000),
                "-" if row["inactive_ms"] is None else human_duration(row["inactive_ms"] / 1000),
            ]
        )
    lines = _table(rows, right={1, 2, 3, 4})
    if len(ordered) > shown:
        rest = ordered[shown:]
        pending = sum(r["ingest"] + r["query"] for _, r in rest)
        lines.append(
            f"... and {len(rest)} more, idle longer, holding {pending:,} pending (--json lists all)"
        )
    return [*lines, ""]


def _render_cache(cache: dict[str, Any] | None) -> list[str]:
    """One line: the vector cache's hits, misses, tokens saved and size against its bound."""
    if not cache or not cache.get("max_mb"):
        return ["vector cache  off (EMBEDFLEET_VECTOR_CACHE_MB=0): every chunk is embedded", ""]
    if "hits" not in cache:
        return []
    ratio = "" if cache["hit_ratio"] is None else f" ({cache['hit_ratio']:.1%} hits)"
    return [
        f"vector cache  {_n(cache['hits'])} hits, {_n(cache['misses'])} misses{ratio}, "
        f"{_n(cache['tokens_saved'])} tokens saved; {cache['bytes'] / 1e6:,.1f} of "
        f"{cache['max_mb']:,} MB, {_n(cache['evicted'])} evicted",
        "",
    ]


def _render_jobs(jobs: list[dict[str, Any]], shown: int) -> list[str]:
    if not jobs:
        return ["jobs  none recorded", ""]
    # Unfinished first, most remaining first: those are what an operator is waiting for.
    ordered = sorted(jobs, key=lambda j: (j["remaining"] == 0, -j["remaining"], j["job"]))
    rows = [["job", "enqueued", "done", "dead", "remaining", "cache hits", "tokens saved"]]
    rows += [
        [
            j["job"],
            _n(j["enqueued"]),
            _n(j["done"]),
            _n(j["dead"]),
            _n(j["remaining"]),
            _n(j.get("cache_hits", 0)),
            _n(j.get("tokens_saved", 0)),
        ]
        for j in ordered[:shown]
    ]
    lines = _table(rows, right={1, 2, 3, 4, 5, 6})
    if len(ordered) > shown:
        lines.append(f"... and {len(ordered) - shown} more jobs (--json lists all)")
    return [*lines, ""]


# --- the command ----------------------------------------------------------------------
@click.command("status")
@click.option("--watch", is_flag=True, help="Refresh every --interval seconds until Ctrl-C.")
@seconds_option(
    "--interval", minimum=0.1, default=2.0, help="With --watch: seconds between refreshes."
)
@seconds_option(
    "--sample",
    default=3.0,
    help="Without --watch: seconds between the two snapshots that measure throughput "
    "(0: one snapshot, no throughput).",
)
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print one JSON object (with --watch: one per line per refresh).",
)
@redis_url_option
def status_command(
    watch: bool, interval: float, sample: float, as_json: bool, redis_url: str | None
) -> None:
    """Show the backlog, consumers, throughput and jobs of a fleet.

    Per stream (ingest, query, results, dead): length; for the input streams the consumer
    group's lag (entries not yet delivered) and pending (delivered, not acknowledged); every
    consumer with its pending entries and idle time; throughput (entries finished per second,
    from the group's counters sampled over time: over the last minute with --watch) and the
    time to drain the backlog at that rate; job progress; the latest dead letters. Where the
    namespace serves several models, a row per model (--json: ``models``, with its jobs).
    """
    settings = verb_settings(redis_url)
    # Ctrl-C is how --watch is meant to end: no traceback, exit status 0. (--watch installs
    # its own handlers; this covers a Ctrl-C before they are in place.)
    with contextlib.suppress(KeyboardInterrupt):
        run_client(
            _status(settings, watch=watch, interval=interval, sample=sample, as_json=as_json)
        )


async def _status(
    settings: Settings, *, watch: bool, interval: float, sample: float, as_json: bool
) -> None:
    client = connect_client_settings(settings, socket_connect_timeout=5, socket_timeout=10)
    try:
        if not watch:
            first = await _snapshot_or_fail(client, settings)
            first_models = await _or_fail(settings, take_model_snapshots(client, settings.keys))
            eviction = await _or_fail(settings, check_eviction_policy(client))
            rate = None
            latest, latest_models = first, first_models
            if sample > 0:
                await asyncio.sleep(sample)
                latest = await _snapshot_or_fail(client, settings)
                latest_models = await _or_fail(
                    settings, take_model_snapshots(client, settings.keys)
                )
                rate = throughput(first, latest)
            models = rated_models(first_models if sample > 0 else {}, latest_models)
            _emit(report(latest, rate, settings, eviction=eviction, models=models), as_json)
            return
        # Ctrl-C (or SIGTERM) ends the watch through handlers of its own. asyncio.run's
        # KeyboardInterrupt alone was not enough: a process started with SIGINT ignored (a
        # background job of a non-interactive shell, `make test &`, some CI runners) inherits
        # SIG_IGN, asyncio then installs nothing, and Ctrl-C never stopped the watch.
        ended = _end_on_signals(asyncio.current_task())
        try:
            await _watch(client, settings, interval, as_json)
        except asyncio.CancelledError:
            if not ended.is_set():
                raise
    finally:
        await client.aclose()


async def _watch(
    client: aioredis.Redis, settings: Settings, interval: float, as_json: bool
) -> None:
    # Keep watching through an outage (the point of --watch is to see it end): say once on
    # stderr that Redis is away and when it is back; give up after EMBEDFLEET_REDIS_RETRY_S.
    retry = RedisRetry(
        redact_url(settings.effective_redis_url), settings.redis_retry_s, StderrNotice()
    )
    history = History()
    histories = ModelHistories()
    trend = Trend()  # the last minutes as sparklines, below the text view
    eviction = await retry.call(
        "check Redis's eviction policy", lambda: check_eviction_policy(client)
    )
    while True:
        snapshot = await retry.call(
            "read the fleet's state", lambda: take_snapshot(client, settings.keys)
        )
        history.add(snapshot)
        rate = history.throughput()
        models = histories.add(
            await retry.call(
                "read the models' state", lambda: take_model_snapshots(client, settings.keys)
            )
        )
        data = report(
            snapshot, rate, settings, measuring=rate is None, eviction=eviction, models=models
        )
        trend.add(snapshot.monotonic, data)
        if not as_json and sys.stdout.isatty():
            click.clear()
        _emit(data, as_json)
        if not as_json:
            click.echo("\n" + "\n".join(trend.lines(snapshot.monotonic)))
            click.echo(f"\nrefreshing every {interval:g}s; Ctrl-C to stop")
        await asyncio.sleep(interval)


def _end_on_signals(task: asyncio.Task[Any] | None) -> asyncio.Event:
    """SIGINT and SIGTERM cancel ``task`` (the watch), whatever their inherited disposition;
    the event returned tells that cancellation from any other."""
    loop = asyncio.get_running_loop()
    ended = asyncio.Event()

    def end(signum: signal.Signals) -> None:
        for each in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(each)  # a second Ctrl-C gets Python's default
        ended.set()
        if task is not None:
            task.cancel(msg=f"watch ended by {signum.name}")

    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, end, signum)
    return ended


async def _snapshot_or_fail(client: aioredis.Redis, settings: Settings) -> Snapshot:
    return await _or_fail(settings, take_snapshot(client, settings.keys))


async def _or_fail(settings: Settings, reading: Awaitable[T]) -> T:
    try:
        return await reading
    except (RedisError, OSError) as error:
        raise click.ClickException(_error_text(settings, error)) from None


def _error_text(settings: Settings, error: BaseException) -> str:
    return (
        f"cannot read the fleet's state from Redis at {redact_url(settings.effective_redis_url)}: "
        f"{type(error).__name__}: {error}. Set EMBEDFLEET_REDIS_URL (or --redis-url)."
    )


def _emit(data: dict[str, Any], as_json: bool) -> None:
    click.echo(json.dumps(data) if as_json else render(data))
