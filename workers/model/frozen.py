"""A frozen TorchScript copy of the model on CPU, for the query stage and (by default) bulk.

A query is one forward pass of a dozen tokens. On a CPU that pass costs little arithmetic and a
lot of fixed work: eager PyTorch hands every weight to oneDNN afresh on each call, and runs
each op through the Python module tree. ``torch.jit.freeze`` + ``optimize_for_inference``
pre-packs the weights once and fuses the graph (docs/BENCHMARKS.md has the measurements).

Bulk batches run the frozen graph too unless ``EMBEDFLEET_FROZEN_BULK=false``. A traced graph
has no Python hooks between layers, so queries get in between bulk batches, not inside one:
the worker sizes bulk batches to the query slice instead (``EMBEDFLEET_SLICE_MS``).

The copy is kept only if it matches the eager model on the precision probe texts (padded
batches and single texts); a model that does not trace, or traces wrong, keeps the eager path.
That fallback is designed behaviour, not a fault (queries are as correct, only slower), so it
is said once per process, at info, with the reason.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Sequence
from typing import TypeVar

import numpy as np
import torch

from embedfleet.shared.logging import get_logger
from embedfleet.workers.model.precision import cosines

log = get_logger("embedfleet.frozen")
_fallback_reported = False

# Frozen and eager run the same fp32/bf16 kernels up to summation order: anything below this
# is a wrong trace, not rounding (measured 0.9999998 over 300 texts in batches of 1-8).
FROZEN_MIN_COSINE = 0.99999
# In bf16/fp16 both paths round every layer's output to 8 (11) mantissa bits, and summation
# order decides which way: frozen vs eager min cosine read 0.999922 on the probe texts on Zen 4
# (avx512_bf16) as on Zen 5, the same distance each has from float32 (eager 0.99993, frozen
# 0.99990); a wrong trace is orders of magnitude further off. So reduced precision gets the
# rounding bar, not float32's (the frozen copy was rejected on Zen 5 for rounding alone).
FROZEN_MIN_COSINE_REDUCED = 0.9995


def frozen_min_cosine(dtype: torch.dtype) -> float:
    """The bar a frozen copy computing in ``dtype`` must meet against the eager model."""
    return FROZEN_MIN_COSINE if dtype == torch.float32 else FROZEN_MIN_COSINE_REDUCED


Batch = TypeVar("Batch")


class FrozenForward:
    """``(input_ids, attention_mask) -> last_hidden_state`` through the frozen graph."""

    def __init__(self, graph: torch.jit.ScriptModule) -> None:
        self._graph = graph

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        output = self._graph(input_ids, attention_mask)
        # a traced Hugging Face model returns a dict (or a tuple) where eager returns an object
        return output["last_hidden_state"] if isinstance(output, dict) else output[0]


def hook_free_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A deep copy of ``model`` in eval mode to build a graph from: without the slice-boundary
    hooks (the graph must not call them) and without BERT's [CLS] pooler (never used here)."""
    model_copy = copy.deepcopy(model).eval()
    for module in model_copy.modules():
        module._forward_pre_hooks.clear()
        module._forward_hooks.clear()
    if getattr(model_copy, "pooler", None) is not None:
        # torch types Module.__setattr__'s value as Tensor | Module; None is what it takes to
        # drop a submodule (it stays registered, as None)
        model_copy.pooler = None  # type: ignore[assignment]
    return model_copy


def freeze(model: torch.nn.Module, example: tuple[torch.Tensor, torch.Tensor]) -> FrozenForward:
    """Trace a copy of ``model`` on ``example`` (input_ids, attention_mask) and freeze it.

    The example should have padding in it: branches that depend on the mask are recorded as
    taken at trace time.
    """
    frozen_copy = hook_free_copy(model)
    with torch.inference_mode(False), torch.no_grad(), warnings.catch_warnings():
        # TracerWarnings about shape checks that are constant for our inputs (mask given)
        warnings.simplefilter("ignore")
        traced = torch.jit.trace(frozen_copy, example, strict=False, check_trace=False)
        graph = torch.jit.optimize_for_inference(torch.jit.freeze(traced.eval()))
    return FrozenForward(graph)


def build_checked(
    build: Callable[[], FrozenForward],
    eager: Callable[[Batch], np.ndarray],
    frozen: Callable[[FrozenForward, Batch], np.ndarray],
    probe_batches: Sequence[Batch],
    min_cosine: float = FROZEN_MIN_COSINE,
) -> FrozenForward | None:
    """``build()``, then keep the result only if it embeds every probe batch like ``eager``
    (min cosine ``min_cosine``: :func:`frozen_min_cosine` of the compute dtype)."""
    try:
        forward = build()
        per_text = [cosines(eager(batch), frozen(forward, batch)) for batch in probe_batches]
        worst = float(np.min(np.concatenate(per_text)))  # NaN stays NaN (Python's min drops it)
    except Exception as error:  # tracing fails on some architectures: eager still works
        _eager_fallback(f"the model does not trace: {error!r}")
        return None
    if not worst >= min_cosine:  # also catches NaN
        _eager_fallback(
            f"the frozen graph's vectors differ from the model's (min cosine {worst:.6f} < "
            f"{min_cosine}): its fused kernels do not hold parity on this machine"
        )
        return None
    log.info("frozen query graph ready", min_cosine_vs_eager=round(worst, 7))
    return forward


def _eager_fallback(reason: str) -> None:
    """Say once per process (at info: nothing is wrong) that queries run eager, and why."""
    global _fallback_reported
    if _fallback_reported:
        log.debug("queries run eager (frozen query graph not used)", reason=reason)
        return
    _fallback_reported = True
    log.info("queries run eager (frozen query graph not used)", reason=reason)
