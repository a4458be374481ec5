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
  core busy (its tokenizer thread sets the pace);
- result bandwidth = F × result payload bytes (fp16: 2 bytes per dimension plus the envelope),
  and with the Redis sink the results stream grows by the measured bytes per stored result until
  a reader trims it (a vector database sink stores nothing in Redis).

The per-shard figures default to the ones measured by ``python -m loadtest.cluster`` and quoted
in docs/SCALING.md; ``--figures`` reads another run's ``--json`` output.
"""

from __future__ import annotations

import itertools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

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
}
# `python -m loadtest.host_pipeline --texts 10000 --rounds 3 --processes 1,2` (issue 29;
# docs/BENCHMARKS.md, "Host pipeline"): the worker with the stand-in encoder at zero cost on the
# benchmark corpus (~64 tokens a text), one process, on the same 2-core AMD EPYC VM under load
# from other jobs (load ~7), so floors. One place for these figures: the plan uses them and
# docs/BENCHMARKS.md quotes them; `--figures` with a host_pipeline run's keys overrides them.
HOST_FIGURES: dict[str, float] = {
    # texts/s one worker process carries around the model (1 process, path "after")
    "host_texts_per_s_per_process": 6_158,
    # the same divided by the cores that process keeps busy (all its threads; Redis not counted)
    "host_texts_per_core_s": 8_554,
    # the raw tokenizer alone on one thread, same texts, per CPU second: the floor compared with
    "tokenizer_texts_per_core_s": 14_135,
}
ENVELOPE_BYTES = 80  # a result's msgpack fields besides the vector (id, model, dim, dtype, ...)


@dataclass(frozen=True)
class Plan:
    fleet_per_s: float
    hours_to_drain: float
    shards: int
    shard_seconds_per_chunk: float
    peak_backlog: int
    backlog_gib: float
    result_mb_per_s: float
    results_gib: float
    per_shard_backlog_gib: float
    host_cores_per_worker: int
    host_processes_per_worker: int


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
    return Plan(
        fleet_per_s=fleet,
        hours_to_drain=chunks / fleet / 3600,
        shards=shards,
        shard_seconds_per_chunk=shard_seconds,
        peak_backlog=peak_backlog,
        backlog_gib=peak_backlog * entry_bytes / 2**30,
        result_mb_per_s=fleet * result_payload / 1e6,
        results_gib=chunks * result_bytes / 2**30,
        per_shard_backlog_gib=peak_backlog * entry_bytes / 2**30 / shards,
        host_cores_per_worker=math.ceil(
            texts_per_s_per_worker / _host_figure(figures, "host_texts_per_core_s")
        ),
        host_processes_per_worker=math.ceil(
            texts_per_s_per_worker / _host_figure(figures, "host_texts_per_s_per_process")
        ),
    )


def _host_figure(figures: dict[str, Any], name: str) -> float:
    """A host pipeline figure: the given figures' (a host_pipeline run), else HOST_FIGURES."""
    return float(figures.get(name, HOST_FIGURES[name]))


def render(plan: Plan, *, chunks: float, dim: int, workers: int, rate: float) -> str:
    return "\n".join(
        [
            f"{chunks:,.0f} chunks, dim {dim}, {workers} workers × {rate:,.0f} texts/s",
            f"fleet rate        {plan.fleet_per_s:,.0f} chunks/s",
            f"time to drain     {plan.hours_to_drain:,.2f} h",
            f"shards needed     {plan.shards} (each busy "
            f"{plan.shard_seconds_per_chunk * 1e6:,.1f} µs per chunk: enqueue + read + write-back;"
            " EMBEDFLEET_PARTITIONS >= shards)",
            f"peak backlog      {plan.peak_backlog:,} entries = {plan.backlog_gib:,.1f} GiB "
            f"({plan.per_shard_backlog_gib:,.2f} GiB per shard; bounded by "
            "EMBEDFLEET_BACKLOG_HIGH_WATER per partition)",
            f"host per worker   {plan.host_cores_per_worker} cores and "
            f"{plan.host_processes_per_worker} worker processes (EMBEDFLEET_REPLICAS) to feed "
            f"{rate:,.0f} texts/s: tokenizing, decoding, packing and writing around the model "
            "(docs/BENCHMARKS.md, host pipeline)",
            f"result bandwidth  {plan.result_mb_per_s:,.0f} MB/s of fp16 results",
            f"results in Redis  {plan.results_gib:,.0f} GiB if all kept on the results stream "
            "(Redis sink, never trimmed); 0 with a vector database sink",
        ]
    )


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
@click.option(
    "--figures",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
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
    default=1_000_000,
    show_default=True,
    help="EMBEDFLEET_BACKLOG_HIGH_WATER (per partition).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
def plan_command(
    chunks: float,
    dim: int,
    rate: float,
    workers: int,
    figures: Path | None,
    shard_utilization: float,
    high_water: int,
    as_json: bool,
) -> None:
    """Shards, time, memory and bandwidth for embedding CHUNKS with WORKERS workers.

    Example: embedfleet plan --chunks 1e9 --dim 1024 --texts-per-second-per-worker 15000
    --workers 8
    """
    if chunks <= 0 or rate <= 0 or workers <= 0:
        raise click.BadParameter("chunks, rate and workers must be positive")
    loaded = MEASURED_FIGURES if figures is None else json.loads(figures.read_text())
    result = make_plan(
        chunks=chunks,
        dim=dim,
        texts_per_s_per_worker=rate,
        workers=workers,
        figures=loaded,
        shard_utilization=shard_utilization,
        high_water=high_water,
    )
    if as_json:
        click.echo(json.dumps(result.__dict__))
    else:
        click.echo(render(result, chunks=chunks, dim=dim, workers=workers, rate=rate))
