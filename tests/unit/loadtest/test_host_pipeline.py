"""loadtest/host_pipeline.py's pure parts: the 2 ÷ 1 core ratio read round by round, and its
bound where redis-server shares the worker's two cores; the A/B variants' configurations
(issue 53)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from loadtest.host_pipeline import Config, core_scaling, main


def config(rounds: list[float], **figures: float) -> dict[str, object]:
    return {"rounds": rounds, **figures}


def test_the_core_ratio_is_read_round_by_round_and_bounded_by_redis_share() -> None:
    one = config([10_000.0, 8_000.0, 12_000.0])
    # the guest drifts between rounds: each round's pair moves together
    two = config(
        [15_000.0, 12_800.0, 18_000.0],
        texts_per_core_s=10_000.0,  # the worker: 100 µs of CPU a text
        redis_us_per_text=25.0,
        redis_cores=0.375,
        cores_per_process=1.5,
    )
    line = core_scaling(one, two)
    assert "per round 1.50, 1.60, 1.50 (median 1.50)" in line
    # 2 · 100 / (100 + 25)
    assert "the worker 100 µs of CPU a text, redis-server 25 µs (0.38 cores, on any CPU)" in line
    assert "bound 1.60 with both cores used, 94% of them used" in line


def test_rounds_of_unequal_count_are_refused() -> None:
    one = config([10_000.0])
    two = config(
        [15_000.0, 14_000.0],
        texts_per_core_s=1.0,
        redis_us_per_text=1.0,
        redis_cores=0.1,
        cores_per_process=1.0,
    )
    with pytest.raises(ValueError):
        core_scaling(one, two)


def test_with_redis_beside_the_worker_both_runs_pay_it_and_the_bound_is_two() -> None:
    one = config([10_000.0])
    two = config(
        [17_000.0],
        texts_per_core_s=10_000.0,
        redis_us_per_text=25.0,
        redis_cores=0.2,
        cores_per_process=1.6,
    )
    line = core_scaling(one, two, redis_beside=True)
    assert "per round 1.70 (median 1.70)" in line
    assert "(0.20 cores, on the worker's cores in each run): bound 2.00" in line
    assert "90% of them used" in line


def test_each_variant_is_told_apart_from_its_worker_twin() -> None:
    worker = Config(1, "after", 2)
    python = Config(1, "after", 2, variant="python-collector")
    one = Config(1, "after", 2, variant="one-opening")
    assert worker.label == "1 process, after, 2 cores"
    assert python.label == "1 process, after, 2 cores, Python's collector"
    assert one.label == "1 process, after, 2 cores, one opening at a time"
    assert len({worker, python, one}) == 3  # each keeps its own runs


def test_an_unknown_variant_is_refused_before_anything_runs() -> None:
    result = CliRunner().invoke(main, ["--variants", "worker,gc"])
    assert result.exit_code == 2
    assert "'worker,gc': name one or more of worker, python-collector, one-opening" in (
        result.output
    )
