"""Batching settings: how much a worker reads at a time and how it cuts micro-batches."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from pydantic import Field, ValidationInfo, field_validator

from embedfleet.shared.settings.section import Section


@dataclass(frozen=True)
class Batching:
    """How much the worker reads and batches at a time (resolved for one device)."""

    read_count: int
    token_budget: int
    max_batch: int
    read_max_bytes: int


# EMBEDFLEET_READ_COUNT / TOKEN_BUDGET / MAX_BATCH = -1: CPU figures from docs/BENCHMARKS.md;
# CUDA's are the chart's GPU values (helm/embedfleet/ci/gpu-values.yaml), the ones the device
# check runs with (loadtest/gpu_check.py), for MiniLM-class models on an H200.
AUTO_BATCHING = {
    "cpu": Batching(read_count=1024, token_budget=4096, max_batch=128, read_max_bytes=4 << 20),
    "cuda": Batching(read_count=8192, token_budget=131072, max_batch=1024, read_max_bytes=64 << 20),
}
BATCHING_MINIMUM = {"read_count": 1, "token_budget": 16, "max_batch": 1, "read_max_bytes": 1024}


class BatchingSettings(Section):
    """The read window and the micro-batches cut from it; -1 = the device's figures."""

    title: ClassVar[str] = "Batching: the read window and micro-batches"

    read_count: int = -1
    """Entries read from the ingest stream per XREADGROUP: the window sorted by length before
    batching. -1 = auto for the device: 1024 on CPU (3.7% padding on the benchmark corpus, 5% at
    512; see docs/BENCHMARKS.md), 8192 on CUDA."""
    read_max_bytes: int = -1
    """Most payload bytes one bulk read takes (the entries' `m` fields: the texts, in UTF-8,
    and their options), beside EMBEDFLEET_READ_COUNT: a read of long texts stops at this size
    (or at its first entry, whatever its size), so a worker holds what a few reads of it
    expand to, however long the texts (docs/OPERATIONS.md#memory). Bytes, not tokens: a read
    knows its entries' sizes before it delivers them, their tokens only once tokenized. -1 =
    auto for the device: 4 MiB on CPU, 64 MiB on CUDA (a full read of 8,192 texts of up to
    8 KB each)."""
    block_ms: int = Field(default=2000, ge=1)
    """How long an idle worker blocks waiting for entries."""
    token_budget: int = -1
    """Most tokens a micro-batch computes: batch size × longest sequence in the padded layout, the
    texts' own tokens in varlen (EMBEDFLEET_LAYOUT). -1 = auto for the device: 4096 on CPU
    (measured fastest; 8192 was slower), 131072 on CUDA."""
    max_batch: int = -1
    """Most texts in one micro-batch. -1 = auto for the device: 128 on CPU, 1024 on CUDA."""

    @field_validator("read_count", "token_budget", "max_batch", "read_max_bytes")
    @classmethod
    def _auto_or_at_least(cls, value: int, info: ValidationInfo) -> int:
        assert info.field_name is not None  # a field validator's info names its field
        least = BATCHING_MINIMUM[info.field_name]
        if value != -1 and value < least:
            raise ValueError(f"must be -1 (auto, per device) or at least {least}")
        return value

    def batching(self, device_type: str) -> Batching:
        """read_count, token_budget and max_batch for a device: what is set, else the device's
        defaults (``AUTO_BATCHING``; an unknown device gets the CPU's)."""
        auto = AUTO_BATCHING.get(device_type, AUTO_BATCHING["cpu"])
        return Batching(
            read_count=self.read_count if self.read_count != -1 else auto.read_count,
            token_budget=self.token_budget if self.token_budget != -1 else auto.token_budget,
            max_batch=self.max_batch if self.max_batch != -1 else auto.max_batch,
            read_max_bytes=(
                self.read_max_bytes if self.read_max_bytes != -1 else auto.read_max_bytes
            ),
        )
