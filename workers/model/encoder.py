"""The model: tokenizer + transformer + the pooling its sentence-transformers config declares.

Two things matter to the rest of the worker (TEI's Python backend shape): ``tokenize(texts)``,
which turns texts into token id lists, and ``embed(batch)``, which turns one padded batch into
normalised float32 vectors. Everything here is synchronous; the worker runs tokenization and the
forward pass on their own threads.
"""

from __future__ import annotations

import functools
import math
import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
from transformers import AutoTokenizer
from transformers.utils import logging as transformers_logging

from embedfleet.shared.logging import adopt_library_logger, get_logger

# one definition for the worker, the gateway and the splitter (those need no torch)
from embedfleet.shared.model_path import ModelNotFoundError, resolve_model_path
from embedfleet.shared.modelcard import ModelCard, max_input_tokens, served_name
from embedfleet.shared.protocol import Chunk
from embedfleet.shared.settings import PACKAGED_MODEL
from embedfleet.shared.tokens import counting_head
from embedfleet.workers.cpus import CpuClass, cpu_class, usable_cpus
from embedfleet.workers.model.base import Forward, Representation
from embedfleet.workers.model.cuda_queries import CudaLaneMode, CudaQueryRunner, QueryPath
from embedfleet.workers.model.dense import Dense
from embedfleet.workers.model.frozen import FrozenForward, build_checked, freeze, frozen_min_cosine
from embedfleet.workers.model.int8 import (
    DynamicInt8Forward,
    Int8Forward,
    W8A8Forward,
    build_dynamic_int8,
    build_int8,
    cpp_compiler_available,
)
from embedfleet.workers.model.model_dir import ModelSpec, read_model_spec
from embedfleet.workers.model.multivector import MultiVector
from embedfleet.workers.model.precision import (
    BULK_PROBE_TEXTS,
    FP32,
    GATE_TEXTS,
    PROBE_BATCH,
    PROBE_TEXTS,
    GateReport,
    ParityReport,
    Precision,
    embed_in_batches,
    gate,
    requested_precision,
    settle_auto,
)
from embedfleet.workers.model.rerank import Rerank
from embedfleet.workers.model.sparse import Sparse

# transformers installs its own stderr handler on import; its records go through ours instead
# (above a progress bar, quiet below --verbose), once the process has configured logging.
adopt_library_logger("transformers")
log = get_logger("embedfleet.encoder")

# EMBEDFLEET_CPU_INT8_PATH: which int8 copies are tried ("auto": every one this CPU can run)
Int8Choice = Literal["auto", "w8a8", "dynamic", "off"]
INT8_PATHS: dict[str, str] = {"w8a8": W8A8Forward.name, "dynamic": DynamicInt8Forward.name}
# An int8 copy replaces the frozen graph only if its timed batch is at least this much faster:
# it costs a little parity, and a tie on the probe batch (Zen 4, 201.0 against 201.8 ms) was
# 28% fewer tokens/s in the bulk (docs/BENCHMARKS.md, the query lane's bound per path).
INT8_MIN_GAIN = 0.10

Lane = Literal["query", "document"]


class PromptError(ValueError):
    """A chunk names a prompt the model does not declare (dead-lettered with this reason)."""


@dataclass(frozen=True)
class Tokenized:
    """One text's token ids (with special tokens), and whether it was cut to fit the model."""

    ids: list[int]
    truncated: bool
    # leading tokens that are the prompt (with the tokenizer's leading special tokens), as
    # sentence-transformers counts them; excluded from pooling when include_prompt is false
    prompt_length: int = 0
    # segment ids of a (query, document) pair for a cross-encoder; None for a single text
    type_ids: list[int] | None = None

    @property
    def length(self) -> int:
        return len(self.ids)


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


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("EMBEDFLEET_DEVICE=cuda but torch sees no CUDA device; use cpu or auto")
    return torch.device(device)


def configure_device_math(device: torch.device) -> None:
    """On CUDA, float32 matmuls and convolutions run on the tensor cores in TF32 (10-bit
    mantissa inputs, fp32 accumulation): several times the plain-fp32 rate on Ampere and later,
    with embeddings within ~1e-4 in cosine. bf16/fp16 work is unaffected. CPU: nothing."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True


def configure_tokenizer_threads(device: torch.device) -> bool:
    """Whether the Rust tokenizer batch-encodes on all cores, decided by the device unless
    TOKENIZERS_PARALLELISM is set: on a CPU the model's threads own the cores (a tokenizer pool
    beside them stalls their barriers, docs/BENCHMARKS.md "Threads under contention"); on CUDA
    the host cores are otherwise idle, and one tokenizing core cannot feed a GPU doing tens of
    thousands of texts a second. The tokenizers library reads the variable at each batch call."""
    if "TOKENIZERS_PARALLELISM" not in os.environ:
        os.environ["TOKENIZERS_PARALLELISM"] = "true" if device.type == "cuda" else "false"
    return os.environ["TOKENIZERS_PARALLELISM"].lower() in ("1", "true", "yes", "on")


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """The dtype asked for; for ``auto``, the reduced precision the device runs natively (the
    parity probe at load may still fall back to float32: see workers/model/precision.py)."""
    return requested_precision(dtype, device).dtype


class Encoder:
    """A loaded embedding model. Not thread-safe: one thread calls ``embed`` at a time."""

    def __init__(
        self,
        model: str = PACKAGED_MODEL,
        *,
        device: str = "auto",
        dtype: str = "float32",
        threads: int = 0,
        name: str | None = None,
    ) -> None:
        """``name``: the served name (results' ``model``, the card's ``name``); default
        ``served_name(model)``, a model lane's workers serve under the lane's name."""
        self.model_dir = resolve_model_path(model)
        self.name = name or served_name(model)
        self.device = resolve_device(device)
        configure_device_math(self.device)
        self.parallel_tokenizer = configure_tokenizer_threads(self.device)
        # `auto` loads fp32 and settles on a precision after the parity probe, below.
        self.precision: Precision = requested_precision(dtype, self.device)
        self.parity: ParityReport | None = None
        # int8 copies are gated against float32's vectors, which only `auto` computes (an
        # explicit dtype is what the operator wants, not a candidate to beat)
        self._auto_dtype = dtype == "auto"
        self.gate_reports: dict[str, GateReport] = {}
        if self.device.type == "cpu":
            torch.set_num_threads(threads or usable_cpus())
        elif threads:  # CUDA: host-side torch work only (replicas on one GPU get one each)
            torch.set_num_threads(threads)
        # modules, pooling, Dense, Normalize, prompts; refuses what it cannot reproduce
        self.spec = read_model_spec(self.model_dir)
        transformer_dir = self.spec.transformer_dir
        self._tokenizer = AutoTokenizer.from_pretrained(transformer_dir)
        if not self._tokenizer.is_fast:
            raise ModelNotFoundError(f"{transformer_dir} has no fast tokenizer (tokenizer.json)")
        transformers_logging.disable_progress_bar()  # a local load needs no progress bar
        load_dtype = torch.float32 if dtype == "auto" else self.precision.weights_dtype
        # one class per representation (workers/model/base.py), chosen once: it names the
        # transformers class to load (dense: the bare transformer; sparse: its MLM head too,
        # SPLADE; rerank: its classification head, CrossEncoder) and reads the output
        self.representation = self.spec.representation
        kind = representation_class(self.spec)
        self._model = kind.auto_model.from_pretrained(transformer_dir, dtype=load_dtype)
        self._model.to(self.device).eval()
        config = self._model.config
        # the sentence pipeline (pooling, Dense, Normalize): on every model's card; the dense
        # vectors and every copy that ends in pooling (frozen, int8, CUDA queries) run it
        self._sentence = Dense(self.spec, self.device, int(config.hidden_size))
        self.pooling = self._sentence.pooling
        self._head = self._sentence.head
        position_limit = getattr(config, "max_position_embeddings", 512)
        self.max_length = max_input_tokens(
            self.spec.max_seq_length, self._tokenizer.model_max_length, position_limit
        )
        # sentence-transformers' prompt table: "query" and "document" exist (empty) unless the
        # model sets them, which is why encode_query / encode_document never fall back to
        # default_prompt_name; see resolve_prompt.
        self.prompts: dict[str, str] = {"query": "", "document": "", **self.spec.prompts}
        self.pad_id = int(self._tokenizer.pad_token_id or 0)
        # decoder-only embedders declare left padding; the pooling reads either side
        self.pad_left = self._tokenizer.padding_side == "left"
        self._backend = self._tokenizer.backend_tokenizer
        if self.spec.do_lower_case:
            _lowercase_normalizer(self._backend)
        self._backend.no_padding()
        # One token over the limit tells us a text was cut; see tokenize().
        self._backend.enable_truncation(self.max_length + 1)
        self._ends_with_special = self._last_token_is_special()
        self._representation = self._build_representation(kind)
        self.dim = self._representation.dim
        # BGE-M3's heads: where each head's values sit in a packed row (workers/model/heads.py)
        self.layout = self._representation.layout
        if dtype == "auto" and not self.dense_only:
            # the parity probe compares pooled sentence vectors by cosine: not what a sparse,
            # per-token or score head gives; float32 until they have their own bar
            self.precision = FP32
        elif dtype == "auto":
            self.precision, self.parity = settle_auto(
                self._model, self.precision, self.embed_texts, self._set_precision
            )
        self.dtype = self.precision.dtype
        # the forward path kept for queries (and frozen bulk), as logged: prepare_query_graph
        self.forward_path = f"{self.precision.name} eager"
        self._layer_hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._query_forward: FrozenForward | Int8Forward | None = None
        self._cuda_queries: CudaQueryRunner | None = None

    def _build_representation(self, kind: type[Representation]) -> Representation:
        if kind is Dense:
            return self._sentence
        if kind is MultiVector:
            heads = self.spec.token_heads
            assert heads is not None
            return MultiVector(
                self._sentence,
                heads,
                self._tokenizer,
                self._model.config,
                self.device,
                self.model_dir,
            )
        if kind is Sparse:
            return Sparse(self.spec, self._model.config)
        return Rerank(self.spec, self._model.config, self.spec.transformer_dir)

    @property
    def representations(self) -> tuple[str, ...]:
        """Everything the model gives (the card's ``representations``): one, or for a model
        with token heads dense and what they add, all from one forward pass."""
        return self._representation.representations

    @property
    def dense_only(self) -> bool:
        """A dense model without token heads: what the frozen, int8, CUDA-query and packed
        copies compute (they end in pooling)."""
        return self._representation.ends_in_pooling

    def heads_for(self, wanted: Sequence[Sequence[str]]) -> tuple[str, ...] | None:
        """The heads a batch computes for its chunks' ``wanted`` representations (one tuple per
        chunk, empty: the default, dense): None where that is the dense vector alone."""
        return self._representation.heads_for(wanted)

    @property
    def card(self) -> ModelCard:
        """The facts this worker publishes about what it serves (shared/modelcard.py)."""
        config = self._model.config
        return ModelCard(
            name=self.name,
            dim=self.dim,
            max_length=self.max_length,
            normalize=self.spec.normalize,
            prompts=dict(self.spec.prompts),
            default_prompt_name=self.spec.default_prompt_name,
            hidden_size=int(config.hidden_size),
            pooling=self.spec.pooling_modes,
            include_prompt=self.spec.include_prompt,
            architecture=str((getattr(config, "architectures", None) or [""])[0]),
            representations=self.representations,
        )

    # --- slice boundaries ----------------------------------------------------------
    def set_layer_callback(self, callback: Callable[[], None] | None) -> int:
        """Call ``callback`` on the model thread before every transformer layer.

        This is where a long bulk forward pass yields to priority queries: the callback may run
        a whole (short) forward pass of its own, re-entrantly, then the bulk pass goes on.
        Returns the number of layers hooked (0 if the architecture has no layer list).
        """
        for handle in self._layer_hooks:
            handle.remove()
        self._layer_hooks = []
        if callback is None:
            return 0
        layers = _transformer_layers(self._model)

        def before_layer(_module: torch.nn.Module, _args: object) -> None:
            callback()

        self._layer_hooks = [layer.register_forward_pre_hook(before_layer) for layer in layers]
        return len(layers)

    @property
    def layer_count(self) -> int:
        return len(_transformer_layers(self._model))

    def _set_precision(self, precision: Precision) -> None:
        self.precision = precision

    def _last_token_is_special(self) -> bool:
        encoding = self._backend.encode("a")
        return bool(encoding.special_tokens_mask and encoding.special_tokens_mask[-1])

    # --- prompts ----------------------------------------------------------------------
    def resolve_prompt(
        self,
        lane: Lane,
        *,
        prompt_name: str | None = None,
        prompt: str | None = None,
        lane_default: str = "",
    ) -> str:
        """The prompt text for one chunk, chosen as ``encode_query`` (query lane) or
        ``encode_document`` (bulk) choose it; ``lane_default`` is the operator's override
        (EMBEDFLEET_QUERY_PROMPT_NAME / _DOCUMENT_PROMPT_NAME). Raises PromptError for a
        prompt name the model does not declare. An empty string means no prompt."""
        if prompt is not None:
            return prompt  # a literal prompt wins over any name, as in sentence-transformers
        if prompt_name is None:
            prompt_name = lane_default or self._lane_prompt_name(lane)
        if prompt_name is None:
            return ""
        if prompt_name not in self.prompts:
            raise PromptError(
                f"prompt_name {prompt_name!r} is not one of the model's prompts "
                f"({', '.join(sorted(self.prompts))})"
            )
        return self.prompts[prompt_name]

    def _lane_prompt_name(self, lane: Lane) -> str | None:
        candidates = ("query",) if lane == "query" else ("document", "passage", "corpus")
        for name in candidates:
            if name in self.prompts:
                return name
        return self.spec.default_prompt_name

    @functools.lru_cache(maxsize=64)  # noqa: B019 - a few prompts per model, encoder lives on
    def prompt_length(self, prompt: str) -> int:
        """Tokens of ``prompt`` at the start of ``prompt + text`` (leading special tokens
        included, a trailing one not): sentence-transformers' ``_get_prompt_length``."""
        encoding = self._backend.encode(prompt)
        length = len(encoding.ids)
        if encoding.special_tokens_mask and encoding.special_tokens_mask[-1]:
            length -= 1
        return length

    # --- tokenize ---------------------------------------------------------------------
    def tokenize(
        self,
        texts: Sequence[str],
        prompts: Sequence[str] | None = None,
        *,
        pairs: Sequence[str] | None = None,
    ) -> list[Tokenized]:
        """Token ids per text (``prompt + text`` where a prompt is given, as
        sentence-transformers joins them, so prompt tokens count against the maximum), cut to
        the model's maximum with the truncated flag set. With ``pairs`` (a cross-encoder's
        documents, one per text): the (text, pair) encodings of :meth:`tokenize_pairs`.

        The batch call runs in Rust and releases the GIL, so callers put it on a thread.
        """
        if pairs is not None:
            return self.tokenize_pairs(texts, pairs)
        if prompts is not None:
            texts = [prompt + text for prompt, text in zip(prompts, texts, strict=True)]
        prepared = [counting_head(text, self.max_length) for text in texts]
        encodings = self._backend.encode_batch(prepared)
        results: list[Tokenized] = []
        for row, (text, cut_text, encoding) in enumerate(
            zip(texts, prepared, encodings, strict=True)
        ):
            ids = encoding.ids
            if len(ids) <= self.max_length and len(cut_text) < len(text):
                # Rare: a text so sparse in tokens that the cut lost some. Do it properly.
                ids = self._backend.encode(text).ids
            prompt = prompts[row] if prompts is not None else ""
            results.append(self._fit(ids, self.prompt_length(prompt) if prompt else 0))
        return results

    def _fit(self, ids: list[int], prompt_length: int = 0) -> Tokenized:
        if len(ids) <= self.max_length:
            return Tokenized(ids=ids, truncated=False, prompt_length=prompt_length)
        if self._ends_with_special:  # keep [SEP]: same ids as truncating at max_length
            ids = [*ids[: self.max_length - 1], ids[-1]]
        else:
            ids = ids[: self.max_length]
        return Tokenized(ids=ids, truncated=True, prompt_length=prompt_length)

    def tokenize_pairs(self, queries: Sequence[str], documents: Sequence[str]) -> list[Tokenized]:
        """Token and segment ids of (query, document) pairs for a cross-encoder, cut to the
        model's maximum ``longest_first`` as ``CrossEncoder.predict`` cuts them; ``truncated``
        says a pair lost tokens."""
        return [
            Tokenized(ids=ids, truncated=truncated, type_ids=types)
            for ids, truncated, types in self._representation.cut_pairs(
                queries, documents, self.max_length
            )
        ]

    # --- batch and embed --------------------------------------------------------------
    def collate(self, items: list[Tokenized], *, pin: bool = False) -> EncodeBatch:
        """Pad to the longest sequence in the batch (callers sort by length first), on the side
        the tokenizer declares. ``pin``: into pinned memory, for a non-blocking copy to a GPU.

        int64, as the frozen CPU graph was traced with (the varlen layout's buffers are int32).
        """
        longest = max(item.length for item in items)
        shape = (len(items), longest)
        ids_tensor = torch.full(shape, self.pad_id, dtype=torch.int64, pin_memory=pin)
        mask_tensor = torch.zeros(shape, dtype=torch.int64, pin_memory=pin)
        input_ids, attention_mask = ids_tensor.numpy(), mask_tensor.numpy()
        types_tensor = None
        if any(item.type_ids is not None for item in items):
            types_tensor = torch.zeros(shape, dtype=torch.int64, pin_memory=pin)
        for row, item in enumerate(items):
            start = longest - item.length if self.pad_left else 0
            input_ids[row, start : start + item.length] = item.ids
            attention_mask[row, start : start + item.length] = 1
            if types_tensor is not None and item.type_ids is not None:
                types_tensor.numpy()[row, start : start + item.length] = item.type_ids
        prompt_lengths = None
        if not self.pooling.include_prompt:
            prompt_lengths = torch.tensor([item.prompt_length for item in items])
        return EncodeBatch(
            input_ids=ids_tensor,
            attention_mask=mask_tensor,
            prompt_lengths=prompt_lengths,
            token_type_ids=types_tensor,
        )

    def embed(self, batch: EncodeBatch) -> np.ndarray:
        """Vectors for one batch: float32, shape (batch, dim), normalised if the model says so."""
        return self.vectors(batch).cpu().numpy()

    @torch.inference_mode()
    def vectors(self, batch: EncodeBatch) -> torch.Tensor:
        """:meth:`embed`'s vectors left on the model's device (on CUDA: returns once queued)."""
        input_ids = batch.input_ids.to(self.device, non_blocking=True)
        attention_mask = batch.attention_mask.to(self.device, non_blocking=True)
        extra: dict[str, torch.Tensor] = {}
        if batch.token_type_ids is not None:
            extra["token_type_ids"] = batch.token_type_ids.to(self.device, non_blocking=True)
        with self.precision.context(self.device):
            output = self._model(input_ids=input_ids, attention_mask=attention_mask, **extra)
        return self._representation.vectors(
            Forward(output, input_ids, attention_mask, batch.prompt_lengths, batch.heads)
        )

    def embed_query(self, batch: EncodeBatch) -> np.ndarray:
        """Like ``embed``, through the frozen graph when one was prepared (short inputs on a
        CPU, see workers/model/frozen.py). No layer hooks fire in it."""
        return self.serve_query(batch)[0]

    def serve_query(self, batch: EncodeBatch) -> tuple[np.ndarray, QueryPath]:
        """``embed_query``, and which path computed the vectors: the CUDA query lane's graph or
        stream (workers/model/cuda_queries.py), the frozen CPU graph, or the bulk model (eager)."""
        if self._cuda_queries is not None:
            return self._cuda_queries.embed(
                batch.input_ids, batch.attention_mask, batch.prompt_lengths
            )
        if self._query_forward is None:
            return self.embed(batch), "eager"
        path: QueryPath = "int8" if self.computes_in_int8 else "frozen"
        return self._embed_frozen(self._query_forward, batch), path

    @torch.inference_mode()
    def _embed_frozen(self, forward: FrozenForward | Int8Forward, batch: EncodeBatch) -> np.ndarray:
        hidden = forward(batch.input_ids, batch.attention_mask)
        return self._vectors(hidden, batch.attention_mask, batch.prompt_lengths)

    def _vectors(
        self,
        hidden: torch.Tensor,
        attention_mask: torch.Tensor,
        prompt_lengths: torch.Tensor | None = None,
    ) -> np.ndarray:
        """The sentence pipeline (:meth:`Dense.pooled`) on hidden states, on the host."""
        return self._sentence.pooled(hidden, attention_mask, prompt_lengths).cpu().numpy()

    def head(self, pooled: torch.Tensor) -> torch.Tensor:
        """The modules after pooling (Dense, Normalize), on float32 pooled vectors."""
        return self._head(pooled)

    # --- the query graph --------------------------------------------------------------
    @property
    def has_query_graph(self) -> bool:
        return self._query_forward is not None

    @property
    def computes_in_reduced_precision(self) -> bool:
        """The model, or the copy kept for queries and frozen bulk, computes in less than
        float32: bf16/fp16, or int8 linear layers (the worker then runs bulk through the copy)."""
        return self.precision.dtype != torch.float32 or self.computes_in_int8

    def prepare_query_graph(self, int8: bool | Int8Choice = False) -> bool:
        """Build the frozen query graph, once, where it helps and holds parity: on a CPU, with
        the weights in their compute dtype (not autocast). Returns whether queries use it.

        ``int8`` (EMBEDFLEET_CPU_INT8 and EMBEDFLEET_CPU_INT8_PATH): ``True``/``"auto"`` builds
        every int8 copy of workers/model/int8.py this CPU can run (:func:`cpu_paths`), holds each to
        the float32 bar on the held-out set (:func:`~embedfleet.workers.model.precision.gate`), and
        keeps the fastest of those that pass and the frozen graph (or the eager model) on a
        timed bulk-shaped batch. ``"w8a8"``/``"dynamic"``: only that copy, kept whenever it
        passes the gate, without the race (to force a path for a benchmark). ``False``/``"off"``:
        no int8. Only with EMBEDFLEET_DTYPE=auto, which computes float32's vectors to gate on.

        The choice is made once, here, and logged ("forward path chosen", :attr:`forward_path`).
        Call it on the thread that runs the model; it takes about a second (with the W8A8 copy,
        its compile: up to about a minute on 2 cores, less with inductor's cache warm).
        """
        if self._query_forward is not None:
            return True
        if self.device.type != "cpu" or self.precision.method == "autocast":
            return False
        if not self.dense_only:  # the frozen and int8 copies end in pooling
            return False
        cpu = cpu_class()
        dtype_name = str(self.precision.dtype).removeprefix("torch.")
        if not cpu.runs_natively(dtype_name):
            # an explicit bf16/fp16 where the CPU emulates it: its frozen graph's fused kernels
            # ran several times slower than the eager model and took over a minute to build
            # (docs/BENCHMARKS.md); eager keeps the layer boundaries queries get in at
            log.warning(
                "no frozen query graph: this CPU has no native matmul in the dtype asked for "
                "(emulated, slower than float32); queries and bulk run eager. "
                "EMBEDFLEET_DTYPE=auto or float32 is faster here",
                dtype=dtype_name,
                cpu=cpu.describe(),
            )
            return False
        choice: Int8Choice = "auto" if int8 is True else "off" if int8 is False else int8
        candidates = self._build_int8_paths(choice)
        self._query_forward = self._build_frozen()
        if self._query_forward is not None:
            self.forward_path = f"{self.precision.name} frozen"
        timings: dict[str, float] = {}
        if candidates and choice == "auto":
            timings = self._keep_fastest(candidates)
        elif candidates:
            self._query_forward = candidates[0]
        if isinstance(self._query_forward, Int8Forward):
            self.forward_path = f"{self._query_forward.name} ({self.precision.name} around it)"
        log.info(
            "forward path chosen",
            path=self.forward_path,
            cpu=cpu.describe(),
            candidates=",".join(cpu_paths(cpu, cpp_compiler_available())),
            gated=",".join(f"{name}:{r.passed}" for name, r in self.gate_reports.items()),
            **_milliseconds(timings),
        )
        return self._query_forward is not None

    def _build_frozen(self) -> FrozenForward | None:
        example = self.collate(self.tokenize(["a query", "a longer query, so the batch pads"]))
        # single texts (no padding) and padded batches of mixed lengths
        probe = [[PROBE_TEXTS[0]], [PROBE_TEXTS[-1]], list(PROBE_TEXTS[:4]), list(PROBE_TEXTS)]
        return build_checked(
            build=lambda: freeze(self._model, (example.input_ids, example.attention_mask)),
            eager=self.embed,
            frozen=self._embed_frozen,
            probe_batches=[self.collate(self.tokenize(texts)) for texts in probe],
            min_cosine=frozen_min_cosine(self.precision.dtype),
        )

    @property
    def computes_in_int8(self) -> bool:
        """The query (and frozen bulk) graph is one of the int8 copies of workers/model/int8.py."""
        return isinstance(self._query_forward, Int8Forward)

    def float32_heldout(self) -> np.ndarray | None:
        """float32's vectors of the held-out set, to gate other paths on: kept from `auto`'s
        probe, or computed now where the model is float32 under `auto`; None with an explicit
        dtype (nothing is gated then)."""
        if not self._auto_dtype:
            return None
        if self.parity is not None and self.parity.heldout_reference is not None:
            return self.parity.heldout_reference
        if self.precision != FP32:
            return None
        return embed_in_batches(self.embed_texts, GATE_TEXTS)

    def _build_int8_paths(self, choice: Int8Choice) -> list[Int8Forward]:
        """The int8 copies ``choice`` names that this CPU runs, built, each kept only if it
        passes the held-out gate (in :attr:`gate_reports` either way)."""
        if choice == "off":
            return []
        reference = self.float32_heldout()
        if reference is None:
            log.info(
                "int8 compute not used: it is gated against float32's vectors of the held-out "
                "set, which only EMBEDFLEET_DTYPE=auto computes (not an explicit dtype)"
            )
            return []
        compiler = cpp_compiler_available()
        runnable = cpu_paths(cpu_class(), compiler)
        wanted = list(INT8_PATHS.values()) if choice == "auto" else [INT8_PATHS[choice]]
        if W8A8Forward.name in wanted and not compiler:
            log.info(
                "int8 W8A8 copy not tried: torch.compile builds its CPU kernels with a C++ "
                "compiler ($CXX, g++ or clang++), and none is on PATH (the CPU image has none)"
            )
        elif W8A8Forward.name in wanted and W8A8Forward.name not in runnable:
            if choice == "auto":
                log.info(
                    "int8 W8A8 copy not tried: this CPU has no int8 dot-product instructions "
                    "(AVX512-VNNI, AVX-VNNI or AMX), where its int8 matmul runs slower than "
                    "float32"
                )
            else:  # forced (EMBEDFLEET_CPU_INT8_PATH=w8a8): the operator's choice, said
                runnable = [*runnable, W8A8Forward.name]
                log.warning(
                    "int8 W8A8 copy forced on a CPU without int8 dot-product instructions "
                    "(AVX512-VNNI, AVX-VNNI or AMX): its int8 matmul runs slower than float32 "
                    "here; EMBEDFLEET_CPU_INT8_PATH=auto leaves it out"
                )
        kept: list[Int8Forward] = []
        for name in wanted:
            if name not in runnable:
                continue
            forward = self._build_int8_path(name)
            if forward is not None and self.gate_int8(forward, reference).passed:
                kept.append(forward)
        return kept

    def _build_int8_path(self, name: str) -> Int8Forward | None:
        try:
            if name == W8A8Forward.name:
                return build_int8(self._model, _layer_stack, self._run_model, PROBE_TEXTS)
            return build_dynamic_int8(self._model, _layer_stack, self._run_model, PROBE_TEXTS)
        except Exception as error:  # an untraceable model, a compiler that fails, ...
            log.warning(
                "int8 compute not used: the int8 copy could not be built here; set "
                "EMBEDFLEET_CPU_INT8=false to skip the attempt",
                path=name,
                error=repr(error)[:300],
            )
            return None

    def gate_int8(self, forward: Int8Forward, reference: np.ndarray) -> GateReport:
        """Hold ``forward`` to the float32 bar on the held-out set (never the probe texts its
        smoothing was calibrated on). A W8A8 copy compiles here: one single text first, then
        padded batches, so both compiled shapes are made now rather than at a query."""
        try:
            self._embed_frozen(forward, self.collate(self.tokenize(list(GATE_TEXTS[:1]))))
            vectors = embed_in_batches(
                lambda texts: self._embed_frozen(forward, self.collate(self.tokenize(list(texts)))),
                GATE_TEXTS,
                PROBE_BATCH,
            )
        except Exception as error:  # inductor fails to compile, ...
            log.warning(
                "int8 compute not used: the int8 copy does not run here (torch.compile needs a "
                "C++ compiler on a CPU); set EMBEDFLEET_CPU_INT8=false to skip the attempt",
                path=forward.name,
                error=repr(error)[:300],
            )
            vectors = np.full_like(reference, np.nan)
        report = gate(forward.name, reference, vectors)
        self.gate_reports[forward.name] = report
        return report

    def _keep_fastest(self, candidates: Sequence[Int8Forward]) -> dict[str, float]:
        """Time one bulk-shaped batch through each int8 copy that passed the gate and through
        the frozen graph (or the eager model, where the graph was not kept); keep the fastest
        for queries and bulk. Returns the seconds measured, by path."""
        batch = self.collate(self.tokenize(list(BULK_PROBE_TEXTS)))
        baseline = self._query_forward
        contenders: dict[str, tuple[FrozenForward | Int8Forward | None, Callable[[], object]]] = {
            self.forward_path: (
                baseline,
                functools.partial(self._embed_frozen, baseline, batch)
                if baseline
                else functools.partial(self.embed, batch),
            )
        }
        for forward in candidates:
            contenders[forward.name] = (
                forward,
                functools.partial(self._embed_frozen, forward, batch),
            )
        seconds = _best_of_interleaved({name: run for name, (_, run) in contenders.items()}, 5)
        fastest = min(seconds, key=seconds.__getitem__)
        baseline_name = self.forward_path
        if seconds[fastest] > seconds[baseline_name] * (1 - INT8_MIN_GAIN):
            fastest = baseline_name  # a tie keeps the path without int8's parity cost
        log.info(
            "forward paths timed",
            **_milliseconds(seconds),
            kept=fastest,
            int8_min_gain=INT8_MIN_GAIN,
        )
        self._query_forward = contenders[fastest][0]
        return seconds

    @torch.inference_mode()
    def _run_model(self, model: torch.nn.Module, texts: Sequence[str]) -> None:
        """``model`` (a copy of this one) over ``texts`` in one padded batch."""
        batch = self.collate(self.tokenize(list(texts)))
        with self.precision.context(self.device):
            model(input_ids=batch.input_ids, attention_mask=batch.attention_mask)

    @property
    def serves_queries_concurrently(self) -> bool:
        """Queries have their own model copy and stream (CUDA): serve them from their own
        thread, beside the bulk pass, not at its layer boundaries."""
        return self._cuda_queries is not None

    def prepare_cuda_queries(self, mode: CudaLaneMode) -> bool:
        """On CUDA, the query lane of workers/model/cuda_queries.py (``mode``: ``graph``
        captures CUDA graphs too, ``stream`` does not, ``off`` keeps queries on the bulk model).
        Returns whether queries use it. Call on the model thread, before serving queries."""
        if self.device.type != "cuda" or mode == "off" or not self.dense_only:
            return False
        if self._cuda_queries is None:
            runner = CudaQueryRunner(
                self._model,
                self._vectors,
                self.precision,
                self.device,
                pad_id=self.pad_id,
                pad_left=self.pad_left,
                max_length=self.max_length,
            )
            if mode == "graph":
                runner.capture()
            self._cuda_queries = runner
        return True

    def warm_up(self) -> None:
        """Two forward passes of different shapes (kernels chosen, memory allocated, on CUDA
        the cuBLAS handles made) before anything is timed. Call on the model thread."""
        self.embed_texts(list(PROBE_TEXTS[:2]))
        self.embed_texts(list(PROBE_TEXTS[:4]))

    def embed_texts(self, texts: Sequence[str]) -> np.ndarray:
        """Convenience for tests and the CLI: tokenize, one batch, embed."""
        return self.embed(self.collate(self.tokenize(texts)))


REPRESENTATIONS: dict[str, type[Representation]] = {
    "dense": Dense,
    "sparse": Sparse,
    "rerank": Rerank,
}


def representation_class(spec: ModelSpec) -> type[Representation]:
    """The class of what ``spec``'s model gives, chosen once at load: a dense model with
    BGE-M3's token heads beside its pipeline gives several representations (MultiVector)."""
    if spec.representation == "dense" and spec.token_heads is not None:
        return MultiVector
    return REPRESENTATIONS[spec.representation]


def cpu_paths(cpu: CpuClass, compiler: bool) -> list[str]:
    """Every forward path a CPU worker with EMBEDFLEET_DTYPE=auto may choose at start, each held
    to the same parity bar: float32; bfloat16 where the CPU runs it natively (elsewhere it is
    emulated, slower than float32); the dynamic int8 copy wherever FBGEMM/oneDNN have int8
    kernels (AVX2 and up: vpmaddubsw, VNNI, AMX); the W8A8 copy where inductor can compile its
    kernels (a C++ compiler) and the CPU has int8 dot-product instructions (VNNI, AMX): its
    int8 matmul (``torch._int_mm``) has no fast kernel below them, and on a real AVX2-only Zen 3
    it ran tens of times slower than float32 (docs/BENCHMARKS.md), after a minute's compile at
    every start. Which of them is kept is measured at start (prepare_query_graph)."""
    paths = ["float32"]
    if cpu.fast_bf16:
        paths.append("bfloat16")
    if cpu.int8_dot != "none":
        paths.append(DynamicInt8Forward.name)
    if compiler and cpu.int8_dot in ("vnni", "amx"):
        paths.append(W8A8Forward.name)
    return paths


def _layer_stack(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The stack of transformer layers: the longest ModuleList in the model (BERT's
    ``encoder.layer``, and the equivalent in other encoder architectures); an empty one if
    there is none."""
    candidates = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    return max(candidates, key=len) if candidates else torch.nn.ModuleList()


def _transformer_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    return list(_layer_stack(model))


def _lowercase_normalizer(backend: object) -> None:
    """``do_lower_case``: lower-case before the tokenizer's own normalizer, as
    sentence-transformers does for a fast tokenizer."""
    from tokenizers.normalizers import Lowercase, Sequence

    normalizer = backend.normalizer  # type: ignore[attr-defined]
    if normalizer is not None and "Lowercase" in repr(normalizer):
        return
    parts = [Lowercase()]
    if normalizer is not None:
        parts.append(normalizer)
    backend.normalizer = Sequence(parts)  # type: ignore[attr-defined]


def pairs_of(chunks: Sequence[Chunk]) -> list[str] | None:
    """The chunks' ``pair`` documents for :meth:`Encoder.tokenize`, or None where no chunk
    has one (a cross-encoder's chunks all do: ``Outputs.check_representation``)."""
    if all(chunk.pair is None for chunk in chunks):
        return None
    return [chunk.pair or "" for chunk in chunks]


def _milliseconds(seconds: dict[str, float]) -> dict[str, float]:
    """Log fields ``<path>_ms`` (``bfloat16_frozen_ms``, ``int8_w8a8_ms``) of timed paths."""
    return {
        f"{name.replace(' ', '_').replace('-', '_')}_ms": round(value * 1000, 1)
        for name, value in seconds.items()
    }


def _best_of_interleaved(runs: dict[str, Callable[[], object]], rounds: int) -> dict[str, float]:
    """Each run's shortest of ``rounds`` timed calls, taken in turn (A B C, A B C, ...) after
    one untimed call each, so a burst of contention slows every contender alike."""
    for run in runs.values():
        run()
    best = dict.fromkeys(runs, math.inf)
    for _ in range(rounds):
        for name, run in runs.items():
            started = time.perf_counter()
            run()
            best[name] = min(best[name], time.perf_counter() - started)
    return best


def _best_of(run: Callable[[], object], repeat: int) -> float:
    """The shortest of ``repeat`` timed calls, after one untimed (warm-up) call."""
    run()
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return min(times)
