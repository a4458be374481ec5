"""The varlen layout: every text of a batch end to end in one row, attention kept to each text.

The worker's bulk path has two layouts, chosen by :func:`preferred_layout` (or
``EMBEDFLEET_LAYOUT``) and run by ``workers/bulk.py``:

``padded``
    One text per row, right-padded to the longest (``Encoder.collate``), after the window is
    sorted by length and cut where it costs least (``workers.batcher``): a few percent of
    padding. The CPU's layout (in bf16/fp16 through the frozen copy, EMBEDFLEET_FROZEN_BULK).
``varlen``
    All texts of a batch concatenated into one row with ``cu_seqlens`` offsets; attention runs
    per text through a variable-length kernel. No padding anywhere: the CUDA layout, where a
    GPU pays a padded token's full cost and kernels exist that skip padding entirely.

Host side (:func:`collate_varlen`, on the worker's tokenizer thread): one int32 buffer,
``cu_seqlens`` then the token ids, pinned on CUDA so that one non-blocking copy moves it. The
longest and shortest text are known there from the lengths, so no kernel has to ask the device.
Device side (:meth:`PackedEncoder.vectors`): position ids, the token-to-text map and the
pooling are built on the device from ``cu_seqlens``; nothing in the forward pass waits for the
host or makes the host wait.

Kernels, the first that runs and is right here (:func:`choose_varlen_kernel`, probed at
start): torch's own flash varlen kernel (``torch.nn.attention.varlen``; CUDA, fp16/bf16),
flash-attn's ``flash_attn_varlen_func`` where installed, SDPA on nested jagged tensors given
their min/max lengths (fp32 on CUDA), and a plain loop over the texts (always there; the CPU's).

Why not varlen on CPU: there attention runs text by text, slower than padded in both bf16 and
fp32, and nested-tensor SDPA on CPU is a padded math fallback, slower still than the loop
(docs/BENCHMARKS.md, layouts). ``EMBEDFLEET_LAYOUT=varlen`` still runs it there, which is how the
tests run the CUDA code path on a CPU. The third layout measured, packed ``rows``, is a
benchmark contender only (``loadtest/packed_rows.py`` says why).

Every layout must give the vectors the unpadded model gives:
``tests/integration/workers/test_packing.py`` checks
min cosine >= 0.9999 in fp32 on real texts, on the CPU form of this same code, and the device
check (``loadtest/gpu_check.py``, step ``parity``) on a GPU.
"""

from __future__ import annotations

import functools
import inspect
import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from embedfleet.shared.logging import get_logger
from embedfleet.workers.model.encoder import Encoder, Tokenized
from embedfleet.workers.model.tokenizer import flat_ids

log = get_logger("embedfleet.packing")

BulkLayout = Literal["padded", "varlen"]
PACKED_POOLING = ("mean", "cls", "max", "lasttoken")
# transformers' attention registry is global: one name per kernel (``embedfleet_varlen_<kernel>``)
# so that two models in one process (the bench's fp32 and bf16 contenders) each keep their own.
VARLEN_ATTENTION = "embedfleet_varlen"
# The varlen path passes ``cu_seq_lens_q`` through the model to a registered attention function
# and a registered mask function: transformers 5's AttentionInterface + masking_utils (BERT in
# 4.x sliced ``token_type_ids`` to the row width and built its own masks). pyproject's floor.
MIN_TRANSFORMERS = "5.0"
HALF_DTYPES = (torch.float16, torch.bfloat16)


class VarlenUnavailableError(RuntimeError):
    """This transformers cannot run the varlen layout; the message says what to install."""


def varlen_attention_name(kernel_name: str) -> str:
    """The attention implementation name registered for one kernel.

    The name must not hold "flash": transformers reads any implementation name containing it
    as a flash-attention kernel to fetch from the Hub (``is_flash_attention_requested``), and
    ``set_attn_implementation`` then fails before our registered function is ever looked up
    (the device check's first run on an H200: the bf16 varlen path, CUDA's default, failed).
    """
    return f"{VARLEN_ATTENTION}_{kernel_name.replace('flash', 'fa')}"


def varlen_supported() -> bool:
    """Whether the installed transformers has the attention and mask interfaces varlen needs."""
    try:
        from transformers import AttentionInterface  # noqa: F401
        from transformers.masking_utils import AttentionMaskInterface  # noqa: F401
    except ImportError:
        return False
    return True


def preferred_layout(device: torch.device, dtype: torch.dtype = torch.float32) -> BulkLayout:
    """The bulk layout for this device and compute dtype: the one measured or known to win.

    CUDA: ``varlen`` in every dtype (no padding computed; fp32 runs the nested-tensor kernel),
    ``padded`` on a transformers without the attention interface varlen needs. CPU: ``padded``
    in every dtype: varlen measured slower there (docs/BENCHMARKS.md), and the rows layout that
    beat eager bf16 was never measured against the frozen bf16 bulk the worker runs now.
    """
    del dtype  # no dtype changes the choice today; callers say it so that one may
    if device.type == "cuda":
        return "varlen" if varlen_supported() else "padded"
    return "padded"


def check_packed_pooling(encoder: Encoder) -> None:
    """Raise ValueError unless the model pools one of ``PACKED_POOLING`` over whole texts (the
    packed layouts' pooling reads no prompt lengths and no second mode)."""
    if not encoder.dense_only:
        raise ValueError(
            "packed layouts pool dense vectors; this model gives "
            f"{', '.join(encoder.representations)}"
        )
    pooling = encoder.pooling
    if len(pooling.modes) > 1 or pooling.mode not in PACKED_POOLING or not pooling.include_prompt:
        raise ValueError(
            f"packed layouts pool one of {', '.join(PACKED_POOLING)} over whole texts; "
            f"this model pools {'+'.join(pooling.modes)}"
            + ("" if pooling.include_prompt else " without its prompt")
        )


def takes_token_types(model: torch.nn.Module) -> bool:
    """Packed rows are wider than the model's position limit. BERT-class embeddings given no
    token_type_ids take them from a buffer as wide as that limit (sliced to the row width in
    transformers 4 and in several architectures still): such models get zeros of the row's
    shape."""
    return "token_type_ids" in inspect.signature(model.forward).parameters


# --- batches -----------------------------------------------------------------------------
@dataclass
class VarlenBatch:
    """One batch collated for the varlen layout; vectors come out in the order of its items.

    ``buffer`` holds ``cu_seqlens`` (texts + 1 offsets) then every text's ids end to end, int32,
    in pinned memory when it is bound for a GPU: one non-blocking copy moves the whole batch.
    """

    buffer: torch.Tensor  # (texts + 1 + tokens,) int32
    size: int  # texts
    real_tokens: int
    longest: int
    shortest: int

    @property
    def padded_tokens(self) -> int:
        return self.real_tokens  # nothing is padded

    @property
    def cu_seqlens(self) -> torch.Tensor:
        return self.buffer[: self.size + 1]

    @property
    def input_ids(self) -> torch.Tensor:
        return self.buffer[self.size + 1 :]


def collate_varlen(items: Sequence[Tokenized], *, pin: bool = False) -> VarlenBatch:
    """All ``items`` in one row, in order, into one int32 buffer (pinned when ``pin``: only
    for a CUDA device, where it lets the copy run asynchronously; pinning costs on a CPU)."""
    lengths = np.fromiter((item.length for item in items), dtype=np.int64, count=len(items))
    total = int(lengths.sum())
    buffer = torch.empty(len(items) + 1 + total, dtype=torch.int32, pin_memory=pin)
    view = buffer.numpy()
    view[0] = 0
    np.cumsum(lengths, out=view[1 : len(items) + 1], dtype=np.int32)
    view[len(items) + 1 :] = flat_ids(items, np.int32)
    return VarlenBatch(
        buffer=buffer,
        size=len(items),
        real_tokens=total,
        longest=int(lengths.max()),
        shortest=int(lengths.min()),
    )


# --- on the device -----------------------------------------------------------------------
@dataclass
class TokenMap:
    """Where each token of a varlen row belongs, built on the row's device from cu_seqlens."""

    owner: torch.Tensor  # (tokens,) int64: which text
    position_ids: torch.Tensor  # (tokens,) int64: position in that text
    first: torch.Tensor  # (texts,) int64: each text's first token
    lengths: torch.Tensor  # (texts,) int64


def token_map(cu_seqlens: torch.Tensor, real_tokens: int) -> TokenMap:
    """The :class:`TokenMap` of a row, with kernels only: ``real_tokens`` comes from the host
    (the collation knows it) so that ``repeat_interleave`` need not read the total back."""
    first = cu_seqlens[:-1].to(torch.int64)
    lengths = cu_seqlens.diff().to(torch.int64)
    texts = torch.arange(first.shape[0], device=cu_seqlens.device)
    owner = torch.repeat_interleave(texts, lengths, output_size=real_tokens)
    position_ids = torch.arange(real_tokens, device=cu_seqlens.device) - first[owner]
    return TokenMap(owner=owner, position_ids=position_ids, first=first, lengths=lengths)


def pool_packed(
    tokens: torch.Tensor,
    owner: torch.Tensor,
    first: torch.Tensor,
    lengths: torch.Tensor,
    mode: str,
) -> torch.Tensor:
    """Per-text pooling over real tokens laid end to end, text by text: same as
    ``dense.pool`` on the padded batch. ``tokens`` (real tokens, dim), ``owner`` each token's
    text, ``first`` each text's first token, ``lengths`` its token count; all on one device,
    so nothing here waits for the host."""
    if mode == "cls":
        return tokens[first]
    if mode == "lasttoken":
        return tokens[first + lengths - 1]
    size, dim = first.shape[0], tokens.shape[-1]
    if mode == "mean":
        sums = torch.zeros(size, dim, dtype=tokens.dtype, device=tokens.device)
        sums.index_add_(0, owner, tokens)
        return sums / lengths.to(tokens.dtype).clamp(min=1).unsqueeze(1)
    if mode == "max":
        out = torch.full((size, dim), -1e9, dtype=tokens.dtype, device=tokens.device)
        return out.scatter_reduce(
            0, owner.unsqueeze(1).expand_as(tokens), tokens, reduce="amax", include_self=True
        )
    raise ValueError(f"packed layouts cannot pool {mode!r}")


# --- variable-length attention -----------------------------------------------------------
@dataclass(frozen=True)
class Ragged:
    """How a varlen row splits into texts, for a kernel: all known on the host, so no kernel
    reads a length back from the device."""

    cu_seqlens: torch.Tensor  # (texts + 1,) int32, on the row's device
    longest: int
    shortest: int
    scale: float


# (q, k, v: (tokens, heads, dim), ragged) -> (tokens, heads, dim)
VarlenKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, Ragged], torch.Tensor]


@functools.cache
def _torch_varlen_takes_scale() -> bool:
    from torch.nn.attention.varlen import varlen_attn

    return "scale" in inspect.signature(varlen_attn).parameters


def _torch_flash_varlen(q: Tensor, k: Tensor, v: Tensor, ragged: Ragged) -> Tensor:
    if q.dtype not in HALF_DTYPES:
        raise TypeError(f"torch's flash varlen takes fp16/bf16, got {q.dtype}")
    from torch.nn.attention.varlen import varlen_attn  # torch >= 2.9

    cu, longest = ragged.cu_seqlens, ragged.longest
    # varlen_attn returns an (output, aux) tuple only when return_aux asks for one
    if _torch_varlen_takes_scale():
        return cast(Tensor, varlen_attn(q, k, v, cu, cu, longest, longest, scale=ragged.scale))
    if abs(ragged.scale - q.shape[-1] ** -0.5) > 1e-9:  # an older torch's takes no scale
        raise ValueError("this torch's varlen_attn takes no scale, and the model's is not 1/√d")
    return cast(Tensor, varlen_attn(q, k, v, cu, cu, longest, longest))


def _flash_varlen(q: Tensor, k: Tensor, v: Tensor, ragged: Ragged) -> Tensor:
    if q.dtype not in HALF_DTYPES:
        # flash-attn's own message is a CUDA-side assert; say which model got the wrong kernel
        raise TypeError(f"flash_attn varlen takes fp16/bf16, got {q.dtype}: use another kernel")
    from flash_attn import flash_attn_varlen_func  # optional: CUDA builds only

    cu, longest = ragged.cu_seqlens, ragged.longest
    return flash_attn_varlen_func(q, k, v, cu, cu, longest, longest, softmax_scale=ragged.scale)


def _nested_varlen(q: Tensor, k: Tensor, v: Tensor, ragged: Ragged) -> Tensor:
    offsets = ragged.cu_seqlens.to(torch.int64)

    def jagged(x: torch.Tensor) -> torch.Tensor:  # (total, heads, dim) -> (texts, heads, j, dim)
        # min/max given: SDPA would otherwise read them back from the device, every layer
        nested = torch.nested.nested_tensor_from_jagged(
            x, offsets=offsets, min_seqlen=ragged.shortest, max_seqlen=ragged.longest
        )
        return nested.transpose(1, 2)

    out = F.scaled_dot_product_attention(jagged(q), jagged(k), jagged(v), scale=ragged.scale)
    return out.transpose(1, 2).values()


def _loop_varlen(q: Tensor, k: Tensor, v: Tensor, ragged: Ragged) -> Tensor:
    bounds = ragged.cu_seqlens.tolist()  # a host read: the CPU's kernel (costs nothing there)
    pieces = []
    for start, end in itertools.pairwise(bounds):
        pieces.append(
            F.scaled_dot_product_attention(
                q[start:end].transpose(0, 1),
                k[start:end].transpose(0, 1),
                v[start:end].transpose(0, 1),
                scale=ragged.scale,
            ).transpose(0, 1)
        )
    return torch.cat(pieces)


VARLEN_KERNELS: dict[str, VarlenKernel] = {
    "torch_flash": _torch_flash_varlen,
    "flash_attn": _flash_varlen,
    "nested_sdpa": _nested_varlen,
    "loop_sdpa": _loop_varlen,
}
_HALF_ONLY = ("torch_flash", "flash_attn")


def choose_varlen_kernel(device: torch.device, dtype: torch.dtype) -> str:
    """The first kernel that runs and is correct here, tried on a tiny ragged batch.

    Kernels go missing in practice (an older torch, flash-attn not installed, a dtype or head
    size a build does not cover, nested tensors without a fused SDPA on some torch/device);
    each is probed and a failure falls through to the next, down to the plain loop.
    """
    generator = torch.Generator().manual_seed(0)
    lengths = [3, 7, 1]
    cu = F.pad(torch.tensor(lengths).cumsum(0), (1, 0)).to(torch.int32).to(device)
    q, k, v = (
        torch.randn(sum(lengths), 2, 32, generator=generator).to(device=device, dtype=dtype)
        for _ in range(3)
    )
    probe = Ragged(cu, longest=max(lengths), shortest=min(lengths), scale=32**-0.5)
    reference = _loop_varlen(q, k, v, probe).float()
    for name, kernel in VARLEN_KERNELS.items():
        if name in _HALF_ONLY and (device.type != "cuda" or dtype not in HALF_DTYPES):
            continue
        if name == "nested_sdpa" and device.type != "cuda":
            # On CPU nested-tensor SDPA runs a padded math fallback (masked_select, cat, bmm):
            # measured far slower than the loop over texts. Correct, so tests still cover it.
            continue
        try:
            out = kernel(q, k, v, probe).float()
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
        min_length_q: int | None = None,
        **kwargs: Any,  # transformers' attention keyword arguments, passed through
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
        # min_length_q is ours (PackedEncoder passes it; transformers hands unknown keyword
        # arguments down to the attention function)
        ragged = Ragged(
            cu_seq_lens_q,
            longest=int(max_length_q or 0),
            shortest=int(min_length_q) if min_length_q is not None else 1,
            scale=scaling if scaling is not None else query.shape[-1] ** -0.5,
        )
        out = kernel(q, k, v, ragged)
        return out.unsqueeze(0), None  # (1, total, heads, dim), as sdpa_attention_forward

    return varlen_attention


def install_varlen_attention(model: torch.nn.Module, kernel_name: str) -> str:
    """Switch ``model`` to an attention that runs ``kernel_name`` when given ``cu_seqlens``.

    Each kernel is registered under its own name (:func:`varlen_attention_name`): the registry
    is process-wide, and one shared name would send every varlen model to the kernel installed
    last (an fp32 model to flash-attn, which takes only fp16/bf16). Padded calls (no
    ``cu_seq_lens_q``) go to stock SDPA with the stock mask, so the switch changes nothing for
    ``Encoder.embed`` (queries, warm-up, calibration). Returns the name the model now uses.
    """
    if not varlen_supported():
        import transformers

        raise VarlenUnavailableError(
            f"the varlen layout needs transformers>={MIN_TRANSFORMERS} (attention and mask "
            f"interfaces); this is {transformers.__version__}: upgrade it, or use the padded "
            "layout (EMBEDFLEET_LAYOUT=padded)"
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
    """Runs varlen batches through an :class:`Encoder`'s model, precision and pooling.

    Like the encoder, not thread-safe: call ``vectors``/``embed`` from the model thread only.
    """

    def __init__(self, encoder: Encoder) -> None:
        check_packed_pooling(encoder)
        self.encoder = encoder
        # The encoder owns its model; packing borrows it (same weights, same precision).
        self._model = encoder._model
        self._token_types = takes_token_types(self._model)
        compute_dtype = encoder.precision.autocast_dtype or next(self._model.parameters()).dtype
        self.kernel = choose_varlen_kernel(encoder.device, compute_dtype)
        install_varlen_attention(self._model, self.kernel)
        log.info("varlen attention", kernel=self.kernel)

    def collate(self, items: Sequence[Tokenized], *, pin: bool = False) -> VarlenBatch:
        return collate_varlen(items, pin=pin)

    @torch.inference_mode()
    def vectors(self, batch: VarlenBatch) -> torch.Tensor:
        """Vectors in item order on the model's device: float32, (texts, dim), normalised if
        the model says so. On CUDA this returns once the work is queued."""
        device = self.encoder.device
        on_device = batch.buffer.to(device, non_blocking=True)
        cu_seqlens = on_device[: batch.size + 1]
        input_ids = on_device[batch.size + 1 :].unsqueeze(0)
        tokens = token_map(cu_seqlens, batch.real_tokens)
        kwargs: dict[str, object] = {
            "input_ids": input_ids,
            "position_ids": tokens.position_ids.unsqueeze(0),
            "cu_seq_lens_q": cu_seqlens,
            "cu_seq_lens_k": cu_seqlens,
            "max_length_q": batch.longest,
            "max_length_k": batch.longest,
            "min_length_q": batch.shortest,
        }
        if self._token_types:
            kwargs["token_type_ids"] = torch.zeros_like(input_ids)
        with self.encoder.precision.context(device):
            hidden = self._model(**kwargs).last_hidden_state[0]
        mode = self.encoder.pooling.mode
        pooled = pool_packed(hidden.float(), tokens.owner, tokens.first, tokens.lengths, mode)
        return self.encoder.head(pooled)

    def embed(self, batch: VarlenBatch) -> np.ndarray:
        """:meth:`vectors`, on the host (waits for them)."""
        return self.vectors(batch).cpu().numpy()
