"""The device check's own arithmetic and models (loadtest/gpu_check.py, loadtest/gpu_steps.py):
what a 15-minute lease would otherwise find out too late. The steps themselves are rehearsed on
the CPU by `make gpu-rehearsal` (docs/BENCHMARKS.md, GPU check)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from tokenizers import Tokenizer

from embedfleet.shared.keys import partition_of
from embedfleet.shared.model_path import resolve_model_path
from embedfleet.shared.settings import PACKAGED_MODEL, Settings
from embedfleet.workers.model.encoder import Encoder
from loadtest.bench import useful_flops
from loadtest.gpu_check import (
    CPU_STEP_BUDGETS,
    CUDA_DEADLINE_S,
    NEXT_LEASE_STEPS,
    PROFILES,
    RESERVE_S,
    STEP_BUDGETS,
    summarize,
)
from loadtest.gpu_steps import (
    STEPS,
    CheckConfig,
    ImageModel,
    LargeModel,
    Record,
    Shape,
    WorkerProcess,
    images,
    pinned_ids,
    token_lengths,
    watched,
)
from tests.image_models import VIT_L_14
from tests.model_zoo import bert_shaped_dir


def test_the_next_lease_fits_its_deadline_twice() -> None:
    """A plain run's steps end inside the deadline with the summary's reserve, and two tries
    (each the deadline plus the install, ~20 s) fit the 15-minute lease less a 2-minute start."""
    assert sum(STEP_BUDGETS[step] for step in NEXT_LEASE_STEPS) + RESERVE_S <= CUDA_DEADLINE_S
    assert 2 * (CUDA_DEADLINE_S + 20) <= 15 * 60 - 120
    assert {"models", "replicas", "large", "latency"} <= set(NEXT_LEASE_STEPS)


def test_the_gpu_profile_asks_for_the_issues_shapes_and_sweep() -> None:
    shapes = {m["name"]: m for m in PROFILES["cuda"]["large_models"]}
    sizes = ("hidden", "layers", "heads", "intermediate")
    assert tuple(shapes["bert-base"][k] for k in sizes) == (768, 12, 12, 3072)
    assert tuple(shapes["bge-large"][k] for k in sizes) == (1024, 24, 16, 4096)
    assert shapes["bge-large"]["texts"] < shapes["bert-base"]["texts"], "fewer for the larger"
    assert PROFILES["cuda"]["replicas"] == [1, 2, 4, 8, 16]
    for device, profile in PROFILES.items():  # every key is a CheckConfig field
        config = CheckConfig(device=device, model="m", redis_url="redis://x", threads=1, **profile)
        assert [LargeModel(**m).name for m in config.large_models] == ["bert-base", "bge-large"]


def test_the_images_step_is_ViT_L_14_sized_to_a_lease() -> None:
    """Issue 56's comparison: CLIP ViT-L/14's shapes on a GPU; a step of its own budget on
    both devices, run after the preflight in one call well inside the deadline."""
    assert set(STEP_BUDGETS) == set(CPU_STEP_BUDGETS) == set(STEPS)
    assert STEP_BUDGETS["preflight"] + STEP_BUDGETS["images"] + RESERVE_S <= CUDA_DEADLINE_S / 2
    vit_l = ImageModel(**PROFILES["cuda"]["image_model"])
    assert vit_l.clip_shape() == VIT_L_14
    assert 160e9 < vit_l.flops_per_image < 164e9, "ViT-L/14 at 224 px: ~162 GFLOP an image"
    tiny = ImageModel(**PROFILES["cpu"]["image_model"])
    assert tiny.flops_per_image < vit_l.flops_per_image / 1000, "the rehearsal's runs in seconds"


def test_the_images_step_rehearses_on_the_cpu(
    tmp_path: Path, settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The step itself at the CPU profile's sizes (a tiny CLIP, 24 images of mixed sizes and
    formats through the in-process worker and a real server), then its rows in the summary."""
    for variable in ("DTYPE", "CUDA_QUERY_LANE", "FROZEN_QUERIES", "CPU_INT8", "CPU_BACKEND"):
        monkeypatch.delenv(f"EMBEDFLEET_{variable}", raising=False)  # the step sets them
    monkeypatch.delenv("EMBEDFLEET_LOG_LEVEL", raising=False)
    profile = PROFILES["cpu"]
    config = CheckConfig(
        device="cpu", model="unused", redis_url=settings.effective_redis_url, threads=2, **profile
    )
    config.extra = {**config.extra, "corpus_file": str(tmp_path / "texts.json")}
    record = Record(tmp_path / "images.json")
    before = dict(os.environ)
    images(config, record)
    # put back: the workers later tests of this process start inherit it (a leaked
    # EMBEDFLEET_LOG_LEVEL=warning hid their "worker started" lines)
    assert dict(os.environ) == before
    found = record.data
    assert found["setup"]["distinct"].startswith("12 images")
    fleet = found["fleet end to end"]
    assert fleet["images"] == 24 and fleet["images_per_s"] > 0
    assert 0 < fleet["model_busy"] <= 1
    assert found["model alone"]["images"] >= 24 and found["model alone"]["batch"] == 24
    host = found["host decode + preprocess"]
    assert host["per_cpu_s"] > 0 and host["ceiling_images_per_s"] >= host["per_cpu_s"]
    text = summarize(
        {"config": {"device": "cpu"}, "steps": {"images": {"status": "ok", "results": found}}}
    )
    assert "images (issue 56): clip-tiny shapes, random weights, float32; 24 images a run" in text
    assert "| fleet end to end |" in text and "| model alone |" in text
    assert "of 8,000/s (CLIP ViT-L per H100)" in text
    assert "images per CPU second x" in text


def test_flops_from_the_config_count_as_the_loaded_model(encoder: Encoder) -> None:
    lengths = [3, 17, 64, 256]
    shape = Shape.of(resolve_model_path(PACKAGED_MODEL))
    assert shape.flops(lengths) == useful_flops(lengths, encoder)
    assert shape.matmul_parameters == 6 * (4 * 384**2 + 2 * 384 * 1536)


def test_a_bert_shaped_copy_tokenizes_like_its_source(tmp_path: Path) -> None:
    source = resolve_model_path(PACKAGED_MODEL)
    folder = bert_shaped_dir(
        source, tmp_path / "wide", hidden=64, layers=3, heads=4, intermediate=96, seed=1
    )
    assert Shape.of(folder) == Shape(hidden=64, layers=3, intermediate=96)
    copy = Encoder(str(folder), device="cpu", dtype="float32")
    assert copy.dim == 64 and copy.max_length == Encoder(str(source), device="cpu").max_length
    texts = ["a short one", "and a somewhat longer text, with punctuation; and numbers 1984"]
    original = Tokenizer.from_file(str(source / "tokenizer.json"))
    original.no_padding()  # the packaged file pads to 128; the worker does not
    assert [t.ids for t in copy.tokenize(texts)] == [e.ids for e in original.encode_batch(texts)]
    assert token_lengths(folder, texts) == [len(e.ids) for e in original.encode_batch(texts)]
    vectors = copy.embed_texts(texts)
    assert np.all(np.isfinite(vectors))
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-4)
    assert bert_shaped_dir(source, tmp_path / "wide", hidden=8, layers=1, heads=1, intermediate=8)
    assert Shape.of(folder).hidden == 64, "made once, kept"


@pytest.mark.parametrize(("used", "partitions"), [(1, 16), (3, 16), (16, 16), (2, 2)])
def test_pinned_ids_reach_only_the_first_partitions(used: int, partitions: int) -> None:
    ids = pinned_ids("x", 100, used, partitions)
    assert len(set(ids)) == 100
    counts = np.bincount([partition_of(i, partitions) for i in ids], minlength=partitions)
    assert counts[used:].sum() == 0
    assert counts[:used].max() - counts[:used].min() <= 1, "as even as the count allows"


def _run(ids: str, in_effect: bool | None) -> dict[str, object]:
    return {
        "ids": ids,
        "texts_per_s": 40_000.0,
        "tokens_per_s": 2_400_000.0,
        "model_busy": 0.5,
        "model_busy_sum": 5.0,
        "model_tflops": 410.0,
        "mfu": 0.52,
        "enqueue_s": 1.0,
        "seconds": 1.5,
        "producer_bound": False,
        "token_ids_in_effect": in_effect,
    }


def test_the_summary_prints_the_new_rows() -> None:
    results = {
        "config": {"device": "cuda"},
        "elapsed_s": 300.0,
        "steps": {
            "models": {
                "status": "ok",
                "seconds": 12.0,
                "results": {
                    "bert-base": {
                        "hidden": 768,
                        "layers": 12,
                        "heads": 12,
                        "intermediate": 3072,
                        "matmul_parameters": 84_934_656,
                        "weights_mib": 208.0,
                        "build_s": 3.1,
                    }
                },
            },
            "replicas": {
                "status": "ok",
                "seconds": 80.0,
                "results": {
                    "setup": {
                        "replicas_started": 16,
                        "threads_each": 1,
                        "gpu_memory_share": 0.0625,
                        "texts_per_replica": 8000,
                    },
                    "ready_s": 30.2,
                    "16 replicas plain": {"replicas": 16, **_run("plain", True)},
                    "16 replicas ids": {"replicas": 16, **_run("ids", False)},
                },
            },
            "large": {
                "status": "ok",
                "seconds": 90.0,
                "results": {
                    "setup": {"replicas": 10, "usable_cpus": 16},
                    "bert-base ids": {
                        "model": "bert-base",
                        "dtype": "bfloat16",
                        **_run("ids", True),
                    },
                },
            },
            "latency": {"status": "ok", "seconds": 40.0, "results": {"replicas": 10}},
        },
    }
    text = summarize(results)
    assert "| bert-base | 768 / 12 / 12 / 3072 | 84.9M | 208.0 | 3.1 |" in text
    assert "16 workers started together (ready in 30.2 s)" in text and "6.2% of the GPU" in text
    plain = "| 16 replicas plain | plain | 40,000 | 2,400,000 | 50% / 5.00 | 410.00 | 52.0% |"
    assert plain in text
    assert "| 16 replicas ids | ids (setting absent: plain) |" in text
    assert "EMBEDFLEET_REPLICAS=auto ran 10 replicas (16 usable CPUs), dtype bfloat16" in text
    assert "| bert-base ids | ids | 40,000 |" in text
    assert "latency: one worker with 10 replicas (auto)" in text


def _process(tmp_path: Path, code: str) -> WorkerProcess:
    log = tmp_path / "worker.log"
    log.write_text("the worker's last words")
    process = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE)  # held open
    return WorkerProcess(process, [], log)


def test_a_worker_that_dies_ends_the_run_at_once(tmp_path: Path) -> None:
    """Not at the step's timeout: on the device that is a lease's minutes."""
    dead = _process(tmp_path, "raise SystemExit(3)")
    dead.process.wait()
    with pytest.raises(RuntimeError, match="exited with 3") as failed:
        asyncio.run(watched(asyncio.Event().wait(), [dead]))  # a job that never ends
    assert "the worker's last words" in str(failed.value)


def test_a_run_with_its_workers_alive_returns_the_jobs_result(tmp_path: Path) -> None:
    alive = _process(tmp_path, "import sys; sys.stdin.read()")
    try:

        async def job() -> str:
            return "progress"

        assert asyncio.run(watched(job(), [alive])) == "progress"
    finally:
        alive.process.kill()
        alive.process.wait()
