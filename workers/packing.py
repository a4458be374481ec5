"""Packed batches: several sequences per row, so padding is not computed.

Three ways to lay out a micro-batch of tokenized texts for the forward pass:

``padded``
    One text per row, right-padded to the longest (``Encoder.collate``). After sorting the
    window by length (``workers.batcher``) padding is a few percent of the tokens.
``rows``
    Texts packed first-fit-decreasing into rows of a fixed width; positions restart at 0 for
    each text and a boolean block-diagonal mask keeps texts from attending to each other. The
    linear layers see no padding, but attention is computed over the whole row (the mask only
    zeroes the cross terms), so wide rows of short texts cost more attention than they save.
    Works with stock SDPA on any device.
``varlen``
    All texts of the batch concatenated into one row with ``cu_seqlens`` offsets; attention
    runs per text through a variable-length kernel: flash-attn's ``flash_attn_varlen_func``
    where installed (CUDA, fp16/bf16), else SDPA on nested jagged tensors, else a plain loop
    over the texts (the fallback that always exists). No padding anywhere.

The worker does not run these layouts yet: it embeds sorted, padded micro-batches
(``workers.batcher`` + ``Encoder.collate``) on every device, and this module is imported only by
``loadtest/bench.py`` and ``tests/test_packing.py``. It is kept for the two places where the
figures say a packed layout should win, each with its issue: ``varlen`` as the CUDA worker's
path (issue 18) and ``rows`` for bf16 on a CPU with several threads (issue 17, which measures
it again first). :func:`preferred_layout` says which layout the figures favour, from benchmark
runs (``python -m loadtest.bench --engines`` and per-window interleaved runs;
docs/BENCHMARKS.md), not from theory. On a 2-core Intel Xeon we measured:

- fp32: sorted ``padded`` micro-batches are fastest (rows 0.90x, greedy fill 0.96x, per window
  interleaved, 2 threads, quiet machine). With ~4% padding left there is little to win, and
  rows compute attention over the whole row.
- bf16: packed ``rows`` of 256 are faster (1.38x and 1.43x per window on the quiet machine,
  1.87x under load, 2 threads; in the 3-round benchmark rows won 2 rounds of 3, ratio 5.17 vs
  4.64). In bf16 the matmuls are cheap and each forward pass's fixed costs (dispatch, thread
  barriers, oneDNN primitives for each new shape) dominate; rows give few, large,
  identically-shaped batches. With one thread rows were 0.89x: the gain is parallel efficiency.
- varlen on CPU runs attention text by text: 0.54x (bf16), 0.91x (fp32).

On CUDA, ``varlen`` is the layout: there kernels exist that skip padding entirely, and a GPU
pays a padded token's full cost.

Every layout must give the vectors the unpadded model gives: ``tests/test_packing.py`` checks
min cosine >= 0.9999 in fp32 on real texts, on the CPU form of this same code.
"""

from __future__ import annotations

import inspect
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import torch.nn.functional as F

from embedfleet.shared.logging import get_logger
from embedfleet.workers.encoder import Encoder, PoolingMode, Tokenized

log = get_logger("embedfleet.packing")

PackLayout = Literal["padded", "rows", "varlen"]
PACKED_POOLING = ("mean", "cls", "max", "lasttoken")
# transformers' attention registry is global: one name per kernel (``embedfleet_varlen_<kernel>``)
# so that two models in one process (the bench's fp32 and bf16 contenders) each keep their own.
VARLEN_ATTENTION = "embedfleet_varlen"
# The varlen path passes ``cu_seq_lens_q`` through the model to a registered attention function
# and a registered mask function: transformers 5's AttentionInterface + masking_utils (BERT in
# 4.x sliced ``token_type_ids`` to the row width and built its own masks). pyproject's floor.
MIN_TRANSFORMERS = "5.0"


class VarlenUnavailableError(RuntimeError):
    """This transformers cannot run the varlen layout; the message says what to install."""


def varlen_attention_name(kernel_name: str) -> str:
    """The attention implementation name registered for one kernel."""
    return f"{VARLEN_ATTENTION}_{kernel_name}"


def varlen_supported() -> bool:
    """Whether the installed transformers has the attention and mask interfaces varlen needs."""
    try:
        from transformers import AttentionInterface  # noqa: F401
        from transformers.masking_utils import AttentionMaskInterface  # noqa: F401
    except ImportError:
        return False
    return True


def preferred_layout(device: torch.device, dtype: torch.dtype = torch.float32) -> PackLayout:
    """The layout the worker should use: the one that measured fastest for this device and
    compute dtype (figures in the module docstring).

    CUDA: ``varlen`` (no padding computed at all; loadtest/gpu_check.sh checks its parity on a
    GPU, ``python -m loadtest.bench --engines --device cuda`` runs the layout contenders),
    ``padded`` on a transformers without the attention interface varlen needs. CPU: ``rows``
    in bf16/fp16, ``padded`` (sorted micro-batches from ``workers.batcher``) in fp32.
    """
    if device.type == "cuda":
        return "varlen" if varlen_supported() else "padded"
    return "padded" if dtype == torch.float32 else "rows"


# --- planning ----------------------------------------------------------------------------
def pack_rows(lengths: Sequence[int], width: int) -> list[list[int]]:
    """First-fit-decreasing: positions grouped into rows whose lengths sum to at most ``width``.

    A text longer than ``width`` gets a row of its own (the row is then that wide).
    """
    rows: list[list[int]] = []
    free: list[int] = []
    for position in sorted(range(len(lengths)), key=lambda p: lengths[p], reverse=True):
        length = lengths[position]
        for row, room in enumerate(free):
            if length <= room:
                rows[row].append(position)
                free[row] -= length
                break
        else:
            rows.append([position])
            free.append(max(0, width - length))
    return rows


def plan_rows(lengths: Sequence[int], token_budget: int, width: int) -> list[list[int]]:
    """Positions packed into rows ``width`` tokens wide, ``token_budget // width`` rows a batch.

    Each inner list is one batch for :func:`collate_rows` (with the same ``width``).
    """
    rows = pack_rows(lengths, width)
    per_batch = max(1, token_budget // width)
    return [
        [position for row in rows[start : start + per_batch] for position in row]
        for start in range(0, len(rows), per_batch)
    ]


def plan_token_batches(
    lengths: Sequence[int], token_budget: int, max_batch: int
) -> list[list[int]]:
    """Positions grouped, longest first, so each batch holds at most ``token_budget`` *real*
    tokens and ``max_batch`` texts (for ``varlen``, where real tokens are all that is computed).
    """
    batches: list[list[int]] = []
    current: list[int] = []
    tokens = 0
    for position in sorted(range(len(lengths)), key=lambda p: lengths[p], reverse=True):
        length = lengths[position]
        if current and (len(current) >= max_batch or tokens + length > token_budget):
            batches.append(current)
            current, tokens = [], 0
        current.append(position)
        tokens += length
    if current:
        batches.append(current)
    return batches


# --- batches -----------------------------------------------------------------------------
@dataclass
class PackedBatch:
    """Texts packed into rows. Vectors come out in the order of the items given to collate."""

    input_ids: torch.Tensor  # (rows, width) int64
    position_ids: torch.Tensor  # (rows, width) int64, restarting at 0 for each text
    attention_mask: torch.Tensor | None  # rows: (rows, 1, width, width) bool; varlen: None
    token_index: torch.Tensor  # (real tokens,) flat index into rows*width, text by text
    sequence_of_token: torch.Tensor  # (real tokens,) which text each token belongs to
    starts: torch.Tensor  # (texts,) flat index of each text's first token
    lengths: torch.Tensor  # (texts,) int64
    layout: PackLayout

    @property
    def size(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def padded_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def real_tokens(self) -> int:
        return int(self.lengths.sum())

    @property
    def cu_seqlens(self) -> torch.Tensor:
        """Offsets of each text in the flat row (varlen), int32 as the kernels want them."""
        return F.pad(self.lengths.cumsum(0), (1, 0)).to(torch.int32)


def collate_rows(items: Sequence[Tokenized], width: int, pad_id: int = 0) -> PackedBatch:
    """Pack ``items`` into rows ``width`` tokens wide with a block-diagonal attention mask."""
    rows = pack_rows([item.length for item in items], width)
    row_width = max(width, max(item.length for item in items))
    return _collate(items, rows, row_width, pad_id, "rows")


def collate_varlen(items: Sequence[Tokenized], pad_id: int = 0) -> PackedBatch:
    """All ``items`` in one row, in order; attention is confined to each text by ``cu_seqlens``."""
    total = sum(item.length for item in items)
    return _collate(items, [list(range(len(items)))], total, pad_id, "varlen")


def _collate(
    items: Sequence[Tokenized],
    rows: list[list[int]],
    width: int,
    pad_id: int,
    layout: PackLayout,
) -> PackedBatch:
    input_ids = np.full((len(rows), width), pad_id, dtype=np.int64)
    position_ids = np.zeros((len(rows), width), dtype=np.int64)
    # Segment number per token; padding is its own segment (-1) so that no query row of the
    # mask is all False (SDPA returns NaN for a query that may attend to nothing).
    segments = np.full((len(rows), width), -1, dtype=np.int64)
    starts = np.zeros(len(items), dtype=np.int64)
    lengths = np.array([item.length for item in items], dtype=np.int64)
    for row, positions in enumerate(rows):
        column = 0
        for position in positions:
            item = items[position]
            end = column + item.length
            input_ids[row, column:end] = item.ids
            position_ids[row, column:end] = np.arange(item.length)
            segments[row, column:end] = position
            starts[position] = row * width + column
            column = end
    token_index = np.concatenate(
        [np.arange(s, s + n) for s, n in zip(starts, lengths, strict=True)]
    )
    sequence_of_token = np.repeat(np.arange(len(items)), lengths)
    mask = None
    if layout == "rows":
        segment_tensor = torch.from_numpy(segments)
        mask = (segment_tensor[:, :, None] == segment_tensor[:, None, :]).unsqueeze(1)
    return PackedBatch(
        input_ids=torch.from_numpy(input_ids),
        position_ids=torch.from_numpy(position_ids),
        attention_mask=mask,
        token_index=torch.from_numpy(token_index),
        sequence_of_token=torch.from_numpy(sequence_of_token),
        starts=torch.from_numpy(starts),
        lengths=torch.from_numpy(lengths),
        layout=layout,
    )


def padding_waste(batches: Sequence[PackedBatch]) -> float:
    padded = sum(batch.padded_tokens for batch in batches)
    real = sum(batch.real_tokens for batch in batches)
    return 0.0 if padded == 0 else 1.0 - real / padded


# --- pooling -----------------------------------------------------------------------------
def pool_packed(hidden: torch.Tensor, batch: PackedBatch, mode: PoolingMode) -> torch.Tensor:
    """Per-text pooling over a packed (rows, width, dim) output: same as ``encoder.pool``."""
    flat = hidden.reshape(-1, hidden.shape[-1])
    device = flat.device
    if mode == "cls":
        return flat[batch.starts.to(device)]
    if mode == "lasttoken":
        return flat[(batch.starts + batch.lengths - 1).to(device)]
    tokens = flat[batch.token_index.to(device)]
    owners = batch.sequence_of_token.to(device)
    if mode == "mean":
        sums = torch.zeros(batch.size, flat.shape[-1], dtype=flat.dtype, device=device)
        sums.index_add_(0, owners, tokens)
        return sums / batch.lengths.to(device=device, dtype=flat.dtype).clamp(min=1).unsqueeze(1)
    # max
    out = torch.full((batch.size, flat.shape[-1]), -1e9, dtype=flat.dtype, device=device)
    return out.scatter_reduce(
        0, owners.unsqueeze(1).expand_as(tokens), tokens, reduce="amax", include_self=True
    )


# --- variable-length attention -----------------------------------------------------------
VarlenKernel = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int, float], torch.Tensor
]


def _flash_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int, scale: float
) -> torch.Tensor:
    if q.dtype not in (torch.float16, torch.bfloat16):
        # flash-attn's own message is a CUDA-side assert; say which model got the wrong kernel
        raise TypeError(f"flash_attn varlen takes fp16/bf16, got {q.dtype}: use another kernel")
    from flash_attn import flash_attn_varlen_func  # type: ignore[import-not-found]

    return flash_attn_varlen_func(q, k, v, cu, cu, max_len, max_len, softmax_scale=scale)


def _nested_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int, scale: float
) -> torch.Tensor:
    offsets = cu.to(torch.int64)

    def jagged(x: torch.Tensor) -> torch.Tensor:  # (total, heads, dim) -> (texts, heads, j, dim)
        return torch.nested.nested_tensor_from_jagged(x, offsets=offsets).transpose(1, 2)

    out = F.scaled_dot_product_attention(jagged(q), jagged(k), jagged(v), scale=scale)
    return out.transpose(1, 2).values()


def _loop_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu: torch.Tensor, max_len: int, scale: float
) -> torch.Tensor:
    bounds = cu.tolist()
    pieces = []
    for start, end in itertools.pairwise(bounds):
        pieces.append(
            F.scaled_dot_product_attention(
                q[start:end].transpose(0, 1),
                k[start:end].transpose(0, 1),
                v[start:end].transpose(0, 1),
                scale=scale,
            ).transpose(0, 1)
        )
    return torch.cat(pieces)


VARLEN_KERNELS: dict[str, VarlenKernel] = {
    "flash_attn": _flash_varlen,
    "nested_sdpa": _nested_varlen,
    "loop_sdpa": _loop_varlen,
}


def choose_varlen_kernel(device: torch.device, dtype: torch.dtype) -> str:
    """The first kernel that runs and is correct here, tried on a tiny ragged batch.

    Kernels go missing in practice (flash-attn not installed, a dtype or head size a build
    does not cover, nested tensors without a fused SDPA on some torch/device); each is probed
    and a failure falls through to the next, down to the plain loop.
    """
    generator = torch.Generator().manual_seed(0)
    lengths = [3, 7, 1]
    cu = F.pad(torch.tensor(lengths).cumsum(0), (1, 0)).to(torch.int32).to(device)
    q, k, v = (
        torch.randn(sum(lengths), 2, 32, generator=generator).to(device=device, dtype=dtype)
        for _ in range(3)
    )
    reference = _loop_varlen(q, k, v, cu, max(lengths), 32**-0.5).float()
    for name, kernel in VARLEN_KERNELS.items():
        if name == "flash_attn" and (device.type != "cuda" or dtype == torch.float32):
            continue
        if name == "nested_sdpa" and device.type != "cuda":
            # On CPU nested-tensor SDPA runs a padded math fallback (masked_select, cat, bmm):
            # measured ~18x slower than the loop over texts. Correct, so tests still cover it.
            continue
        try:
            out = kernel(q, k, v, cu, max(lengths), 32**-0.5).float()
        except Exception as error:  # any failure means "not available here": fall through
            log.info("varlen kernel unavailable", kernel=name, error=str(error))
            continue
        if torch.allclose(out, reference, atol=2e-2, rtol=2e-2):
            return name
        log.warning("varlen kernel gave wrong results; not used", kernel=name)
    return "loop_sdpa"


def _make_varlen_attention(kernel: VarlenKernel) -> Callable[..., tuple[torch.Tensor, None]]:
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    def varlen_attention(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        dropout: float = 0.0,
        scaling: float | None = None,
        cu_seq_lens_q: torch.Tensor | None = None,
        max_length_q: int | None = None,
        **kwargs: object,
    ) -> tuple[torch.Tensor, None]:
        if cu_seq_lens_q is None:
            # An ordinary padded batch (Encoder.embed): exactly the stock SDPA path, so the
            # model behaves as before for everything that is not packed.
            return sdpa_attention_forward(
                module,
                query,
                key,
                value,
                attention_mask,
                dropout=dropout,
                scaling=scaling,
                **kwargs,
            )
        # (1, heads, total, dim) -> (total, heads, dim), the layout varlen kernels take
        q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        out = kernel(q, k, v, cu_seq_lens_q, int(max_length_q or 0), scale)
        return out.unsqueeze(0), None  # (1, total, heads, dim), as sdpa_attention_forward

    return varlen_attention


def install_varlen_attention(model: torch.nn.Module, kernel_name: str) -> str:
    """Switch ``model`` to an attention that runs ``kernel_name`` when given ``cu_seqlens``.

    Each kernel is registered under its own name (:func:`varlen_attention_name`): the registry
    is process-wide, and one shared name would send every varlen model to the kernel installed
    last (an fp32 model to flash-attn, which takes only fp16/bf16). Padded calls (no
    ``cu_seq_lens_q``) go to stock SDPA with the stock mask, so the switch changes nothing for
    ``Encoder.embed``. Returns the name the model now uses.
    """
    if not varlen_supported():
        import transformers

        raise VarlenUnavailableError(
            f"the varlen layout needs transformers>={MIN_TRANSFORMERS} (attention and mask "
            f"interfaces); this is {transformers.__version__}: upgrade it, or use the padded "
            "or rows layout"
        )
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    name = varlen_attention_name(kernel_name)
    AttentionInterface.register(name, _make_varlen_attention(VARLEN_KERNELS[kernel_name]))
    AttentionMaskInterface.register(name, sdpa_mask)
    model.set_attn_implementation(name)  # type: ignore[operator]
    return name


# --- the packed forward pass -------------------------------------------------------------
class PackedEncoder:
    """Runs packed batches through an :class:`Encoder`'s model, precision and pooling.

    Like the encoder, not thread-safe: call ``embed`` from the model thread only.
    """

    def __init__(self, encoder: Encoder, layout: PackLayout) -> None:
        if layout == "padded":
            raise ValueError("padded batches go through Encoder.embed")
        pooling = encoder.pooling
        if (
            len(pooling.modes) > 1
            or pooling.mode not in PACKED_POOLING
            or not (pooling.include_prompt)
        ):
            raise ValueError(
                f"packed layouts pool one of {', '.join(PACKED_POOLING)} over whole texts; "
                f"this model pools {'+'.join(pooling.modes)}"
                + ("" if pooling.include_prompt else " without its prompt")
            )
        self.encoder = encoder
        self.layout = layout
        self.kernel: str | None = None
        # The encoder owns its model; packing borrows it (same weights, same precision).
        self._model = encoder._model
        # Packed rows are wider than the model's position limit. BERT-class embeddings given no
        # token_type_ids take them from a buffer as wide as that limit (sliced to the row width
        # in transformers 4 and in several architectures still): pass zeros of the row's shape.
        self._takes_token_types = (
            "token_type_ids" in inspect.signature(self._model.forward).parameters
        )
        if layout == "varlen":
            compute_dtype = next(self._model.parameters()).dtype
            if encoder.precision.autocast_dtype is not None:
                compute_dtype = encoder.precision.autocast_dtype
            self.kernel = choose_varlen_kernel(encoder.device, compute_dtype)
            install_varlen_attention(self._model, self.kernel)
            log.info("varlen attention", kernel=self.kernel)

    def collate(self, items: Sequence[Tokenized], width: int | None = None) -> PackedBatch:
        if self.layout == "rows":
            return collate_rows(items, width or self.encoder.max_length, self.encoder.pad_id)
        return collate_varlen(items, self.encoder.pad_id)

    @torch.inference_mode()
    def embed(self, batch: PackedBatch) -> np.ndarray:
        """Vectors in item order: float32, (texts, dim), normalised if the model says so."""
        device = self.encoder.device
        kwargs: dict[str, object] = {
            "input_ids": batch.input_ids.to(device, non_blocking=True),
            "position_ids": batch.position_ids.to(device, non_blocking=True),
        }
        if self._takes_token_types:
            kwargs["token_type_ids"] = torch.zeros(
                batch.input_ids.shape, dtype=torch.int64, device=device
            )
        if batch.layout == "rows":
            kwargs["attention_mask"] = batch.attention_mask.to(device, non_blocking=True)  # type: ignore[union-attr]
        else:
            kwargs["cu_seq_lens_q"] = kwargs["cu_seq_lens_k"] = batch.cu_seqlens.to(device)
            kwargs["max_length_q"] = kwargs["max_length_k"] = int(batch.lengths.max())
        with self.encoder.precision.context(device):
            hidden = self._model(**kwargs).last_hidden_state
        pooled = pool_packed(hidden.float(), batch, self.encoder.pooling.mode)
        return self.encoder.head(pooled).cpu().numpy()
