"""Charts of the load scenarios (``--plot FILE.png``): what a table hides, at a glance.

- ``loadtest.bench``: texts/s per contender, one dot per round, parity with
  sentence-transformers marked on each bar;
- ``loadtest.latency``: query latency CDFs, idle vs with the ingest stream saturated;
- ``loadtest.soak``: worker RSS over the chunks embedded, and the backlog draining over time;
- ``loadtest.cluster``: one shard's queue operations per second, and memory per entry.

matplotlib comes with the ``plot`` extra (``pip install 'embedfleet[plot]'``, in ``dev`` too);
it draws off-screen (Agg), so the scenarios run on servers without a display. Every chart is
``FIGURE_PX`` pixels, so the docs lay them out alike and a test can check the files.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from matplotlib.figure import Figure

FIGURE_PX = (1000, 500)
DPI = 100
# The parity bar of the project (docs/BENCHMARKS.md, Parity): cosine vs sentence-transformers
PARITY_MIN_COSINE = 0.9999
PARITY_OK, PARITY_LOW, PARITY_UNKNOWN = "#2a9d8f", "#e76f51", "#8d99ae"


def _figure(columns: int = 1) -> tuple[Figure, Any]:
    try:
        import matplotlib
    except ImportError:
        raise SystemExit(
            "--plot needs matplotlib: pip install 'embedfleet[plot]' (the dev extra has it)"
        ) from None
    matplotlib.use("Agg")  # files only, no display
    from matplotlib.figure import Figure

    figure = Figure(figsize=(FIGURE_PX[0] / DPI, FIGURE_PX[1] / DPI), dpi=DPI, layout="constrained")
    axes = figure.subplots(1, columns)
    return figure, axes


def _save(figure: Figure, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=DPI, format="png")  # no bbox_inches="tight": the size stays fixed
    return path


def plot_throughput(rows: Sequence[Mapping[str, Any]], path: Path, subtitle: str) -> Path:
    """Horizontal bars of median texts/s per contender (``loadtest.bench``'s rows), a dot per
    round, and each bar's min cosine vs sentence-transformers written beside it."""
    figure, axes = _figure()
    names = [f"{row['name']} ({row['precision']})" for row in rows]
    medians = [row["texts_per_s"] for row in rows]
    # the first row is the baseline the others are compared with (its cosine is to itself)
    parities = [None, *(row.get("min_cosine_vs_st") for row in rows[1:])]
    colours = [
        PARITY_UNKNOWN if p is None else PARITY_OK if p >= PARITY_MIN_COSINE else PARITY_LOW
        for p in parities
    ]
    positions = np.arange(len(rows))[::-1]  # the baseline on top
    axes.barh(positions, medians, color=colours, height=0.6)
    for position, row, median, parity in zip(positions, rows, medians, parities, strict=True):
        rates = row.get("rates") or []
        axes.scatter(rates, [position] * len(rates), color="black", s=12, zorder=3)
        label = f"{median:,.0f}/s  ×{row['ratio']:.2f}"
        label += "  (reference)" if position == positions[0] else ""
        label += "" if parity is None else f"  min cos {parity:.5f}"
        axes.text(max([median, *rates]) * 1.02, position, label, va="center", fontsize=9)
    axes.set_yticks(positions, names)
    highest = max(max([row["texts_per_s"], *(row.get("rates") or [])]) for row in rows)
    axes.set_xlim(0, highest * 1.45)  # room for the labels right of the bars
    axes.set_xlabel("texts/s (bar: median of rounds; dots: each round)")
    axes.set_title(f"Throughput per contender\n{subtitle}", fontsize=10)
    from matplotlib.patches import Patch

    figure.legend(
        handles=[
            Patch(color=PARITY_OK, label=f"parity: min cosine vs reference ≥ {PARITY_MIN_COSINE}"),
            Patch(color=PARITY_LOW, label=f"min cosine < {PARITY_MIN_COSINE}"),
            Patch(color=PARITY_UNKNOWN, label="reference, or vectors not compared"),
        ],
        loc="outside lower center",
        ncols=3,
        fontsize=8,
    )
    return _save(figure, path)


def plot_latency_cdf(
    samples_s: Mapping[str, Sequence[float]], path: Path, subtitle: str, bound_ms: float | None
) -> Path:
    """Empirical CDFs of query latency (seconds in, milliseconds drawn, log axis), one line per
    condition; a vertical line at ``bound_ms`` (the saturated-p99 bound) when given."""
    figure, axes = _figure()
    for label, samples in samples_s.items():
        values = np.sort(np.asarray(samples, dtype=float) * 1000)
        if not len(values):
            continue
        fraction = np.arange(1, len(values) + 1) / len(values)
        style = "--" if label.startswith("bare") else "-"
        axes.step(values, fraction, where="post", linestyle=style, label=label)
    if bound_ms is not None:
        axes.axvline(bound_ms, color="black", linewidth=0.8, linestyle=":")
        axes.text(
            bound_ms, 0.6, f"bound for saturated p99: {bound_ms:.0f} ms ", fontsize=8,
            rotation=90, ha="right", va="center",
        )  # fmt: skip
    axes.set_xscale("log")
    from matplotlib.ticker import FuncFormatter

    # plain numbers (5, 20, 300) on the log axis, not 2×10²; minor ticks labelled at 2 and 5
    axes.xaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    axes.xaxis.set_minor_formatter(
        FuncFormatter(lambda value, _: f"{value:g}" if f"{value:g}"[0] in "25" else "")
    )
    axes.set_xlabel("query round trip, ms (log scale)")
    axes.set_ylabel("fraction of queries at or under")
    axes.set_ylim(0, 1.01)
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(loc="lower right", fontsize=9)
    axes.set_title(f"Query latency: idle vs ingest stream saturated\n{subtitle}", fontsize=10)
    return _save(figure, path)


def plot_soak(
    samples: Sequence[Mapping[str, float]], path: Path, subtitle: str, marks: Sequence[int]
) -> Path:
    """Two panels from the soak's samples (``seconds``, ``done``, ``rss_mib``, ``backlog``):
    RSS over chunks embedded, and the backlog (entries not yet finished) over time."""
    figure, (rss_axes, backlog_axes) = _figure(columns=2)
    done = [s["done"] for s in samples]
    rss_axes.plot(done, [s["rss_mib"] for s in samples], color="#264653")
    for mark in marks:
        rss_axes.axvline(mark, color="grey", linewidth=0.6, linestyle=":")
    rss_axes.set_xlabel("chunks embedded")
    rss_axes.set_ylabel("worker RSS, MiB")
    low = min(s["rss_mib"] for s in samples)
    rss_axes.set_ylim(0, max(s["rss_mib"] for s in samples) * 1.15 if low > 0 else None)
    rss_axes.set_title("Worker memory over the run (dotted: the table's marks)", fontsize=10)
    rss_axes.grid(True, alpha=0.3)

    backlog_axes.plot([s["seconds"] for s in samples], [s["backlog"] for s in samples])
    backlog_axes.set_xlabel("seconds since the first enqueue")
    backlog_axes.set_ylabel("backlog (ingest entries not yet finished)")
    backlog_axes.set_ylim(bottom=0)
    backlog_axes.set_title("Backlog draining", fontsize=10)
    backlog_axes.grid(True, alpha=0.3)
    figure.suptitle(subtitle, fontsize=9)
    return _save(figure, path)


def _labelled_bars(axes: Any, values: Mapping[str, float], colour: str, unit: str) -> None:
    """Horizontal bars, the first on top, each with its value and ``unit`` written after it."""
    positions = np.arange(len(values))[::-1]
    axes.barh(positions, list(values.values()), color=colour, height=0.6)
    for position, value in zip(positions, values.values(), strict=True):
        axes.text(value, position, f" {value:,.0f}{unit}", va="center", fontsize=8)
    axes.set_yticks(positions, list(values))
    axes.set_xlim(0, max(values.values()) * 1.3)  # room for the labels right of the bars


def plot_cluster(
    figures: Mapping[str, Any], path: Path, subtitle: str, dims: Sequence[int]
) -> Path:
    """Two panels from ``loadtest.cluster``'s figures for one shard: entries/s per queue
    operation, and Redis memory per backlog entry and per stored result."""
    figure, (rate_axes, memory_axes) = _figure(columns=2)
    rates = {
        "enqueue (script, 1000/batch)": figures["enqueue_per_s"],
        "enqueue + WAIT 1": figures["enqueue_wait1_per_s"],
        "bulk read (COUNT 1024)": figures["read_per_s"],
        **{f"write-back, dim {dim}": figures[f"write_dim{dim}_per_s"] for dim in dims},
    }
    _labelled_bars(rate_axes, rates, "#264653", "/s")
    rate_axes.set_xlabel("entries/s, one client on one shard")
    rate_axes.set_title("Queue operations per shard", fontsize=10)

    memory = {
        "backlog entry": figures["bytes_per_backlog_entry"],
        **{f"result, dim {dim}": figures[f"bytes_per_result_dim{dim}"] for dim in dims},
    }
    _labelled_bars(memory_axes, memory, "#2a9d8f", " B")
    memory_axes.set_xlabel("bytes of Redis memory per entry")
    memory_axes.set_title("Memory per entry", fontsize=10)
    figure.suptitle(subtitle, fontsize=9)
    return _save(figure, path)
