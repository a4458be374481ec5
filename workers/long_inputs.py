"""Long inputs embedded whole (issue 42): a chunk with ``window_overlap`` whose text is over the
model's maximum becomes several forward rows, one per token window, and one result again.

The intake stage splits it (``expand``): the window holds one row per token window, each with
the chunk and its entry repeated, so the rows are sorted, planned and packed with every other
text of the window (``workers/batcher.py``) and cost one forward row each. The windows of one
input may land in different batches; the compute stage hands each collected batch through the
window's :class:`Rejoin`, which keeps the rows of an input until all have come and then passes
it on as one row: its windows' vectors averaged, weighted by their tokens, and normalised as
the model normalises (``workers/output.py``, ``pool_windows``). Everything after (dimensions,
output precision, the vector cache, the write, the acknowledgement) sees one input.

The mean is taken before the model's Normalize, as the model pooled each window: the batches
of a window holding long inputs are computed with the Normalize module left out
(``before_normalize``; every forward path runs the modules after pooling in Python, on the
thread that launched the batch: workers/model/model_dir.py ``head_normalizes``), and the rejoin
normalises every row it hands on, the other texts' as theirs would have been.

A chunk with ``normalize`` false (TEI's ``normalize: false``) wants the vector before Normalize
itself: a window holding one is computed the same way (a rejoin with no long input), and its row
is handed on as computed (``normalized_except``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple, TypeVar

import numpy as np

from embedfleet.shared.dead_letters import DeadReason
from embedfleet.shared.postprocess import normalize as normalize_rows
from embedfleet.shared.protocol import Chunk
from embedfleet.sinks import Delivery
from embedfleet.workers.dead_letter_writer import Rejected
from embedfleet.workers.model.encoder import Tokenized
from embedfleet.workers.model.model_dir import head_normalizes
from embedfleet.workers.output import pool_windows

T = TypeVar("T")

EntryKey = tuple[str, str]  # (stream, entry id): a delivery, whatever its accounting says


def entry_key(delivery: Delivery) -> EntryKey:
    return delivery.stream, delivery.entry_id


def before_normalize_wanted(chunks: Sequence[Chunk], model_normalizes: bool) -> bool:
    """Whether a chunk of ``chunks`` asks for the vector before the model's Normalize (a model
    without one answers that vector anyway)."""
    return model_normalizes and any(chunk.normalize is False for chunk in chunks)


def normalized_except(
    vectors: np.ndarray, chunks: Sequence[Chunk], model_normalizes: bool
) -> np.ndarray:
    """Rows computed before Normalize (float32), one per chunk, normalised as the model
    normalises except those whose chunk asks for them as they are (``normalize`` false)."""
    rows = np.asarray(vectors, dtype=np.float32)
    if not model_normalizes or not len(rows):
        return rows
    keep = np.array([chunk.normalize is False for chunk in chunks], dtype=bool)
    if not keep.any():
        return normalize_rows(rows)
    return np.where(keep[:, None], rows, normalize_rows(rows)).astype(np.float32, copy=False)


def before_normalize(launch: Callable[[], T]) -> T:
    """``launch()`` (a forward pass, on the model thread) with the model's Normalize left out:
    its rows come back as pooled (and through any Dense modules), for the rejoin."""
    with head_normalizes(False):
        return launch()


def whole(windows: Sequence[Tokenized]) -> Tokenized:
    """One input's windows as the accounting sees them: every token computed (the length), not
    cut (``truncated`` false)."""
    ids = [token for window in windows for token in window.ids]
    return Tokenized(ids=ids, truncated=False, prompt_length=windows[0].prompt_length)


class Rows(NamedTuple):
    """A collected batch's rows, column by column, as the rejoin takes and hands them on."""

    chunks: list[Chunk]
    deliveries: list[Delivery]  # accounted per row (tokens, model time)
    tokens: list[Tokenized]
    vectors: np.ndarray
    content_keys: list[str | None]  # one per row, or empty: none handed on


@dataclass
class _Pending:
    """The rows of one long input collected so far."""

    expected: int
    vectors: list[np.ndarray] = field(default_factory=list)
    tokens: list[Tokenized] = field(default_factory=list)
    deliveries: list[Delivery] = field(default_factory=list)
    content_key: str | None = None


@dataclass
class Rejoin:
    """A window's long inputs, rejoined: their rows held until every window has come back.
    The window's batches come back before the model's Normalize (``before_normalize``):
    ``normalize`` (the model's) normalises every row handed on."""

    normalize: bool
    _pending: dict[EntryKey, _Pending] = field(default_factory=dict)
    # inputs dead-lettered for a window that failed: their other rows are dropped
    _failed: set[EntryKey] = field(default_factory=set)

    def expect(self, delivery: Delivery, rows: int) -> None:
        self._pending[entry_key(delivery)] = _Pending(rows)

    def __contains__(self, delivery: Delivery) -> bool:
        key = entry_key(delivery)
        return key in self._pending or key in self._failed

    @property
    def waiting(self) -> int:
        """Long inputs with rows still to come."""
        return len(self._pending)

    def fail(self, delivery: Delivery) -> bool:
        """A window of this input failed in the model: whether it is to be dead-lettered now
        (the first failure; its rows held and to come are dropped)."""
        key = entry_key(delivery)
        if key in self._failed:
            return False
        self._pending.pop(key, None)
        self._failed.add(key)
        return True

    def take(self, rows: Rows) -> Rows:
        """One collected batch's rows (``deliveries`` accounted per row) → the rows of whole
        inputs: the others as they are, then each long input whose last window this is, pooled
        (its tokens and model time summed); rows of inputs still waiting are held."""
        chunks, deliveries, tokens, vectors, content_keys = rows
        keep, done = self._collect(rows)
        out_chunks = [chunks[r] for r in keep]
        out_deliveries = [deliveries[r] for r in keep]
        out_tokens = [tokens[r] for r in keep]
        out_keys = [content_keys[r] for r in keep] if content_keys else []
        # the batch was computed before Normalize (``before_normalize``): the other texts'
        # rows are normalised here as the model would have
        kept = np.asarray(vectors[keep], dtype=np.float32)
        parts = [normalized_except(kept, out_chunks, self.normalize)] if keep else []
        if done:
            parts.append(
                normalized_except(_pooled(done), [chunk for chunk, _ in done], self.normalize)
            )
            out_chunks += [chunk for chunk, _ in done]
            out_deliveries += [_summed(pending.deliveries) for _, pending in done]
            out_tokens += [whole(pending.tokens) for _, pending in done]
            if content_keys:
                out_keys += [pending.content_key for _, pending in done]
        width = vectors.shape[1] if vectors.ndim == 2 else 0
        joined = np.concatenate(parts) if parts else np.zeros((0, width), dtype=np.float32)
        return Rows(out_chunks, out_deliveries, out_tokens, joined, out_keys)

    def _collect(self, rows: Rows) -> tuple[list[int], list[tuple[Chunk, _Pending]]]:
        """The batch's rows of other inputs (to hand on), and the long inputs this batch
        completes; the rows of long inputs are added to what is held for them."""
        chunks, deliveries, tokens, vectors, content_keys = rows
        keep: list[int] = []
        done: list[tuple[Chunk, _Pending]] = []
        for row, delivery in enumerate(deliveries):
            key = entry_key(delivery)
            pending = self._pending.get(key)
            if pending is None:
                if key not in self._failed:
                    keep.append(row)
                continue
            pending.vectors.append(vectors[row])
            pending.tokens.append(tokens[row])
            pending.deliveries.append(delivery)
            if content_keys:
                pending.content_key = content_keys[row]
            if len(pending.vectors) == pending.expected:
                done.append((chunks[row], self._pending.pop(key)))
        return keep, done


def _pooled(done: list[tuple[Chunk, _Pending]]) -> np.ndarray:
    """Each completed long input's windows pooled into one row (not normalised yet)."""
    rows = [vector for _, pending in done for vector in pending.vectors]
    return pool_windows(
        np.stack(rows),
        [pending.expected for _, pending in done],
        [t.length for _, pending in done for t in pending.tokens],
        normalize=False,
    )


def _summed(deliveries: list[Delivery]) -> Delivery:
    """A long input's delivery: its first window's, with every window's tokens and model time."""
    first = deliveries[0]
    return Delivery(
        first.stream,
        first.entry_id,
        first.job,
        first.tenant,
        first.model,
        sum(d.tokens for d in deliveries),
        sum(d.model_us for d in deliveries),
        first.copy,
    )


def expand(
    chunks: list[Chunk],
    deliveries: list[Delivery],
    tokens: list[Tokenized],
    windows: dict[int, list[Tokenized]],
    rejoin: Rejoin,
) -> tuple[list[Chunk], list[Delivery], list[Tokenized]]:
    """A window's rows with each long input (``windows``: its token windows, by position)
    in place of its one cut row: the chunk and its entry repeated per window, told to
    ``rejoin``."""
    out_chunks: list[Chunk] = []
    out_deliveries: list[Delivery] = []
    out_tokens: list[Tokenized] = []
    for position, (chunk, delivery, tokenized) in enumerate(
        zip(chunks, deliveries, tokens, strict=True)
    ):
        rows = windows.get(position, [tokenized])
        if len(rows) > 1:
            rejoin.expect(delivery, len(rows))
        out_chunks += [chunk] * len(rows)
        out_deliveries += [delivery] * len(rows)
        out_tokens += rows
    return out_chunks, out_deliveries, out_tokens


# a tokenizer's ``windows`` (workers/model/tokenizer.py): texts, their prompts, the overlap
WindowsOf = Callable[[Sequence[str], Sequence[str] | None, int], list[list[Tokenized]]]


def token_windows(
    windows_of: WindowsOf,
    chunks: Sequence[Chunk],
    deliveries: Sequence[Delivery],
    tokens: Sequence[Tokenized],
    prompts: Sequence[str],
) -> tuple[dict[int, list[Tokenized]], dict[int, Rejected]]:
    """The token windows of each chunk with ``window_overlap`` whose text was cut, and the
    rejections of those whose overlap leaves a window no room (both by position). The bulk
    reader's windows and the query stage both split their long inputs here."""
    windows: dict[int, list[Tokenized]] = {}
    refused: dict[int, Rejected] = {}
    for position, (chunk, tokenized) in enumerate(zip(chunks, tokens, strict=True)):
        overlap = chunk.window_overlap
        if overlap is None or not tokenized.truncated:
            continue
        prompt = prompts[position]
        try:
            windows[position] = windows_of([chunk.text], [prompt] if prompt else None, overlap)[0]
        except ValueError as error:
            refused[position] = Rejected.chunk(
                deliveries[position], chunk, DeadReason.OPTIONS, str(error)
            )
    return windows, refused
