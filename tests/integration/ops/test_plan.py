"""`embedfleet plan`: the capacity arithmetic, checked by hand, and the command."""

from __future__ import annotations

import json
import math

import pytest
from click.testing import CliRunner

from embedfleet.cli import main
from embedfleet.ops.plan import HOST_FIGURES, make_plan
from embedfleet.workers.replicas import replicas_for

FIGURES = {
    "enqueue_per_s": 50_000,
    "read_per_s": 200_000,
    "write_dim384_per_s": 40_000,
    "write_dim1024_per_s": 20_000,
    "bytes_per_backlog_entry": 1_000,
    "bytes_per_result_dim384": 1_000,
    "bytes_per_result_dim1024": 2_200,
    "host_texts_per_core_s": 4_000,
    "host_texts_per_s_per_process": 3_000,
}

# docs/SCALING.md's case: a billion chunks at dim 1024 on 8 workers of 15,000 texts/s
BILLION_CHUNKS = [
    "--chunks", "1e9", "--dim", "1024", "--texts-per-second-per-worker", "15000", "--workers", "8"
]  # fmt: skip


def test_the_plan_is_the_documented_arithmetic() -> None:
    plan = make_plan(
        chunks=1e9, dim=1024, texts_per_s_per_worker=15_000, workers=8, figures=FIGURES
    )
    assert plan.fleet.chunks_per_s == 120_000
    assert plan.fleet.hours_to_drain == pytest.approx(1e9 / 120_000 / 3600)
    busy = 1 / 50_000 + 1 / 200_000 + 1 / 20_000  # seconds of one shard per chunk
    assert plan.shard_seconds_per_chunk == pytest.approx(busy)
    assert plan.shards == math.ceil(120_000 * busy / 0.5) == 18
    assert plan.redis.backlog.entries == 18 * 1_000_000  # high water per partition, one per shard
    assert plan.redis.backlog.gib == pytest.approx(18e9 / 2**30)
    assert plan.fleet.result_mb_per_s == pytest.approx(120_000 * (1024 * 2 + 80) / 1e6)
    assert plan.redis.results.gib == pytest.approx(1e9 * 2_200 / 2**30)
    # the host around the model (issue 29): 15,000 texts/s at 4,000 a core, 3,000 a process
    assert (plan.host.cores_per_worker, plan.host.processes_per_worker) == (4, 5)
    # EMBEDFLEET_REPLICAS=auto runs 5 processes on a GPU pod of 8 CPUs (one per 1.5, rounded down)
    assert plan.host.cpus_for_auto_replicas == 8
    assert replicas_for("auto", on_cuda=True, cpus=8) == 5, "the worker's own rule"


def test_host_figures_default_to_the_measured_ones() -> None:
    cluster_only = {k: v for k, v in FIGURES.items() if not k.startswith("host_")}
    plan = make_plan(
        chunks=1e6, dim=384, texts_per_s_per_worker=40_000, workers=1, figures=cluster_only
    )
    assert plan.host.cores_per_worker == math.ceil(40_000 / HOST_FIGURES["host_texts_per_core_s"])


def test_dimensions_between_the_measured_ones_are_interpolated() -> None:
    mid = make_plan(chunks=1e6, dim=704, texts_per_s_per_worker=1, workers=1, figures=FIGURES)
    # halfway between 384 and 1024: write rate 30,000/s, 1,600 bytes per stored result
    assert mid.redis.results.gib == pytest.approx(1e6 * 1_600 / 2**30)
    assert mid.shard_seconds_per_chunk == pytest.approx(1 / 50_000 + 1 / 200_000 + 1 / 30_000)


def test_a_small_run_fits_one_shard_and_its_whole_backlog_counts() -> None:
    plan = make_plan(chunks=10_000, dim=384, texts_per_s_per_worker=100, workers=2, figures=FIGURES)
    assert (plan.shards, plan.redis.backlog.entries) == (1, 10_000)


def test_the_command() -> None:
    result = CliRunner().invoke(main, ["plan", *BILLION_CHUNKS])
    assert result.exit_code == 0, result.output
    assert "120,000 chunks/s" in result.output and "2.31 h" in result.output
    assert "worker processes (EMBEDFLEET_REPLICAS) to feed 15,000 texts/s" in result.output
    assert "shards needed" in result.output and "GiB" in result.output


def test_the_json_keeps_its_flat_names() -> None:
    """The figures are grouped in records; `plan --json` prints them under their flat names."""
    result = CliRunner().invoke(main, ["plan", *BILLION_CHUNKS, "--json"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output)
    assert list(plan) == [
        "fleet_per_s", "hours_to_drain", "shards", "shard_seconds_per_chunk", "peak_backlog",
        "backlog_gib", "result_mb_per_s", "results_gib", "per_shard_backlog_gib",
        "inflight_entries", "inflight_gib", "results_entries", "job_ids_gib",
        "host_cores_per_worker", "host_processes_per_worker", "host_cpus_for_auto_replicas",
        "redis_gib",
    ]  # fmt: skip
    assert plan["per_shard_backlog_gib"] == plan["backlog_gib"] / plan["shards"]
    assert plan["redis_gib"] == (
        plan["backlog_gib"] + plan["inflight_gib"] + plan["results_gib"] + plan["job_ids_gib"]
    )


def test_redis_memory_counts_in_flight_bounded_results_and_job_ids() -> None:
    """The results stream holds at most EMBEDFLEET_RESULTS_MAX_ENTRIES per partition (one per
    shard), each worker two reads in flight, and a running job one id record per chunk."""
    figures = FIGURES | {"bytes_per_pending_entry": 100, "bytes_per_job_id": 64}
    plan = make_plan(
        chunks=1e9,
        dim=1024,
        texts_per_s_per_worker=15_000,
        workers=8,
        figures=figures,
        results_max_entries=500_000,
        read_count=8192,
    )
    assert plan.redis.results.entries == 18 * 500_000
    assert plan.redis.results.gib == pytest.approx(18 * 500_000 * 2_200 / 2**30)
    assert plan.redis.inflight.entries == 2 * 8192 * 8
    assert plan.redis.inflight.gib == pytest.approx(2 * 8192 * 8 * (1_000 + 100) / 2**30)
    assert plan.redis.job_ids_gib == pytest.approx(1e9 * 64 / 2**30)
    redis = plan.redis
    assert redis.gib == pytest.approx(
        redis.backlog.gib + redis.inflight.gib + redis.results.gib + redis.job_ids_gib
    )


async def test_entry_sizes_are_measured_on_the_redis_at_hand(client, settings) -> None:
    """MEMORY USAGE of sample keys (and used_memory for the pending list), the keys deleted."""
    from embedfleet.ops.plan import measure_entry_sizes

    sizes = await measure_entry_sizes(client, settings.namespace, dim=384, text_chars=500)
    assert 500 < sizes["bytes_per_backlog_entry"] < 1_500  # the payload and its overhead
    assert 2 * 384 < sizes["bytes_per_result_dim384"] < 2_000
    assert 20 < sizes["bytes_per_job_id"] < 200 and 0 < sizes["bytes_per_pending_entry"] < 400
    assert not [key async for key in client.scan_iter(match=f"{settings.namespace}:*")]


def test_the_command_measures_with_measure(settings) -> None:
    result = CliRunner().invoke(
        main,
        [
            "plan", "--chunks", "1e7", "--texts-per-second-per-worker", "1000", "--workers",
            "2", "--measure", "--redis-url", settings.effective_redis_url, "--json",
        ],
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    plan = json.loads(result.output.splitlines()[-1])
    assert plan["redis_gib"] > plan["backlog_gib"] > 0 and plan["job_ids_gib"] > 0
