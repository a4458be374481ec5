"""workers/metrics.py: each worker's metrics in a registry of its own, with every label value
present from the start, fed by the worker's events (the stream gauges against Redis:
tests/end_to_end/test_ops.py)."""

from __future__ import annotations

import math

import pytest
from prometheus_client import CollectorRegistry, Counter

from embedfleet.workers.metrics import MetricSpec, WorkerMetrics


def value(metrics: WorkerMetrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(f"embedfleet_{name}", labels)


def test_two_workers_in_one_process_count_apart() -> None:
    first, second = WorkerMetrics(model="a"), WorkerMetrics(model="b")
    first.results_written(texts=3, seconds=0.1)
    assert value(first, "texts_embedded_total", model="a") == 3
    assert value(second, "texts_embedded_total", model="b") == 0


def test_every_label_value_exists_before_anything_happened() -> None:
    metrics = WorkerMetrics(model="m")
    assert value(metrics, "dead_letters_total", model="m", reason="invalid") == 0
    assert value(metrics, "outages", system="qdrant") == 0
    assert math.isnan(value(metrics, "stream_lag", model="m", stream="ingest") or 0.0)


def test_batches_feed_the_counters_and_the_padding_ratio() -> None:
    metrics = WorkerMetrics(model="m")
    assert metrics.last_forward_at is None
    metrics.batch_encoded(texts=2, real_tokens=30, padded_tokens=40, seconds=0.25)
    assert value(metrics, "tokens_embedded_total", model="m") == 30
    assert value(metrics, "padded_tokens_total") == 40
    assert value(metrics, "batches_total") == 1
    assert value(metrics, "padding_ratio") == pytest.approx(0.25)
    assert metrics.last_forward_at is not None, "proof for /readyz that the device works"


def test_faults_outages_and_dead_letters_are_counted_by_their_labels() -> None:
    metrics = WorkerMetrics(model="m")
    metrics.transient_fault(system="redis", doing="reading")
    metrics.outage(system="redis", active=True)
    metrics.dead_lettered(count=2, reason="too_long")
    metrics.sink_error(error=TimeoutError(), kind="transient")
    assert value(metrics, "transient_faults_total", system="redis") == 1
    assert value(metrics, "outages", system="redis") == 1
    assert value(metrics, "dead_letters_total", model="m", reason="too_long") == 2
    assert value(metrics, "sink_errors_total", error="TimeoutError", kind="transient") == 1
    metrics.outage(system="redis", active=False)
    assert value(metrics, "outages", system="redis") == 0


def test_the_worker_reported_busy_fraction_wins() -> None:
    metrics = WorkerMetrics()
    metrics.model_busy(fraction=0.75)
    assert value(metrics, "model_busy_fraction") == 0.75


def test_buckets_are_for_histograms_only() -> None:
    spec = MetricSpec(Counter, "odd", "a counter with buckets", buckets=(1.0,))
    with pytest.raises(TypeError, match="buckets are for histograms only"):
        spec.register(CollectorRegistry())
