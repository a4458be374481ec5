"""Serving engines as benchmark contenders, each in its own environment and process.

Infinity (``infinity-emb``) pins older sentence-transformers, transformers and numpy than the
project, so it lives in ``.venv-infinity`` (``make bench-peers``) and is driven over a pipe by
``loadtest/infinity_peer.py``. The driver hands it texts of the same lengths as every other
contender's (each round its own, new texts: ``loadtest.corpus.FreshCorpora``), the same torch
thread count and the same model directory; only the embed call is timed, as for the in-process
contenders.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
INFINITY_VENV = REPO / ".venv-infinity"
PEER_SCRIPT = Path(__file__).with_name("infinity_peer.py")


@dataclass(frozen=True)
class InfinityConfig:
    engine: str  # "torch" or "optimum" (ONNX)
    dtype: str  # "float32", "bfloat16", ...
    batch_size: int = 32

    @property
    def label(self) -> str:
        short = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(self.dtype, "")
        return f"infinity {self.engine} {short or self.dtype}"


def infinity_available() -> bool:
    return (INFINITY_VENV / "bin" / "python").is_file()


class InfinityPeer:
    """One Infinity engine in its own process, loaded once, asked to embed each round."""

    def __init__(
        self,
        config: InfinityConfig,
        model_dir: Path,
        threads: int,
        device: str = "cpu",
    ) -> None:
        self.config = config
        self._scratch = Path(tempfile.mkdtemp(prefix="infinity-peer-"))
        self._process = subprocess.Popen(
            [str(INFINITY_VENV / "bin" / "python"), str(PEER_SCRIPT)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            cwd=self._scratch,
        )
        self.load_seconds = self._ask(
            op="load",
            model=str(model_dir),
            engine=config.engine,
            dtype=config.dtype,
            threads=threads,
            device=device,
            batch_size=config.batch_size,
        )["seconds"]

    def _ask(self, **command: object) -> dict:
        assert self._process.stdin is not None and self._process.stdout is not None
        self._process.stdin.write(json.dumps(command) + "\n")
        self._process.stdin.flush()
        line = self._process.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.config.label}: the peer process exited")
        answer = json.loads(line)
        if not answer["ok"]:
            raise RuntimeError(f"{self.config.label}: {answer['error']}")
        return answer

    def embed(self, texts: Sequence[str]) -> tuple[float, np.ndarray]:
        """Seconds to embed ``texts``, and their vectors in input order."""
        stamp = time.monotonic_ns()
        texts_file = self._scratch / f"texts-{stamp}.json"
        texts_file.write_text(json.dumps(list(texts)))
        out = self._scratch / f"vectors-{stamp}.npy"
        seconds = self._ask(op="embed", texts=str(texts_file), out=str(out))["seconds"]
        vectors = np.load(out)
        out.unlink()
        texts_file.unlink()
        return seconds, vectors

    def close(self) -> None:
        if self._process.poll() is None and self._process.stdin is not None:
            with contextlib.suppress(BrokenPipeError):
                self._process.stdin.write(json.dumps({"op": "stop"}) + "\n")
                self._process.stdin.close()
            try:
                self._process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._process.kill()
