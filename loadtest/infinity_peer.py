"""Infinity (``infinity-emb``) as a benchmark peer, run in its own virtual environment.

Infinity pins its own sentence-transformers, transformers and numpy, so it cannot share the
project's environment: ``make bench-peers`` builds ``.venv-infinity`` from
``loadtest/requirements-infinity.txt`` and ``loadtest.peers`` drives this script there over
JSON lines on stdin/stdout, one engine per process, loaded once and timed per round, each
round on texts of its own (a JSON list in a file, read before the clock starts):

    {"op": "load", "model": DIR, "engine": "torch|optimum", "dtype": "bfloat16", "threads": 2,
     "batch_size": 32}                                      -> {"ok": true, "seconds": 3.1}
    {"op": "embed", "texts": FILE.json, "out": FILE.npy}    -> {"ok": true, "seconds": 4.2}

This file imports nothing of embedfleet: it runs where embedfleet is not installed.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("INFINITY_ANONYMOUS_USAGE_STATS", "0")
os.environ.setdefault("DO_NOT_TRACK", "1")


def reply(**fields: object) -> None:
    print(json.dumps(fields), flush=True)


def pooling_method(model_dir: str) -> str:
    """What the model's sentence-transformers Pooling module says, for Infinity's ONNX engine,
    which otherwise pools the [CLS] token ("auto" is not mean there)."""
    import glob

    for path in glob.glob(os.path.join(model_dir, "*Pooling*", "config.json")):
        with open(path, encoding="utf-8") as handle:
            if json.load(handle).get("pooling_mode_mean_tokens"):
                return "mean"
    return "cls"


def onnx_copy(model_dir: str) -> str:
    """A copy of the model directory with ``model.onnx`` beside its weights, for Infinity's
    ONNX (optimum) engine, which wants the file there. Exported here with optimum, offline."""
    import shutil
    import tempfile

    from optimum.onnxruntime import ORTModelForFeatureExtraction

    target = os.path.join(tempfile.mkdtemp(prefix="infinity-onnx-"), "model")
    shutil.copytree(model_dir, target)
    ORTModelForFeatureExtraction.from_pretrained(model_dir, export=True).save_pretrained(target)
    return target


async def serve() -> None:
    import numpy as np
    import torch
    from infinity_emb import AsyncEmbeddingEngine, EngineArgs

    engine = None
    for line in sys.stdin:
        command = json.loads(line)
        try:
            if command["op"] == "load":
                torch.set_num_threads(int(command["threads"]))
                model = command["model"]
                pooling = pooling_method(model)
                if command["engine"] == "optimum":  # not timed: an export, done once
                    # Infinity 0.0.78 hands optimum 2.x the ONNX file as the path its glob found,
                    # which optimum wants relative to the model: run from inside the copy.
                    os.chdir(onnx_copy(model))
                    model = "."
                started = time.perf_counter()
                engine = AsyncEmbeddingEngine.from_args(
                    EngineArgs(
                        model_name_or_path=model,
                        engine=command["engine"],
                        dtype=command["dtype"],
                        device="cpu" if command.get("device", "cpu") == "cpu" else "cuda",
                        batch_size=int(command["batch_size"]),
                        model_warmup=False,
                        bettertransformer=False,
                        pooling_method=pooling,
                    )
                )
                await engine.astart()
                reply(ok=True, seconds=time.perf_counter() - started)
            elif command["op"] == "embed":
                assert engine is not None, "load first"
                with open(command["texts"], encoding="utf-8") as handle:
                    batch = json.load(handle)
                started = time.perf_counter()
                vectors, _usage = await engine.embed(sentences=batch)
                seconds = time.perf_counter() - started
                np.save(command["out"], np.asarray(vectors, dtype=np.float32))
                reply(ok=True, seconds=seconds)
            elif command["op"] == "stop":
                break
        except Exception as error:  # reported to the driver, which fails the run with it
            reply(ok=False, error=f"{type(error).__name__}: {error}")
    if engine is not None:
        await engine.astop()


if __name__ == "__main__":
    asyncio.run(serve())
