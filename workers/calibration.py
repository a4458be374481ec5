"""int8/uint8 calibration ranges: fixed per model and dimension, shared by every worker.

``quantize_embeddings`` maps each dimension's [min, max] onto 256 buckets. If every worker
measured its own minimum and maximum, one text would get different bytes on different workers
(and on different days), and stored int8 vectors would stop being comparable. So the ranges are
computed **once**, from a fixed calibration corpus (:func:`calibration_texts`: lines of the
interactive help that ships with Python), and stored in Redis under
``Keys.calibration(model, variant)`` with ``SET NX``: the first worker to need them writes
them, every other worker (and every later day) reads those. A user may supply their own
(``EMBEDFLEET_CALIBRATION_FILE``, JSON as ``embedfleet calibration show --json`` prints), which
is then stored the same way; a Redis copy that disagrees with the file stops the worker with a
message rather than mixing two calibrations.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import redis.asyncio as aioredis

from embedfleet.shared.keys import Keys

CALIBRATION_TEXTS = 1000


class CalibrationError(RuntimeError):
    """Stored and supplied calibrations disagree, or a file is malformed; says what to do."""


@dataclass(frozen=True)
class Calibration:
    """Per-dimension minimum (row 0) and maximum (row 1) of the calibration embeddings."""

    model: str
    variant: str  # dimension label, see variant_label
    ranges: np.ndarray  # float32, shape (2, dim)
    texts: int
    source: str

    def to_json(self) -> str:
        return json.dumps(
            {
                "model": self.model,
                "variant": self.variant,
                "dim": int(self.ranges.shape[1]),
                "texts": self.texts,
                "source": self.source,
                "min": [float(x) for x in self.ranges[0]],
                "max": [float(x) for x in self.ranges[1]],
            }
        )

    @classmethod
    def from_json(cls, text: str | bytes, where: str) -> Calibration:
        try:
            data = json.loads(text)
            ranges = np.array([data["min"], data["max"]], dtype=np.float32)
            if ranges.ndim != 2 or ranges.shape[1] != int(data["dim"]):
                raise ValueError(f"min/max have {ranges.shape[-1]} values, dim is {data['dim']}")
            return cls(
                model=str(data["model"]),
                variant=str(data["variant"]),
                ranges=ranges,
                texts=int(data.get("texts", 0)),
                source=str(data.get("source", where)),
            )
        except (ValueError, KeyError, TypeError) as error:
            raise CalibrationError(f"{where} is not a calibration: {error}") from None


def variant_label(dim: int, model_dim: int, renormalized: bool) -> str:
    """Which vectors a calibration describes: ranges differ with truncation and with
    renormalisation of the truncated vector, so each combination has its own."""
    if dim >= model_dim:
        return str(model_dim)
    return f"{dim}" if renormalized else f"{dim}-raw"


def calibration_texts(count: int = CALIBRATION_TEXTS) -> list[str]:
    """A fixed corpus every worker has: lines of Python's own help topics, spread evenly."""
    from pydoc_data.topics import topics

    lines = [
        line.strip()
        for key in sorted(topics)
        for line in topics[key].splitlines()
        if len(line.strip()) > 20
    ]
    step = max(1, len(lines) // count)
    return lines[::step][:count]


def compute(
    model: str, variant: str, embed: Callable[[list[str]], np.ndarray], texts: list[str]
) -> Calibration:
    """Ranges from ``embed(texts)`` (already truncated/renormalised like the outputs)."""
    vectors = embed(texts)
    ranges = np.vstack((vectors.min(axis=0), vectors.max(axis=0))).astype(np.float32)
    return Calibration(model, variant, ranges, len(texts), "built-in corpus (pydoc topics)")


class CalibrationStore:
    """Calibrations of one model in Redis, cached in the worker once read."""

    def __init__(self, client: aioredis.Redis, keys: Keys, model: str, file: str = "") -> None:
        self.client = client
        self.keys = keys
        self.model = model
        self._cache: dict[str, Calibration] = {}
        self._supplied: dict[str, Calibration] = {}
        if file:
            path = Path(file)
            if not path.is_file():
                raise CalibrationError(f"EMBEDFLEET_CALIBRATION_FILE={file!r} does not exist")
            entries = json.loads(path.read_text())
            for entry in entries if isinstance(entries, list) else [entries]:
                calibration = Calibration.from_json(json.dumps(entry), file)
                self._supplied[calibration.variant] = calibration

    async def stored(self, variant: str) -> Calibration | None:
        raw = await self.client.get(self.keys.calibration(self.model, variant))
        if raw is None:
            return None
        return Calibration.from_json(raw, self.keys.calibration(self.model, variant))

    def cached(self, variant: str) -> Calibration | None:
        """The calibration already read by :meth:`get` (no I/O: for the model thread)."""
        return self._cache.get(variant)

    async def get(
        self,
        variant: str,
        compute_missing: Callable[[], Awaitable[Calibration]] | None = None,
    ) -> Calibration:
        """The calibration every worker uses for ``variant``: Redis's, else the supplied file's
        or a fresh one (stored with SET NX, so the first writer wins and all read that)."""
        if variant in self._cache:
            return self._cache[variant]
        key = self.keys.calibration(self.model, variant)
        current = await self.stored(variant)
        supplied = self._supplied.get(variant)
        if current is None:
            candidate = supplied
            if candidate is None:
                if compute_missing is None:
                    raise CalibrationError(f"no calibration at {key}")
                candidate = await compute_missing()
            await self.client.set(key, candidate.to_json(), nx=True)
            current = await self.stored(variant)
            assert current is not None
        if supplied is not None and not np.array_equal(supplied.ranges, current.ranges):
            raise CalibrationError(
                f"the calibration in Redis ({key}) differs from EMBEDFLEET_CALIBRATION_FILE; "
                f"delete the key (redis-cli DEL {key}) to store the file's, or unset the file"
            )
        self._cache[variant] = current
        return current
