"""`embedfleet plan`: how many shards, how long, how much memory and bandwidth for a run.

The arithmetic is simple on purpose, so that it can be checked by hand (docs/SCALING.md works
the seed's billion-chunk case through it):

- fleet rate F = workers × texts/s per worker; hours to drain = chunks / F / 3600;
- every chunk costs its shard one enqueue, one bulk read and one result write-back. A shard
  that does E enqueues, B reads or W write-backs per second when doing only that is busy
  1/E + 1/B + 1/W seconds per chunk, so F chunks/s need F × (1/E + 1/B + 1/W) shards at full
  load; the plan keeps each shard at most ``--shard-utilization`` busy (default 0.5: headroom for
  reclaims, bursts and a failover);
- the backlog is bounded by backpressure: producers wait while a partition holds
  EMBEDFLEET_BACKLOG_HIGH_WATER entries, so at most ``high_water × partitions`` chunks wait, at
  the measured bytes per entry;
- host cores per worker (GPU) = its texts/s ÷ the texts/s one host core carries through the
  worker's pipeline around the model (read, decode, tokenize, plan, collate, cast, pack, write:
  ``python -m loadtest.host_pipeline``, issue 29), and worker processes per GPU
  (EMBEDFLEET_REPLICAS) = its texts/s ÷ one process's rate, since one process keeps about one
  core busy (its tokenizer thread sets the pace); EMBEDFLEET_REPLICAS=auto runs one process per
  1.5 of a GPU pod's CPUs (workers/replicas.py), so the pod's CPUs that make `auto` pick that
  many = processes × 1.5, rounded up;
- in-flight entries: each worker holds about two reads (``--read-count`` entries each: one
  window being computed, one queued) pending in the group, at the bytes of a backlog entry plus
  the bytes of its pending-list record;
- result bandwidth = F × result payload bytes (fp16: 2 bytes per dimension plus the envelope);
  with the Redis sink each partition's results stream holds at most
  EMBEDFLEET_RESULTS_MAX_ENTRIES results (workers wait at the bound until a consuming reader
  drains it), so at most ``results_max × partitions`` results at the bytes per stored result
  (0: no bound, the whole run; a vector database sink stores nothing in Redis);
- job id records: one field per chunk of a running job (the id and an 8-byte digest), until
  EMBEDFLEET_JOB_IDS_FINISHED_TTL_S after the job finishes: the whole run's chunks if it is one
  job (enqueue in smaller jobs, or without a job, to bound it).

Redis memory is the sum. ``--measure`` measures the bytes per entry of each kind on the Redis at
hand (``MEMORY USAGE`` of sample keys written to a scratch namespace, then deleted) instead of
taking the figures' ones.

The per-shard figures default to the ones measured by ``python -m loadtest.cluster`` and quoted
in docs/SCALING.md; ``--figures`` reads another run's ``--json`` output.
"""

from __future__ import annotations

import itertools
import json
import math
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import numpy as np
import redis.asyncio as aioredis

from embedfleet.ops.waiting import (
    client_for,
    count_option,
    input_file_option,
    redis_url_option,
    run_client,
    verb_settings,
)
from embedfleet.producer.enqueue import new_call_token, payload_digest
from embedfleet.shared.keys import Keys
from embedfleet.shared.protocol import PAYLOAD_FIELD, Chunk, Result, encode_chunk, encode_result
from embedfleet.shared.redis_conn import redact_url
from embedfleet.shared.settings import AUTO_BATCHING, Settings

# `python -m loadtest.cluster --entries 12000` on the 2-core AMD EPYC VM at load ~20 (shared with
# other jobs): one Python client per shard, so floors (docs/SCALING.md)
MEASURED_FIGURES: dict[str, Any] = {
    "enqueue_per_s": 18_983,
    "enqueue_wait1_per_s": 21_109,
    "read_per_s": 38_841,
    "write_dim384_per_s": 23_502,
    "write_dim768_per_s": 14_417,
    "write_dim1024_per_s": 13_514,
    "bytes_per_backlog_entry": 458,
    "result_dim384_payload_bytes": 833,
    "result_dim768_payload_bytes": 1_601,
    "result_dim1024_payload_bytes": 2_113,
    "bytes_per_result_dim384": 1_018,
    "bytes_per_result_dim768": 1_895,
    "bytes_per_result_dim1024": 2_675,
    # `embedfleet plan --measure` on redis-server 7.0.15 (ids of 13 characters; a record is the
    # payload digest and the enqueue call token, 16 bytes)
    "bytes_per_pending_entry": 110,
    "bytes_per_job_id": 80,
}
# `python -m loadtest.host_pipeline --texts 10000 --rounds 3 --processes 1,2` (issue 29;
# docs/BENCHMARKS.md, "Host pipeline"): the worker with the stand-in encoder at zero cost on the
# benchmark corpus (~64 tokens a text), one process, on a quiet 2-core AMD EPYC Zen 4 VM (stop
# 35; a Zen 5 under load ~7 read 6,158 / 8,554 / 14,135: its cores are faster, so the lower,
# Zen 4 figures are kept). One place for these figures: the plan uses them and
# docs/BENCHMARKS.md quotes them; `--figures` with a host_pipeline run's keys overrides them.
HOST_FIGURES: dict[str, float] = {
    # texts/s one worker process carries around the model (1 process, path "after")
    "host_texts_per_s_per_process": 5_592,
    # the same divided by the cores that process keeps busy (all its threads; Redis not counted)
    "host_texts_per_core_s": 4_399,
    # the raw tokenizer alone on one thread, same texts, per CPU second: the floor compared with
    "tokenizer_texts_per_core_s": 8_415,
}
ENVELOPE_BYTES = 80  # a result's msgpack fields besides the vector (id, model, dim, dtype, ...)


@dataclass(frozen=True)
class Held:
    """One kind of entry Redis holds at the peak: how many, and the memory they take."""

    entries: int
    gib: float


@dataclass(frozen=True)
class RedisMemory:
    """What the fleet keeps in Redis at the peak."""

    backlog: Held  # waiting to be read: bounded by the high water per partition
    inflight: Held  # read by the workers, pending in the group
    results: Held  # on the Redis sink's results streams
    job_ids_gib: float  # the id records of a running job, one per chunk

    @property
    def gib(self) -> float:
        """Redis memory for the fleet's entries: backlog, in flight, results, job ids."""
        return self.backlog.gib + self.inflight.gib + self.results.gib + self.job_ids_gib


@dataclass(frozen=True)
class HostNeeds:
    """The host around one worker's model: its cores and worker processes (EMBEDFLEET_REPLICAS)."""

    cores_per_worker: int
    processes_per_worker: int

    @classmethod
    def feeding(cls, texts_per_s: float, figures: dict[str, Any]) -> HostNeeds:
        """What carries a worker's texts/s through the pipeline around its model."""
        return cls(
            cores_per_worker=math.ceil(
                texts_per_s / _host_figure(figures, "host_texts_per_core_s")
            ),
            processes_per_worker=math.ceil(
                texts_per_s / _host_figure(figures, "host_texts_per_s_per_process")
            ),
        )

    @property
    def cpus_for_auto_replicas(self) -> int:
        """The CPUs a GPU pod needs for EMBEDFLEET_REPLICAS=auto to run processes_per_worker."""
        from embedfleet.workers.replicas import CORES_PER_GPU_REPLICA  # light: no torch

        return math.ceil(self.processes_per_worker * CORES_PER_GPU_REPLICA)


@dataclass(frozen=True)
class FleetRun:
    """The run's chunks as the whole fleet drains them, and the results' bandwidth."""

    chunks: float
    chunks_per_s: float
    result_mb_per_s: float

    @property
    def hours_to_drain(self) -> float:
        return self.chunks / self.chunks_per_s / 3600


@dataclass(frozen=True)
class Plan:
    """The figures of a run: the fleet's rates, the shards, Redis memory and host it needs."""

    fleet: FleetRun
    shards: int
    shard_seconds_per_chunk: float
    redis: RedisMemory
    host: HostNeeds

    @property
    def per_shard_backlog_gib(self) -> float:
        return self.redis.backlog.gib / self.shards

    def as_dict(self) -> dict[str, float]:
        """`plan --json`'s object: every figure under one flat name."""
        fleet, redis, host = self.fleet, self.redis, self.host
        return {
            "fleet_per_s": fleet.chunks_per_s,
            "hours_to_drain": fleet.hours_to_drain,
            "shards": self.shards,
            "shard_seconds_per_chunk": self.shard_seconds_per_chunk,
            "peak_backlog": redis.backlog.entries,
            "backlog_gib": redis.backlog.gib,
            "result_mb_per_s": fleet.result_mb_per_s,
            "results_gib": redis.results.gib,
            "per_shard_backlog_gib": self.per_shard_backlog_gib,
            "inflight_entries": redis.inflight.entries,
            "inflight_gib": redis.inflight.gib,
            "results_entries": redis.results.entries,
            "job_ids_gib": redis.job_ids_gib,
            "host_cores_per_worker": host.cores_per_worker,
            "host_processes_per_worker": host.processes_per_worker,
            "host_cpus_for_auto_replicas": host.cpus_for_auto_replicas,
            "redis_gib": redis.gib,
        }


def _read_figures(path: Path) -> dict[str, Any]:
    """``--figures``: a JSON object, or the verb ends as on any malformed argument."""
    try:
        figures = json.loads(path.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise click.BadParameter(f"{path} is not JSON ({error})", param_hint="--figures") from None
    if not isinstance(figures, dict):
        raise click.BadParameter(f"{path} holds no JSON object", param_hint="--figures")
    return figures


def _at_dim(figures: dict[str, Any], name: str, dim: int) -> float:
    """A per-dimension figure, interpolated linearly in the dimension between measured ones."""
    measured = sorted(
        (int(key.split("dim")[1].split("_")[0]), float(value))
        for key, value in figures.items()
        if key.startswith(name.split("{")[0] + "dim") and key.endswith(name.split("}")[1])
    )
    if not measured:
        raise click.ClickException(f"the figures have no {name} values")
    if dim <= measured[0][0]:
        low, high = measured[0], measured[min(1, len(measured) - 1)]
    elif dim >= measured[-1][0]:
        low, high = measured[max(0, len(measured) - 2)], measured[-1]
    else:
        low, high = next((a, b) for a, b in itertools.pairwise(measured) if a[0] <= dim <= b[0])
    if high[0] == low[0]:
        return low[1]
    return low[1] + (high[1] - low[1]) * (dim - low[0]) / (high[0] - low[0])


def make_plan(
    *,
    chunks: float,
    dim: int,
    texts_per_s_per_worker: float,
    workers: int,
    figures: dict[str, Any],
    shard_utilization: float = 0.5,
    high_water: int = 1_000_000,
    results_max_entries: int = 0,
    read_count: int = 8192,
) -> Plan:
    fleet = texts_per_s_per_worker * workers
    write_per_s = _at_dim(figures, "write_{dim}_per_s", dim)
    shard_seconds = (
        1 / float(figures["enqueue_per_s"]) + 1 / float(figures["read_per_s"]) + 1 / write_per_s
    )
    shards = max(1, math.ceil(fleet * shard_seconds / shard_utilization))
    # one partition per shard at least; the backlog bound grows with the partitions
    peak_backlog = int(min(chunks, high_water * shards))
    entry_bytes = float(figures["bytes_per_backlog_entry"])
    result_payload = dim * 2 + ENVELOPE_BYTES
    result_bytes = _at_dim(figures, "bytes_per_result_{dim}", dim)
    inflight = int(min(chunks, 2 * read_count * workers))
    pending_bytes = float(figures.get("bytes_per_pending_entry", 0))
    results_entries = int(
        chunks if results_max_entries <= 0 else min(chunks, results_max_entries * shards)
    )
    return Plan(
        fleet=FleetRun(
            chunks=chunks,
            chunks_per_s=fleet,
            result_mb_per_s=fleet * result_payload / 1e6,
        ),
        shards=shards,
        shard_seconds_per_chunk=shard_seconds,
        redis=RedisMemory(
            backlog=Held(peak_backlog, peak_backlog * entry_bytes / 2**30),
            inflight=Held(inflight, inflight * (entry_bytes + pending_bytes) / 2**30),
            results=Held(results_entries, results_entries * result_bytes / 2**30),
            job_ids_gib=chunks * float(figures.get("bytes_per_job_id", 0)) / 2**30,
        ),
        host=HostNeeds.feeding(texts_per_s_per_worker, figures),
    )


def _host_figure(figures: dict[str, Any], name: str) -> float:
    """A host pipeline figure: the given figures' (a host_pipeline run), else HOST_FIGURES."""
    return float(figures.get(name, HOST_FIGURES[name]))


def render(plan: Plan, *, chunks: float, dim: int, workers: int, rate: float) -> str:
    fleet, redis, host = plan.fleet, plan.redis, plan.host
    return "\n".join(
        [
            f"{chunks:,.0f} chunks, dim {dim}, {workers} workers × {rate:,.0f} texts/s",
            f"fleet rate        {fleet.chunks_per_s:,.0f} chunks/s",
            f"time to drain     {fleet.hours_to_drain:,.2f} h",
            f"shards needed     {plan.shards} (each busy "
            f"{plan.shard_seconds_per_chunk * 1e6:,.1f} µs per chunk: enqueue + read + write-back;"
            " EMBEDFLEET_PARTITIONS >= shards)",
            f"peak backlog      {redis.backlog.entries:,} entries = {redis.backlog.gib:,.1f} GiB "
            f"({plan.per_shard_backlog_gib:,.2f} GiB per shard; bounded by "
            "EMBEDFLEET_BACKLOG_HIGH_WATER per partition)",
            f"in flight         {redis.inflight.entries:,} entries = {redis.inflight.gib:,.2f} "
            "GiB (two reads per worker, pending in the group)",
            f"host per worker   {host.cores_per_worker} cores and "
            f"{host.processes_per_worker} worker processes (EMBEDFLEET_REPLICAS) to feed "
            f"{rate:,.0f} texts/s: tokenizing, decoding, packing and writing around the model "
            "(docs/BENCHMARKS.md, host pipeline); EMBEDFLEET_REPLICAS=auto runs "
            f"{host.processes_per_worker} on a GPU pod of {host.cpus_for_auto_replicas} "
            "CPUs (one per 1.5)",
            f"result bandwidth  {fleet.result_mb_per_s:,.0f} MB/s of fp16 results",
            f"results in Redis  {redis.results.entries:,} = {redis.results.gib:,.1f} GiB "
            + (
                "(Redis sink: bounded by EMBEDFLEET_RESULTS_MAX_ENTRIES per partition while a "
                "consuming reader drains; 0 with a vector database or Parquet sink)"
                if redis.results.entries < chunks
                else "(Redis sink, the whole run: nothing bounds it below the run's size; 0 with "
                "a vector database or Parquet sink)"
            ),
            f"job id records    {redis.job_ids_gib:,.1f} GiB (one per chunk of a running job, "
            "until EMBEDFLEET_JOB_IDS_FINISHED_TTL_S after it ends: enqueue in smaller jobs to "
            "bound it)",
            f"Redis memory      {redis.gib:,.1f} GiB in all (set maxmemory above it, "
            "maxmemory-policy noeviction, appendonly yes)",
        ]
    )


async def measure_entry_sizes(
    client: aioredis.Redis, namespace: str, *, dim: int, text_chars: int, samples: int = 1000
) -> dict[str, float]:
    """Bytes per backlog entry, pending entry, stored result (at ``dim``) and job id record,
    from MEMORY USAGE of sample keys in a scratch namespace (deleted after): each the growth
    from ``samples`` to twice as many entries, so a key's fixed overhead is not counted. The
    pending entry: the server's used_memory growth when the samples are read in a group."""
    keys = Keys(namespace=f"{namespace}:plan-sample-{uuid.uuid4().hex[:8]}")
    text = ("lorem ipsum dolor sit amet " * (text_chars // 27 + 1))[:text_chars]
    vector = np.linspace(-1, 1, dim).astype(np.float16)

    async def usage(key: str) -> int:
        return int(await client.memory_usage(key, samples=0) or 0)

    async def add(first: int) -> None:
        pipe = client.pipeline(transaction=False)
        for i in range(first, first + samples):
            chunk_id = f"doc-{i:08d}#0"
            chunk = Chunk(id=chunk_id, text=text, job="plan", meta={"source": "plan"})
            pipe.xadd(keys.ingest, {PAYLOAD_FIELD: encode_chunk(chunk)})
            result = Result(id=chunk_id, model="model", vector=vector, job="plan")
            pipe.xadd(keys.results, {PAYLOAD_FIELD: encode_result(result)})
            # the record's value: the payload's digest and the enqueue call's token
            record = payload_digest(encode_chunk(chunk)) + new_call_token()
            pipe.hset(keys.job_ids("plan"), chunk_id, record)
        await pipe.execute()

    measured_keys = (keys.ingest, keys.results, keys.job_ids("plan"))
    try:
        await add(0)
        before = [await usage(key) for key in measured_keys]
        await add(samples)
        after = [await usage(key) for key in measured_keys]
        # MEMORY USAGE counts a group's pending list several times over (Redis 7.0: ~550 B per
        # entry for ~85 B), so that one is the server's used_memory growth: exact on a quiet
        # server, noisy on a busy one
        await client.xgroup_create(keys.ingest, keys.group, id="0")
        used_before = int((await client.info("memory"))["used_memory"])
        await client.xreadgroup(keys.group, "plan", {keys.ingest: ">"}, count=2 * samples)
        used_after = int((await client.info("memory"))["used_memory"])
    finally:
        await client.delete(*measured_keys)
    backlog, results, job_ids = ((a - b) / samples for a, b in zip(after, before, strict=True))
    return {
        "bytes_per_backlog_entry": round(backlog),
        f"bytes_per_result_dim{dim}": round(results),
        "bytes_per_pending_entry": max(0, round((used_after - used_before) / (2 * samples))),
        "bytes_per_job_id": round(job_ids),
    }


@click.command("plan")
@click.option("--chunks", type=float, required=True, help="Chunks to embed (1e9 is accepted).")
@click.option("--dim", type=int, default=384, show_default=True, help="Vector dimension.")
@click.option(
    "--texts-per-second-per-worker",
    "rate",
    type=float,
    required=True,
    help="Measured texts/s of one worker (GPU) on your corpus.",
)
@click.option("--workers", type=int, required=True, help="Workers (GPUs) in the fleet.")
@input_file_option(
    "--figures",
    help="Per-shard figures from `python -m loadtest.cluster --json` (default: docs/SCALING.md's).",
)
@click.option(
    "--shard-utilization",
    type=click.FloatRange(0.05, 1.0),
    default=0.5,
    show_default=True,
    help="Most of a shard's capacity the plan may use.",
)
@click.option(
    "--high-water",
    type=int,
    default=Settings.model_fields["backlog_high_water"].default,
    show_default=True,
    help="EMBEDFLEET_BACKLOG_HIGH_WATER (per partition).",
)
@count_option(
    "--results-max-entries",
    minimum=0,
    default=Settings.model_fields["results_max_entries"].default,
    help="EMBEDFLEET_RESULTS_MAX_ENTRIES (per partition; 0: results kept, the whole run).",
)
@count_option(
    "--read-count",
    default=AUTO_BATCHING["cuda"].read_count,
    help="EMBEDFLEET_READ_COUNT of the workers (entries each holds, twice, in flight).",
)
@click.option(
    "--measure",
    is_flag=True,
    help="Measure the bytes per backlog entry, pending entry, result and job id on the Redis at "
    "EMBEDFLEET_REDIS_URL (MEMORY USAGE of sample keys, deleted after).",
)
@count_option(
    "--text-chars", default=500, help="With --measure: the characters of a sample chunk's text."
)
@redis_url_option
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
def plan_command(
    chunks: float,
    dim: int,
    rate: float,
    workers: int,
    figures: Path | None,
    shard_utilization: float,
    high_water: int,
    results_max_entries: int,
    read_count: int,
    measure: bool,
    text_chars: int,
    redis_url: str | None,
    as_json: bool,
) -> None:
    """Shards, time, memory and bandwidth for embedding CHUNKS with WORKERS workers.

    Example: embedfleet plan --chunks 1e9 --dim 1024 --texts-per-second-per-worker 15000
    --workers 8
    """
    if chunks <= 0 or rate <= 0 or workers <= 0:
        raise click.BadParameter("chunks, rate and workers must be positive")
    loaded = dict(MEASURED_FIGURES if figures is None else _read_figures(figures))
    if measure:
        settings = verb_settings(redis_url)
        loaded |= run_client(_measure(settings, dim, text_chars))
    result = make_plan(
        chunks=chunks,
        dim=dim,
        texts_per_s_per_worker=rate,
        workers=workers,
        figures=loaded,
        shard_utilization=shard_utilization,
        high_water=high_water,
        results_max_entries=results_max_entries,
        read_count=read_count,
    )
    if as_json:
        click.echo(json.dumps(result.as_dict()))
    else:
        click.echo(render(result, chunks=chunks, dim=dim, workers=workers, rate=rate))


async def _measure(settings: Settings, dim: int, text_chars: int) -> dict[str, float]:
    async with client_for(settings) as producer:
        sizes = await producer.retry.call(
            "measure entry sizes",
            lambda: measure_entry_sizes(
                producer.client, settings.namespace, dim=dim, text_chars=text_chars
            ),
        )
    click.echo(f"measured on {redact_url(settings.effective_redis_url)}: {sizes}", err=True)
    return sizes
