"""Compute precision: what EMBEDFLEET_DTYPE asks for, how it runs, and the parity probe.

``float32`` / ``bfloat16`` / ``float16`` are used as asked. ``auto`` picks the faster reduced
precision of the device (bf16 on a CPU with AVX512-BF16/AMX or a GPU that has it, else fp16 on
a GPU) and keeps it **only if its vectors match fp32's** on a fixed built-in set: min
cosine >= 0.99 and mean >= 0.999 (:data:`MIN_COSINE`, :data:`MEAN_COSINE`), on the probe texts
and the held-out set (:data:`GATE_TEXTS`, workers/model/heldout.py: multilingual, long and odd
inputs, disjoint from every calibration text). The probe runs once, at model load; its figures
are logged (and printed by ``python -m embedfleet.workers.model.probe``), and a failing probe
falls back to fp32 with a warning rather than serving worse vectors.

Every other forward path the worker may choose at start (the int8 copies of workers/model/int8.py)
is held to the same bar on the same held-out set by :func:`gate`, against the float32 vectors
kept from that probe (:attr:`ParityReport.heldout_reference`).

How reduced precision runs (:class:`Precision.method`):

``weights``
    The weights are cast to the dtype and every op runs in it. The usual choice on GPUs, and
    on this CPU too: see :data:`CPU_BF16_METHOD`.
``autocast``
    fp32 weights, ``torch.autocast`` runs matmuls in bf16 and keeps layer norm / softmax in
    fp32. Slightly closer to fp32, but every linear re-casts its weight on every call.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch

from embedfleet.shared.logging import get_logger
from embedfleet.workers.cpus import cpu_class
from embedfleet.workers.model.heldout import GROUPS, HELDOUT_TEXTS

log = get_logger("embedfleet.precision")

DtypeName = Literal["auto", "float32", "bfloat16", "float16"]
Method = Literal["none", "weights", "autocast"]

# The acceptance bar for `auto` (the issue's): every probe vector within cosine 0.99 of its
# fp32 vector, and the average within 0.999. bf16 here measures ~0.9999 min, so the bar
# rejects a broken kernel or an unsuitable model, not ordinary rounding.
MIN_COSINE = 0.99
MEAN_COSINE = 0.999

# How bf16 runs on CPU: weights cast to bf16 once, not autocast (which re-casts every weight on
# every call, and measured slower; both hold parity; docs/BENCHMARKS.md, precisions).
CPU_BF16_METHOD: Method = "weights"

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

# A fixed probe: short queries, prose of several lengths, code, numbers, accents, CJK, and a
# long passage near the model's limit, because reduced precision fails first on long inputs
# (long sums in attention and pooling) and on unusual tokens.
_LONG_PASSAGE = (
    "The garbage collector in CPython is a supplement to reference counting: every object "
    "keeps a count of the references to it and is freed as soon as the count drops to zero, "
    "which handles most objects promptly and deterministically. Reference counting alone "
    "cannot reclaim reference cycles, such as a list that contains itself or two objects "
    "that refer to each other, so a generational cycle detector runs periodically. Objects "
    "start in the youngest generation; those that survive a collection are promoted to an "
    "older one, and older generations are examined less often, on the observation that most "
    "objects die young. The thresholds that trigger each collection can be read and changed "
    "with gc.get_threshold and gc.set_threshold, collection can be forced with gc.collect, "
    "and gc.freeze moves every current object into a permanent generation that is ignored by "
    "future collections, which helps forked worker processes keep memory pages shared."
)
PROBE_TEXTS: tuple[str, ...] = (
    "hello",
    "how do I reverse a list in python",
    "What is the capital of France?",
    "Redis streams consumer group XAUTOCLAIM semantics",
    "The quick brown fox jumps over the lazy dog.",
    "Return a new sorted list from the items in iterable.",
    "A stream entry is acknowledged only after its result is durably written.",
    "def add(a: int, b: int) -> int:\n    return a + b  # simple addition",
    "SELECT id, vector FROM embeddings WHERE job = 'docs' ORDER BY id LIMIT 10;",
    "3.14159 2.71828 1.41421 6.02214076e23 -273.15 0xFF 0b1010",
    "Café naïve résumé façade coöperate — em dash, “quotes”, and ellipsis…",
    "東京は日本の首都です。 北京是中国的首都。",
    "Der schnelle braune Fuchs springt über den faulen Hund.",
    "error: connection refused (ECONNREFUSED) while reading from socket 127.0.0.1:6379",
    "Python's asyncio event loop runs coroutines cooperatively on a single thread; blocking "
    "calls must go to an executor so that the loop can keep serving other tasks.",
    "Transformers compute attention between every pair of tokens in a sequence, so the cost "
    "grows with the square of its length, while the feed-forward layers grow linearly.",
    "ok ok ok ok ok ok ok ok ok ok ok ok ok ok ok ok ok ok ok ok ok ok ok ok ok ok ok ok",
    _LONG_PASSAGE,
    _LONG_PASSAGE + " " + _LONG_PASSAGE,  # over the limit: the truncated path
    "https://docs.python.org/3/library/stdtypes.html#str.split?highlight=split&lang=en",
)
# The held-out gate set: no path was calibrated on it (workers/model/heldout.py).
GATE_TEXTS: tuple[str, ...] = HELDOUT_TEXTS
# Texts per forward pass while probing: the long held-out passages padded into one batch with
# everything else would compute (and hold in attention) every text at the longest length.
PROBE_BATCH = 16

# A bulk-shaped batch for timing (the worker's speed seed, the int8 copy's race with bf16): 64
# short and mid-length probe texts, about 1,500 tokens.
BULK_PROBE_TEXTS: tuple[str, ...] = PROBE_TEXTS[1:17] * 4


@dataclass(frozen=True)
class Precision:
    """The compute precision and how it is applied."""

    dtype: torch.dtype
    method: Method

    @property
    def name(self) -> str:
        return str(self.dtype).removeprefix("torch.")

    @property
    def weights_dtype(self) -> torch.dtype:
        """The dtype the weights are held in."""
        return self.dtype if self.method == "weights" else torch.float32

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        return self.dtype if self.method == "autocast" else None

    def context(self, device: torch.device) -> contextlib.AbstractContextManager[object]:
        """Wrap the forward pass in this: autocast where that is the method, else nothing."""
        if self.method == "autocast":
            return torch.autocast(device.type, dtype=self.dtype)
        return contextlib.nullcontext()

    def describe(self) -> str:
        return "float32" if self.method == "none" else f"{self.name} ({self.method})"


FP32 = Precision(torch.float32, "none")


def cpu_supports_bf16() -> bool:
    """bf16 runs natively here, as torch dispatches (workers/cpus.py: AVX512-BF16 or AMX, and
    torch at its AVX-512 level; an AVX2-only CPU, or one emulated, emulates bf16 slowly)."""
    return cpu_class().fast_bf16


def reduced_dtype(device: torch.device) -> torch.dtype:
    """The reduced precision ``auto`` tries on ``device`` (float32 when there is none)."""
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    if device.type == "cpu" and cpu_supports_bf16():
        return torch.bfloat16
    return torch.float32


def requested_precision(dtype: str, device: torch.device) -> Precision:
    """The precision to load with: the one asked for, or ``auto``'s candidate (still unchecked)."""
    target = reduced_dtype(device) if dtype == "auto" else DTYPES[dtype]
    if target == torch.float32:
        return FP32
    if device.type == "cpu" and target == torch.bfloat16:
        return Precision(target, CPU_BF16_METHOD)
    return Precision(target, "weights")


@dataclass(frozen=True)
class ParityReport:
    """How the candidate precision's probe vectors compare with fp32's."""

    candidate: Precision
    min_cosine: float
    mean_cosine: float
    texts: int
    # float32's vectors of GATE_TEXTS, kept to gate the other paths against (workers/model/int8.py)
    heldout_reference: np.ndarray | None = field(default=None, repr=False, compare=False)

    @property
    def passed(self) -> bool:
        return holds_bar(self.min_cosine, self.mean_cosine)

    def line(self) -> str:
        verdict = "kept" if self.passed else "rejected, using float32"
        return (
            f"precision auto: {self.candidate.describe()} vs float32 on {self.texts} probe and "
            f"held-out texts: min cosine {self.min_cosine:.6f} (>= {MIN_COSINE}), mean "
            f"{self.mean_cosine:.7f} (>= {MEAN_COSINE}): {verdict}"
        )


def holds_bar(min_cosine: float, mean_cosine: float) -> bool:
    """The one parity bar of every precision and path (NaN fails it)."""
    return min_cosine >= MIN_COSINE and mean_cosine >= MEAN_COSINE


@dataclass(frozen=True)
class GateReport:
    """A forward path's vectors of the held-out set against float32's: the bar, overall and
    per group (the log says which group failed)."""

    path: str
    min_cosine: float
    mean_cosine: float
    texts: int
    groups: dict[str, tuple[float, float]]  # group -> (min, mean)

    @property
    def passed(self) -> bool:
        return holds_bar(self.min_cosine, self.mean_cosine)

    def log_fields(self) -> dict[str, object]:
        return {
            "path": self.path,
            "min_cosine": round(self.min_cosine, 6),
            "mean_cosine": round(self.mean_cosine, 7),
            "texts": self.texts,
            **{
                f"{group}_min_mean": f"{low:.5f}/{mean:.6f}"
                for group, (low, mean) in self.groups.items()
            },
            "verdict": "passed" if self.passed else "rejected",
        }


def gate(path: str, reference: np.ndarray, vectors: np.ndarray) -> GateReport:
    """Hold ``vectors`` (a path's, of :data:`GATE_TEXTS` in order) to the bar against float32's
    ``reference``; logged either way."""
    if reference.shape != vectors.shape or len(vectors) != len(GATE_TEXTS):
        raise ValueError(
            f"the gate compares {len(GATE_TEXTS)} held-out vectors: got {vectors.shape} "
            f"against {reference.shape}"
        )
    values = cosines(reference, vectors)
    groups: dict[str, tuple[float, float]] = {}
    start = 0
    for group, texts in GROUPS.items():
        part = values[start : start + len(texts)]
        groups[group] = (float(part.min()), float(part.mean()))
        start += len(texts)
    report = GateReport(
        path=path,
        min_cosine=float(values.min()),
        mean_cosine=float(values.mean()),
        texts=len(values),
        groups=groups,
    )
    (log.info if report.passed else log.warning)("held-out parity gate", **report.log_fields())
    return report


def embed_in_batches(
    embed: Callable[[Sequence[str]], np.ndarray], texts: Sequence[str], size: int = PROBE_BATCH
) -> np.ndarray:
    """``embed`` over ``texts`` a few at a time, vectors in the texts' order. The texts go in
    sorted by length, as the worker batches them: a batch pads to its longest text, and the
    probe and held-out sets mix one-word queries with passages near the model's limit."""
    order = sorted(range(len(texts)), key=lambda index: len(texts[index]))
    in_order = [texts[index] for index in order]
    vectors = np.concatenate(
        [embed(in_order[start : start + size]) for start in range(0, len(in_order), size)]
    )
    restored = np.empty_like(vectors)
    restored[order] = vectors
    return restored


def cosines(reference: np.ndarray, candidate: np.ndarray) -> np.ndarray:
    """Row-wise cosine similarity of two (n, dim) arrays."""
    reference = reference.astype(np.float64)
    candidate = candidate.astype(np.float64)
    dots = (reference * candidate).sum(axis=1)
    norms = np.linalg.norm(reference, axis=1) * np.linalg.norm(candidate, axis=1)
    return dots / np.maximum(norms, 1e-12)


def parity(
    reference: np.ndarray,
    candidate: np.ndarray,
    precision: Precision,
    heldout_reference: np.ndarray | None = None,
) -> ParityReport:
    values = cosines(reference, candidate)
    return ParityReport(
        candidate=precision,
        min_cosine=float(values.min()),
        mean_cosine=float(values.mean()),
        texts=len(values),
        heldout_reference=heldout_reference,
    )


@contextlib.contextmanager
def _reversible_cast(model: torch.nn.Module, dtype: torch.dtype) -> Iterator[Callable[[], None]]:
    """Cast ``model`` to ``dtype``; unless the yielded ``keep()`` is called, restore fp32 exactly.

    A bf16 round trip loses mantissa bits, so the fp32 tensors are kept aside until the
    probe has decided.
    """
    if dtype == torch.float32:  # autocast: the weights stay as they are
        yield lambda: None
        return
    saved = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    kept = False

    def keep() -> None:
        nonlocal kept
        kept = True

    model.to(dtype)
    try:
        yield keep
    finally:
        if not kept:
            model.to(torch.float32)
            model.load_state_dict(saved)
        saved.clear()


def settle_auto(
    model: torch.nn.Module,
    candidate: Precision,
    embed: Callable[[Sequence[str]], np.ndarray],
    set_precision: Callable[[Precision], None],
) -> tuple[Precision, ParityReport | None]:
    """Run the parity probe for ``auto`` and return the precision to use, with its report.

    ``model`` holds fp32 weights on entry; ``embed`` encodes texts with whatever precision
    ``set_precision`` last set. The model is left in the dtype of the precision returned. The
    report keeps float32's vectors of the held-out set, for :func:`gate`.
    """
    if candidate == FP32:
        return FP32, None
    texts = PROBE_TEXTS + GATE_TEXTS
    set_precision(FP32)
    reference = embed_in_batches(embed, texts)
    with _reversible_cast(model, candidate.weights_dtype) as keep:
        set_precision(candidate)
        report = parity(
            reference,
            embed_in_batches(embed, texts),
            candidate,
            heldout_reference=reference[len(PROBE_TEXTS) :],
        )
        if report.passed:
            keep()
    chosen = candidate if report.passed else FP32
    set_precision(chosen)
    (log.info if report.passed else log.warning)(
        "precision probe",
        candidate=candidate.describe(),
        min_cosine=round(report.min_cosine, 6),
        mean_cosine=round(report.mean_cosine, 7),
        texts=report.texts,
        verdict="kept" if report.passed else "rejected: using float32",
    )
    return chosen, report


def settle(
    dtype: str,
    candidate: Precision,
    *,
    pooled: bool,
    model: torch.nn.Module,
    embed: Callable[[Sequence[str]], np.ndarray],
    set_precision: Callable[[Precision], None],
) -> tuple[Precision, ParityReport | None]:
    """The precision a freshly loaded model computes in, with the probe's report where one ran:
    ``candidate`` where ``dtype`` names one; under ``auto``, :func:`settle_auto`'s verdict for a
    model whose output is ``pooled`` sentence vectors, and float32 for any other (the probe
    compares pooled vectors by cosine: not what a sparse, per-token or score head gives;
    float32 until they have their own bar)."""
    if dtype != "auto":
        return candidate, None
    if not pooled:
        return FP32, None
    return settle_auto(model, candidate, embed, set_precision)
