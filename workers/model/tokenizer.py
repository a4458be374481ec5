"""Texts to token ids and padded batches: the model's fast tokenizer, its prompts, its maximum.

What the encoder (workers/model/encoder.py) hands every forward path: ``Tokenized`` (one text's
token ids, cut to the model's maximum, flagged when cut) and ``EncodeBatch`` (a padded batch).
:class:`TextTokenizer` makes both as sentence-transformers does: the prompt joined before the
text (so its tokens count against the maximum), the cut that keeps a trailing special token,
the prompt table ``encode_query`` / ``encode_document`` choose from, and the padding side the
tokenizer declares.
"""

from __future__ import annotations

import array
import functools
import os
from collections.abc import Sequence
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from embedfleet.shared.ascii_path import AsciiPath
from embedfleet.shared.modelcard import resolve_prompt
from embedfleet.shared.records import require_class_defaults
from embedfleet.shared.tokens import encode_for_model, tokenizer_fingerprint
from embedfleet.workers.model.model_dir import ModelSpec

PromptRole = Literal["query", "document"]


@dataclass(frozen=True)
class Tokenized:
    """One text's token ids (with special tokens), and whether it was cut to fit the model."""

    ids: Sequence[int]  # a list, or the producer's packed array("I") (issue 53)
    truncated: bool
    # leading tokens that are the prompt (with the tokenizer's leading special tokens), as
    # sentence-transformers counts them; excluded from pooling when include_prompt is false
    prompt_length: int = 0
    # segment ids of a (query, document) pair for a cross-encoder; None for a single text
    type_ids: list[int] | None = None

    @functools.cached_property
    def length(self) -> int:
        # read several times per text by the planning and collation (cached in the instance's
        # __dict__, which a frozen dataclass leaves writable to cached_property)
        return len(self.ids)


# ``tokenized`` sets these; type_ids reads as its default from the class
require_class_defaults(Tokenized, ("ids", "truncated", "prompt_length"))


def tokenized(ids: Sequence[int], truncated: bool, prompt_length: int, length: int) -> Tokenized:
    """``Tokenized(ids, truncated, prompt_length)`` with its ``length`` already known, built
    as ``_plain_chunk`` builds a chunk: a frozen dataclass's __init__ sets each field through
    object.__setattr__, and the cached ``length`` takes a lock on first read; a GPU host makes
    tens of thousands a second (issue 53)."""
    item = object.__new__(Tokenized)
    fields = item.__dict__  # type_ids reads as its default, None, from the class
    fields["ids"] = ids
    fields["truncated"] = truncated
    fields["prompt_length"] = prompt_length
    fields["length"] = length
    return item


def flat_ids(items: Sequence[Tokenized], dtype: type[np.integer]) -> np.ndarray:
    """Every item's ids end to end, as one array: one buffer copy where all are the producer's
    packed ``array("I")`` (issue 53), else the Python ints gathered into one list and
    converted in one call (per batch, not per row: the row-by-row copy cost more per text)."""
    rows = [item.ids for item in items]
    if rows and type(rows[0]) is array.array:
        try:  # bytes.join takes any buffer: all of them packed uint32 arrays
            return np.frombuffer(b"".join(rows), dtype=np.uint32).astype(dtype)  # type: ignore[arg-type]
        except TypeError:  # some are lists (cut, or tokenized here): the general way
            pass
    flat: list[int] = []
    gather = flat.extend
    for ids in rows:
        gather(ids)
    return np.array(flat, dtype=dtype)


@dataclass
class EncodeBatch:
    """A padded batch ready for the forward pass."""

    input_ids: torch.Tensor  # (batch, seq) int64
    attention_mask: torch.Tensor  # (batch, seq) int64
    prompt_lengths: torch.Tensor | None = None  # (batch,) int64, when pooling leaves prompts out
    token_type_ids: torch.Tensor | None = None  # (batch, seq) int64, for (query, document) pairs
    # a multi-head model (BGE-M3): the representations to compute from this batch's forward
    # pass, packed into one row per text (workers/model/heads.py); None: the dense vectors alone
    heads: tuple[str, ...] | None = None

    @property
    def size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def padded_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def real_tokens(self) -> int:
        return int(self.attention_mask.sum())


def configure_tokenizer_threads(device: torch.device) -> bool:
    """Whether the Rust tokenizer batch-encodes on all cores, decided by the device unless
    TOKENIZERS_PARALLELISM is set: on a CPU the model's threads own the cores (a tokenizer pool
    beside them stalls their barriers, docs/BENCHMARKS.md "Threads under contention"); on CUDA
    the host cores are otherwise idle, and one tokenizing core cannot feed a GPU doing tens of
    thousands of texts a second. The tokenizers library reads the variable at each batch call."""
    if "TOKENIZERS_PARALLELISM" not in os.environ:
        os.environ["TOKENIZERS_PARALLELISM"] = "true" if device.type == "cuda" else "false"
    return os.environ["TOKENIZERS_PARALLELISM"].lower() in ("1", "true", "yes", "on")


class TextTokenizer:
    """The model's fast tokenizer set up as sentence-transformers uses it (lower-casing where
    the model asks, no padding, cut one token past the maximum so a cut is seen)."""

    def __init__(self, tokenizer: Any, spec: ModelSpec, max_length: int) -> None:
        self.spec = spec
        self.max_length = max_length
        # sentence-transformers' prompt table: "query" and "document" exist (empty) unless the
        # model sets them, which is why encode_query / encode_document never fall back to
        # default_prompt_name; see resolve_prompt.
        self.prompts: dict[str, str] = {"query": "", "document": "", **spec.prompts}
        self.pad_id = int(tokenizer.pad_token_id or 0)
        # decoder-only embedders declare left padding; the pooling reads either side
        self.pad_left = tokenizer.padding_side == "left"
        self.backend = tokenizer.backend_tokenizer
        if spec.do_lower_case:
            _lowercase_normalizer(self.backend)
        self.backend.no_padding()
        # One token over the limit tells us a text was cut; see tokenize().
        self.backend.enable_truncation(max_length + 1)
        self._ends_with_special = self._last_token_is_special()
        # taken once the backend is configured: most ASCII texts skip its normalizer's work
        self.ascii_path = AsciiPath.of(self.backend)

    def _last_token_is_special(self) -> bool:
        encoding = self.backend.encode("a")
        return bool(encoding.special_tokens_mask and encoding.special_tokens_mask[-1])

    # --- prompts ----------------------------------------------------------------------
    def resolve_prompt(
        self, role: PromptRole, prompt_name: str | None, prompt: str | None, role_default: str
    ) -> str:
        """The prompt text for one chunk (``Encoder.resolve_prompt``): shared/modelcard.py's
        ``resolve_prompt``, the rule producers that make token ids follow too. The verifier's
        PromptError (shared/options.py) for a name the model does not declare."""
        return resolve_prompt(
            self.prompts, self.spec.default_prompt_name, role, prompt_name, prompt, role_default
        )

    @functools.lru_cache(maxsize=64)  # noqa: B019 - a few prompts per model, tokenizer lives on
    def prompt_length(self, prompt: str) -> int:
        """Tokens of ``prompt`` at the start of ``prompt + text`` (leading special tokens
        included, a trailing one not): sentence-transformers' ``_get_prompt_length``."""
        encoding = self.backend.encode(prompt)
        length = len(encoding.ids)
        if encoding.special_tokens_mask and encoding.special_tokens_mask[-1]:
            length -= 1
        return length

    # --- tokenize ---------------------------------------------------------------------
    def tokenize(
        self,
        texts: Sequence[str],
        prompts: Sequence[str] | None,
        encode_on: Executor | None = None,
    ) -> list[Tokenized]:
        """Token ids per single text, cut to the maximum (``Encoder.tokenize``); the batch call
        on ``encode_on`` where given (the bulk reader's encoding thread), waited for here."""
        if prompts is not None:
            texts = [prompt + text for prompt, text in zip(prompts, texts, strict=True)]
        if encode_on is None:
            rows = encode_for_model(self.backend, texts, self.max_length, self.ascii_path)
        else:
            rows = encode_on.submit(
                encode_for_model, self.backend, texts, self.max_length, self.ascii_path
            ).result()
        fit = self._fit
        if prompts is None or not any(prompts):
            return [fit(ids) for ids in rows]
        counts = [self.prompt_length(prompt) if prompt else 0 for prompt in prompts]
        return [fit(ids, count) for ids, count in zip(rows, counts, strict=True)]

    # --- token ids made by the producer (issue 53) ------------------------------------
    @functools.cached_property
    def published(self) -> str:
        """This tokenizer as configured here (the model's maximum + 1 cut, lower-casing where
        the model asks), as ``tokenizer.json`` text: what the worker publishes for producers
        and the gateway, who make the same ids from it (``Keys.tokenizer``)."""
        return str(self.backend.to_str())

    @functools.cached_property
    def fingerprint(self) -> str:
        """The model card's ``tokenizer_fingerprint``: producers' ids must carry it."""
        return tokenizer_fingerprint(self.published)

    @functools.cached_property
    def vocab_size(self) -> int:
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    def from_ids(self, ids: Sequence[int], prompt: str) -> Tokenized:
        """A producer's ids of ``prompt + text`` (``encode_for_model`` with the published
        tokenizer), cut to the maximum as :meth:`tokenize` cuts its own."""
        return self._fit(ids, self.prompt_length(prompt) if prompt else 0)

    def _fit(self, ids: Sequence[int], prompt_length: int = 0) -> Tokenized:
        length = len(ids)
        if length <= self.max_length:
            return tokenized(ids, False, prompt_length, length)
        if self._ends_with_special:  # keep [SEP]: same ids as truncating at max_length
            ids = [*ids[: self.max_length - 1], ids[-1]]
        else:
            ids = ids[: self.max_length]
        return tokenized(ids, True, prompt_length, len(ids))

    # --- long inputs in windows (issue 42) ---------------------------------------------
    def windows(
        self, texts: Sequence[str], prompts: Sequence[str] | None, overlap: int
    ) -> list[list[Tokenized]]:
        """Each text's token windows (``split_windows``): a text within the maximum is one
        window, the ids ``tokenize`` gives it; a longer one is tokenized whole (no cut) and
        split, every window with the prompt and the special tokens the tokenizer adds.
        ValueError where ``overlap`` leaves a window no room to advance."""
        cut = self.tokenize(texts, prompts)
        if not any(item.truncated for item in cut):
            return [[item] for item in cut]
        joined = (
            [prompt + text for prompt, text in zip(prompts, texts, strict=True)]
            if prompts is not None
            else list(texts)
        )
        out: list[list[Tokenized]] = []
        for text, item in zip(joined, cut, strict=True):
            if not item.truncated:
                out.append([item])
                continue
            encoding = self._whole.encode(text)
            mask = encoding.special_tokens_mask
            leading = next((i for i, special in enumerate(mask) if not special), len(mask))
            trailing = next(
                (i for i, special in enumerate(reversed(mask)) if not special), len(mask)
            )
            out.append(
                [
                    Tokenized(ids=ids, truncated=False, prompt_length=item.prompt_length)
                    for ids in split_windows(
                        encoding.ids,
                        max_length=self.max_length,
                        # the prompt's tokens (with the leading special tokens) open every window
                        lead=max(leading, item.prompt_length),
                        trail=trailing,
                        overlap=overlap,
                    )
                ]
            )
        return out

    @functools.cached_property
    def _whole(self) -> Any:
        """A copy of the tokenizer that never cuts: a long input's windows are cut from its
        whole ids (the shared one cuts one past the maximum, and other threads use it)."""
        from tokenizers import Tokenizer

        whole = Tokenizer.from_str(self.backend.to_str())
        whole.no_truncation()
        whole.no_padding()
        return whole

    # --- batch ------------------------------------------------------------------------
    def collate(self, items: list[Tokenized], *, pin: bool = False) -> EncodeBatch:
        """A padded batch of ``items`` (``Encoder.collate``): every row's ids laid into the
        batch at once, row after row, where the attention mask is 1 (its row-major order is
        each row's ids in order, on either padding side)."""
        lengths = np.fromiter((item.length for item in items), dtype=np.int64, count=len(items))
        longest = int(lengths.max())
        shape = (len(items), longest)
        ids_tensor = torch.full(shape, self.pad_id, dtype=torch.int64, pin_memory=pin)
        mask_tensor = torch.empty(shape, dtype=torch.int64, pin_memory=pin)
        columns = np.arange(longest)
        if self.pad_left:
            real = columns >= (longest - lengths)[:, None]
        else:
            real = columns < lengths[:, None]
        mask_tensor.numpy()[...] = real
        ids_tensor.numpy()[real] = flat_ids(items, np.int64)
        types_tensor = None
        if any(item.type_ids is not None for item in items):
            types_tensor = torch.zeros(shape, dtype=torch.int64, pin_memory=pin)
            for row, item in enumerate(items):
                if item.type_ids is not None:
                    start = longest - item.length if self.pad_left else 0
                    types_tensor.numpy()[row, start : start + item.length] = item.type_ids
        prompt_lengths = None
        if not self.spec.include_prompt:
            prompt_lengths = torch.tensor([item.prompt_length for item in items])
        return EncodeBatch(
            input_ids=ids_tensor,
            attention_mask=mask_tensor,
            prompt_lengths=prompt_lengths,
            token_type_ids=types_tensor,
        )


def split_windows(
    ids: Sequence[int], *, max_length: int, lead: int, trail: int, overlap: int
) -> list[list[int]]:
    """A long input's token windows (issue 42): ``ids`` (the whole text's, special tokens in)
    cut into windows of at most ``max_length`` ids, each opening with the ``lead`` first ids
    (the leading special tokens and any prompt) and closing with the ``trail`` last ones (the
    trailing special tokens), as the tokenizer frames one text. The ids between are covered by
    consecutive spans that share ``overlap`` ids with their neighbour; the last span ends at
    the text's end, so it may be shorter. ValueError where the overlap (or the frame) leaves a
    span no room to advance."""
    room = max_length - lead - trail
    if overlap < 0 or room - overlap < 1:
        raise ValueError(
            f"window_overlap={overlap} leaves no room: a window holds {max(room, 0)} tokens of "
            f"text (the model's {max_length} less {lead + trail} special and prompt tokens); "
            f"use 0..{max(room - 1, 0)}"
        )
    head, body, tail = list(ids[:lead]), ids[lead : len(ids) - trail], list(ids[len(ids) - trail :])
    if len(body) <= room:
        return [[*head, *body, *tail]]
    step = room - overlap
    windows: list[list[int]] = []
    start = 0
    while True:
        windows.append([*head, *body[start : start + room], *tail])
        if start + room >= len(body):
            return windows
        start += step


def _lowercase_normalizer(backend: object) -> None:
    """``do_lower_case``: lower-case before the tokenizer's own normalizer, as
    sentence-transformers does for a fast tokenizer."""
    from tokenizers.normalizers import Lowercase
    from tokenizers.normalizers import Sequence as NormalizerSequence

    normalizer = backend.normalizer  # type: ignore[attr-defined]
    if normalizer is not None and "Lowercase" in repr(normalizer):
        return
    parts = [Lowercase()]
    if normalizer is not None:
        parts.append(normalizer)
    backend.normalizer = NormalizerSequence(parts)  # type: ignore[attr-defined]
