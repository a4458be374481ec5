"""The bulk path's forward passes: which layout, collation into host buffers, and batches
launched ahead of their copy back so that a GPU never waits for the host between batches.

- **Layout** (:func:`resolve_layout`): ``EMBEDFLEET_LAYOUT``; ``auto`` is
  ``workers.model.packing.preferred_layout``: varlen on CUDA, padded on CPU.
- **Collation** (:meth:`BulkForward.collate`) runs on the worker's tokenizer thread with the
  window's planning, never on the event loop or the model thread: varlen batches into one
  int32 buffer, padded batches into int64 tensors, pinned only on CUDA (pinning is a page-locked
  allocation that buys nothing without a device to copy to).
- **Launch** (:meth:`BulkForward.launch`, on the model thread). On CUDA: the host→device copy is
  non-blocking, then the forward pass, pooling, head and, where every chunk of the batch is
  stored as the full vector in float16, the fp16 cast are queued on the device; the vectors are
  copied back non-blocking into pinned memory and an event is recorded behind the copy. The
  call returns once all of that is queued. On CPU the launch is the whole computation
  (``Encoder.embed``, ``Encoder.embed_query`` for the frozen bf16 copy, or
  ``PackedEncoder.embed``), and the vectors are ready when it returns.
- **One batch in flight** (:class:`LaunchAhead`): the worker launches batch i+1 before it waits
  on batch i's event, so the device has the next batch queued while the host waits, writes,
  and prepares the one after.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

import numpy as np
import torch

from embedfleet.shared.fault_kinds import WorkerFault
from embedfleet.shared.logging import get_logger
from embedfleet.workers.batcher import PlannedBatch, plan_batches, plan_packed_batches
from embedfleet.workers.cost_model import SliceLimit
from embedfleet.workers.model.encoder import EncodeBatch, Encoder, Tokenized
from embedfleet.workers.model.packing import (
    BulkLayout,
    PackedEncoder,
    VarlenBatch,
    check_packed_pooling,
    preferred_layout,
    varlen_supported,
)

log = get_logger("embedfleet.bulk")

BulkBatch = EncodeBatch | VarlenBatch


def resolve_layout(setting: str, encoder: Encoder) -> BulkLayout:
    """The layout the bulk path runs: the setting, or for ``auto`` the device's preferred one.

    A model varlen cannot pool (two pooling modes, prompts left out of the pooling) or an old
    transformers gets padded batches under ``auto``; asked for explicitly, the worker refuses
    to start with the reason and the setting to change.
    """
    if setting == "auto":
        layout = preferred_layout(encoder.device, encoder.dtype)
    elif setting in ("padded", "varlen"):
        layout = setting  # type: ignore[assignment]
    else:
        raise ValueError(f"unknown layout {setting!r}")
    if layout == "padded":
        return layout
    problem = None if varlen_supported() else "this transformers has no attention interface"
    try:
        check_packed_pooling(encoder)
    except ValueError as error:
        problem = str(error)
    if problem is None:
        return layout
    if setting == "varlen":
        message = f"the varlen layout cannot run this model: {problem}"
        raise WorkerFault(message, "EMBEDFLEET_LAYOUT")
    log.warning("varlen layout not possible here; padded batches", reason=problem)
    return "padded"


class Event(Protocol):
    """What the launch needs of a device event (``torch.cuda.Event``'s methods)."""

    def synchronize(self) -> None: ...

    def query(self) -> bool: ...

    def elapsed_time(self, end_event: Event) -> float: ...  # milliseconds


class EventSource(Protocol):
    def record(self) -> Event:
        """An event recorded now on the launching thread's current stream."""
        ...


class CudaEvents:
    """Timing events on the model thread's current CUDA stream."""

    def record(self) -> Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event  # type: ignore[return-value]


def device_events(device: torch.device) -> EventSource | None:
    """Events for an asynchronous device; None where a forward pass is synchronous (CPU)."""
    return CudaEvents() if device.type == "cuda" else None


@dataclass
class Launched:
    """One batch's vectors: on the host, or on their way there behind ``copied``."""

    host: torch.Tensor | np.ndarray
    launch_seconds: float  # the launch call's wall time: the whole computation on CPU
    started: Event | None = None
    copied: Event | None = None

    @property
    def done(self) -> bool:
        """Whether :meth:`vectors` would return without waiting."""
        return self.copied is None or self.copied.query()

    def vectors(self) -> np.ndarray:
        """The vectors on the host: waits for the copy back (blocking; off the event loop)."""
        if self.copied is not None:
            self.copied.synchronize()
        return self.host.numpy() if isinstance(self.host, torch.Tensor) else self.host

    @property
    def seconds(self) -> float:
        """After :meth:`vectors`: the device's time on the batch from its events, else (CPU)
        the launch's wall time."""
        if self.started is None or self.copied is None:
            return self.launch_seconds
        return self.started.elapsed_time(self.copied) / 1000


class BulkForward:
    """Collates and launches the bulk path's batches in one layout for one encoder."""

    def __init__(
        self, encoder: Encoder, layout: BulkLayout, events: EventSource | None = None
    ) -> None:
        self.encoder = encoder
        self.layout = layout
        # tests pass fake events to run the asynchronous path on a CPU
        self.events = events if events is not None else device_events(encoder.device)
        self.pin = encoder.device.type == "cuda"
        self.packer = PackedEncoder(encoder) if layout == "varlen" else None

    @property
    def asynchronous(self) -> bool:
        """Whether a launch returns before its vectors are computed (then run one ahead)."""
        return self.events is not None

    def plan(
        self,
        lengths: Sequence[int],
        token_budget: int,
        max_batch: int,
        limit: SliceLimit | None = None,
    ) -> list[PlannedBatch]:
        """Batches of a window: real tokens under the budget for varlen (nothing is padded),
        padded tokens with the cost-aware cuts of ``workers.batcher`` otherwise; each batch's
        predicted slice within ``limit`` where given (workers/cost_model.py)."""
        if self.packer is not None:
            fits = None if limit is None else limit.fits
            return plan_packed_batches(lengths, token_budget, max_batch, fits)
        return plan_batches(
            lengths, token_budget, max_batch, max_texts=None if limit is None else limit.max_texts
        )

    def collate(self, tokens: list[Tokenized]) -> BulkBatch:
        """Host buffers for one batch; run on the tokenizer thread."""
        if self.packer is not None:
            return self.packer.collate(tokens, pin=self.pin)
        return self.encoder.collate(tokens, pin=self.pin)

    def launch(self, batch: BulkBatch, *, frozen: bool = False, half: bool = False) -> Launched:
        """Run (CPU) or queue (CUDA) one batch; call on the model thread.

        ``frozen``: a padded batch on CPU through the frozen copy (``Encoder.embed_query``).
        ``half``: every chunk stores the full vector in float16, so the device casts before
        the copy back (half the bytes, nothing downstream needs more).
        """
        started = time.perf_counter()
        if self.events is None:
            return Launched(self._embed(batch, frozen), time.perf_counter() - started)
        start_event = self.events.record()
        if isinstance(batch, VarlenBatch):
            assert self.packer is not None
            on_device = self.packer.vectors(batch)
        else:
            on_device = self.encoder.vectors(batch)
        if half:
            on_device = on_device.half()
        host = torch.empty(on_device.shape, dtype=on_device.dtype, pin_memory=self.pin)
        host.copy_(on_device, non_blocking=self.pin)
        copied = self.events.record()
        return Launched(host, time.perf_counter() - started, start_event, copied)

    def _embed(self, batch: BulkBatch, frozen: bool) -> np.ndarray:
        if isinstance(batch, VarlenBatch):
            assert self.packer is not None
            return self.packer.embed(batch)
        return (self.encoder.embed_query if frozen else self.encoder.embed)(batch)


T = TypeVar("T")


class LaunchAhead(Generic[T]):
    """The one batch launched and not yet collected.

    ``push`` hands in the batch just launched and returns the one launched before it, to be
    collected now while the new one runs. Where launches are synchronous (``ahead`` false: a
    CPU, where the launch was the computation) each batch comes straight back: holding it would
    only delay its results.
    """

    def __init__(self, ahead: bool) -> None:
        self.ahead = ahead
        self._in_flight: T | None = None

    def push(self, launched: T) -> T | None:
        if not self.ahead:
            return launched
        previous, self._in_flight = self._in_flight, launched
        return previous

    def pop(self) -> T | None:
        """The batch in flight, if any, to be collected now (nothing is launched behind it)."""
        previous, self._in_flight = self._in_flight, None
        return previous
