"""The load scenarios' charts (loadtest/plots.py) and the ones docs/BENCHMARKS.md shows: real
PNG files of the size the docs lay out, with something drawn in them."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from loadtest.plots import FIGURE_PX, plot_cluster, plot_latency_cdf, plot_soak, plot_throughput
from tests.paths import REPO_ROOT

DOCS = REPO_ROOT / "docs"
# chart file -> the scenario whose --plot draws it
DOCS_CHARTS = {
    "bench-throughput.png": "loadtest.bench",
    "latency-cdf.png": "loadtest.latency",
    "soak.png": "loadtest.soak",
    "cluster.png": "loadtest.cluster",
}


def assert_real_chart(path: Path) -> None:
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    with Image.open(path) as image:
        image.verify()  # checks every chunk's CRC: a truncated or corrupt file fails here
    with Image.open(path) as image:
        assert image.format == "PNG" and image.size == FIGURE_PX
        pixels = np.asarray(image.convert("RGB")).reshape(-1, 3)
    colours = np.unique(pixels, axis=0)
    # axes, text, bars or lines: a blank or single-colour canvas has a handful at most
    assert len(colours) > 50, f"{path} looks empty ({len(colours)} colours)"


def test_throughput_chart(tmp_path: Path) -> None:
    rows = [
        {"name": "st encode(32)", "precision": "fp32", "texts_per_s": 80.0, "ratio": 1.0,
         "min_cosine_vs_st": None, "rates": [78.0, 82.0]},
        {"name": "fleet fp32", "precision": "fp32", "texts_per_s": 120.0, "ratio": 1.5,
         "min_cosine_vs_st": 0.99999, "rates": [118.0, 121.0]},
        {"name": "fleet auto", "precision": "bf16", "texts_per_s": 190.0, "ratio": 2.4,
         "min_cosine_vs_st": 0.9990, "rates": [185.0, 195.0]},
    ]  # fmt: skip
    assert_real_chart(plot_throughput(rows, tmp_path / "bench.png", "test machine"))


def test_latency_chart(tmp_path: Path) -> None:
    rng = np.random.default_rng(0)
    samples = {
        "bare in-process forward": rng.gamma(4, 0.001, 100),
        "idle, 1 at a time": rng.gamma(4, 0.0015, 100),
        "saturated, 1 at a time": rng.gamma(4, 0.01, 100),
    }
    assert_real_chart(plot_latency_cdf(samples, tmp_path / "latency.png", "test", 120.0))


def test_soak_chart(tmp_path: Path) -> None:
    samples = [
        {"seconds": t, "done": 10 * t, "rss_mib": 400 + (t % 7), "backlog": max(0, 2000 - 10 * t)}
        for t in range(0, 200, 2)
    ]
    assert_real_chart(plot_soak(samples, tmp_path / "soak.png", "test", [1000, 2000]))


def test_cluster_chart(tmp_path: Path) -> None:
    dims = (384, 768)
    figures = {
        "enqueue_per_s": 20_000, "enqueue_wait1_per_s": 18_000, "read_per_s": 35_000,
        "write_dim384_per_s": 12_000, "write_dim768_per_s": 9_000,
        "bytes_per_backlog_entry": 460, "bytes_per_result_dim384": 1_020,
        "bytes_per_result_dim768": 1_900,
    }  # fmt: skip
    assert_real_chart(plot_cluster(figures, tmp_path / "cluster.png", "test", dims))


@pytest.mark.parametrize(("chart", "scenario"), DOCS_CHARTS.items())
def test_benchmarks_doc_shows_each_chart_and_the_command_that_drew_it(
    chart: str, scenario: str
) -> None:
    assert_real_chart(DOCS / chart)
    benchmarks = (DOCS / "BENCHMARKS.md").read_text()
    assert f"]({chart})" in benchmarks, f"BENCHMARKS.md does not show {chart}"
    command = re.search(rf"python -m {re.escape(scenario)} [^`\n]*--plot docs/{chart}", benchmarks)
    assert command, f"BENCHMARKS.md does not name the command that draws {chart}"
