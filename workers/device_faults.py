"""What a failed forward pass means on a GPU, and what the worker does about it.

Two kinds of model error are not the text's fault, and dead-lettering for them would throw away
valid work:

- **Out of memory** on a batch: the batch was too big for what is free on the device right now
  (another replica, fragmentation, a long-text window). Free the allocator's cache and run the
  batch again in halves; a single text that still does not fit after a few tries means this
  worker's device cannot take it now, so the worker stops (below) rather than dead-letter it.
- **Any other CUDA error** (a device-side assert, an illegal memory access, a cuBLAS/cuDNN
  failure, a lost device): the CUDA context is poisoned and every later call fails too. The
  worker exits non-zero with :class:`DeviceFault`; its pending entries are reclaimed by a healthy
  worker (``EMBEDFLEET_RECLAIM_IDLE_MS``), and the supervisor restarts it on a fresh context.

Everything else (a tokenizer edge case, a shape the model rejects) stays a per-text model error:
the batch is halved until the failing text is alone, and only that one is dead-lettered.

The query stage (workers/queries.py) applies the same classification to its batches, on whichever
thread serves them (the model thread on a CPU, the CUDA query thread): out of memory halves
the query batch, any other CUDA error stops the worker with the queries left pending.
"""

from __future__ import annotations

import gc
from enum import Enum

import torch

from embedfleet.shared.fault_kinds import WorkerFault

# How often one text is retried after an out-of-memory error before the worker gives up.
OOM_RETRIES_ONE_TEXT = 3
# Messages of CUDA errors that leave the context unusable (torch raises most as RuntimeError;
# torch >= 2.8 as torch.AcceleratorError).
_CONTEXT_ERRORS = (
    "cuda error",
    "device-side assert",
    "illegal memory access",
    "cublas_status",
    "cudnn_status",
    "cudnn error",
    "cuda driver error",
    "misaligned address",
    "unspecified launch failure",
    "an illegal instruction was encountered",
)


class DeviceFault(WorkerFault):
    """The device failed in a way no retry in this process fixes: exit, entries redelivered."""

    def __init__(self, message: str) -> None:
        super().__init__(
            f"{message}; exiting so that the pending entries go to a healthy worker",
            "the GPU (nvidia-smi) and EMBEDFLEET_DEVICE",
        )


def is_out_of_memory(error: BaseException) -> bool:
    """A device (or host) allocation failed for this batch."""
    if isinstance(error, torch.OutOfMemoryError | MemoryError):
        return True
    return isinstance(error, RuntimeError) and "out of memory" in str(error).lower()


def is_device_fault(error: BaseException) -> bool:
    """A CUDA error that poisons the context (not out-of-memory, which is recoverable)."""
    if is_out_of_memory(error):
        return False
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(error, accelerator_error):
        return True
    message = str(error).lower()
    return isinstance(error, RuntimeError) and any(text in message for text in _CONTEXT_ERRORS)


class Recovery(Enum):
    """What to do with a batch whose forward pass failed: one policy for the bulk path
    (workers/worker.py) and the query stage (workers/queries.py)."""

    DEVICE_LOST = "device lost"  # stop the worker (DeviceFault), its entries left pending
    SPLIT = "split"  # run each half of the batch on its own
    RETRY = "retry"  # one text out of memory: again after oom_retry_pause_s
    NEVER_FITS = "never fits"  # one text still out of memory after the retries: stop, too
    DEAD_LETTER = "dead letter"  # the texts' own error


def recovery(
    error: BaseException, texts: int, oom_retries: int, *, isolate_model_errors: bool
) -> Recovery:
    """The recovery for ``error`` on a batch of ``texts`` already retried ``oom_retries``
    times. ``isolate_model_errors``: halve a batch on a model error until the failing text is
    alone (the bulk path), rather than dead-letter the whole batch (the query stage)."""
    if is_device_fault(error):
        return Recovery.DEVICE_LOST
    if not is_out_of_memory(error):
        return Recovery.SPLIT if isolate_model_errors and texts > 1 else Recovery.DEAD_LETTER
    if texts > 1:
        return Recovery.SPLIT
    return Recovery.RETRY if oom_retries < OOM_RETRIES_ONE_TEXT else Recovery.NEVER_FITS


def oom_retry_pause_s(retries: int) -> float:
    """How long to wait before one text's next try after out of memory: time for another replica
    on the device to free what it holds (0.5, 1, 2 s)."""
    return 0.5 * 2**retries


def free_device_memory(device: torch.device) -> None:
    """Give cached blocks back so a smaller batch can be allocated; run on the model thread."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
