"""The model: tokenizer + transformer + what its kind of model makes of the output.

The small contract the worker and tests use (TEI's Python backend shape): ``tokenize(texts)``
turns texts into token id lists (workers/model/tokenizer.py), ``collate`` pads them into a
batch, ``embed(batch)`` / ``vectors(batch)`` run the bulk model and its representation
(workers/model/base.py: one class per representation), and ``serve_query(batch)`` runs the
query path chosen once at start (workers/model/forward.py: eager, a frozen graph, an int8 copy,
the CUDA query path; workers/model/choose.py picks a CPU's). Everything here is synchronous;
the worker runs tokenization and the forward pass on their own threads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from concurrent.futures import Executor

import numpy as np
import torch

from embedfleet.shared.logging import adopt_library_logger

# one definition for the worker, the gateway and the splitter (those need no torch)
from embedfleet.shared.model_path import ModelNotFoundError, resolve_model_path
from embedfleet.shared.modelcard import ModelCard, served_name
from embedfleet.shared.options import PromptError
from embedfleet.shared.protocol import Chunk
from embedfleet.shared.settings import PACKAGED_MODEL
from embedfleet.shared.settings.query_stage import CpuBackend
from embedfleet.workers.cpus import usable_cpus
from embedfleet.workers.model.choose import CpuPaths, Int8Choice
from embedfleet.workers.model.clip import TextTowerModel
from embedfleet.workers.model.cuda_queries import (
    CudaQueryMode,
    CudaQueryPath,
    QueryPath,
)
from embedfleet.workers.model.forward import (
    CopyPath,
    EagerPath,
    ForwardPath,
    KeptPath,
    layer_stack,
    pooled_on_host,
)
from embedfleet.workers.model.load import load_model
from embedfleet.workers.model.precision import (
    FP32,
    PROBE_TEXTS,
    GateReport,
    Precision,
    requested_precision,
    settle,
)
from embedfleet.workers.model.tokenizer import (
    EncodeBatch,
    PromptRole,
    Tokenized,
    configure_tokenizer_threads,
)

# transformers installs its own stderr handler on import; its records go through ours instead
# (above a progress bar, quiet below --verbose), once the process has configured logging.
adopt_library_logger("transformers")

# what callers import from here: the encoder's batch types and its prompt refusal
__all__ = [
    "EncodeBatch",
    "Encoder",
    "ModelNotFoundError",
    "PromptError",
    "PromptRole",
    "Tokenized",
    "pairs_of",
    "resolve_model_path",
]


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


def configure_threads(device: torch.device, threads: int) -> None:
    """torch's intra-op threads: ``threads``, or on a CPU every usable one (0); on CUDA they
    do host-side work only (replicas on one GPU get one each), torch's default unless set."""
    if device.type == "cpu":
        torch.set_num_threads(threads or usable_cpus())
    elif threads:
        torch.set_num_threads(threads)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """The dtype asked for; for ``auto``, the reduced precision the device runs natively (the
    parity probe at load may still fall back to float32: see workers/model/precision.py)."""
    return requested_precision(dtype, device).dtype


class Encoder(KeptPath):
    """A loaded embedding model. Not thread-safe: one thread calls ``embed`` at a time.

    What its query path is (``forward_path``, ``has_query_graph``, ``computes_in_int8``,
    ``engine``, ``serves_queries_concurrently``): ``KeptPath`` (workers/model/forward.py)."""

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
        configure_threads(self.device, threads)
        # `auto` loads fp32 and settles on a precision after the parity probe, below.
        requested = requested_precision(dtype, self.device)
        load_dtype = torch.float32 if dtype == "auto" else requested.weights_dtype
        self.loaded = loaded = load_model(self.model_dir, self.device, load_dtype)
        self.spec, self._model, self._sentence = loaded.spec, loaded.model, loaded.sentence
        self._representation, self.text = loaded.representation, loaded.text
        self.representation = self.spec.representation
        self.pooling = self._sentence.pooling
        self.max_length, self.prompts = self.text.max_length, self.text.prompts
        self.pad_id, self.pad_left = self.text.pad_id, self.text.pad_left
        # a dual encoder's image processor (workers/images.py runs it); None: text only
        self.image_processor = loaded.image_processor
        self.dim = self._representation.dim
        # BGE-M3's heads: where each head's values sit in a packed row (workers/model/heads.py)
        self.layout = self._representation.layout
        self.eager = EagerPath(self._model, self._representation, requested, self.device)
        self.precision, self.parity = settle(
            dtype,
            requested,
            pooled=self.dense_only,
            model=self._model,
            embed=self.embed_texts,
            set_precision=self._set_precision,
        )
        self.dtype = self.precision.dtype
        # the CPU copies a worker may choose from (prepare_query_graph), and the path kept for
        # queries (and frozen bulk): eager until then
        self.paths = CpuPaths(
            self.eager,
            self._sentence,
            self._batch_of,
            auto_dtype=dtype == "auto",
            parity=self.parity,
        )
        if self.precision != FP32:  # the engines export float32 weights, not bf16's rounding
            self.paths.float32_model = lambda: (
                load_model(self.model_dir, torch.device("cpu"), torch.float32).model
            )
        self.query_path: ForwardPath = self.eager

    @property
    def precision(self) -> Precision:
        """The precision the model computes in (the eager path's, settled at load)."""
        return self.eager.precision

    @precision.setter
    def precision(self, precision: Precision) -> None:
        self.eager.precision = precision

    def _set_precision(self, precision: Precision) -> None:
        self.precision = precision

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
        """The facts this worker publishes about what it serves (shared/modelcard.py), with
        the precision it computes in (settled at load)."""
        return dataclasses.replace(self.loaded.card(self.name), dtype=self.precision.name)

    # --- slice boundaries ----------------------------------------------------------
    def set_layer_callback(self, callback: Callable[[], None] | None) -> int:
        """Call ``callback`` on the model thread before every transformer layer.

        This is where a long bulk forward pass yields to priority queries: the callback may run
        a whole (short) forward pass of its own, re-entrantly, then the bulk pass goes on.
        Returns the number of layers hooked (0 if the architecture has no layer list). The
        copy kept for queries and frozen bulk gets it too where it has layer boundaries
        (OpenVINO's, cut at its layers); other copies are one slice a batch.
        """
        if isinstance(self.query_path, CopyPath):
            self.query_path.set_layer_callback(callback)
        return self.eager.set_layer_callback(callback)

    @property
    def layer_count(self) -> int:
        return len(layer_stack(self._model))

    # --- prompts and tokenize -----------------------------------------------------------
    def resolve_prompt(
        self,
        role: PromptRole,
        *,
        prompt_name: str | None = None,
        prompt: str | None = None,
        role_default: str = "",
    ) -> str:
        """The prompt text for one chunk, chosen as ``encode_query`` (prompt role ``query``) or
        ``encode_document`` (bulk) choose it; ``role_default`` is the operator's override
        (EMBEDFLEET_QUERY_PROMPT_NAME / _DOCUMENT_PROMPT_NAME). Raises PromptError for a
        prompt name the model does not declare. An empty string means no prompt."""
        return self.text.resolve_prompt(role, prompt_name, prompt, role_default)

    def tokenize(
        self,
        texts: Sequence[str],
        prompts: Sequence[str] | None = None,
        *,
        pairs: Sequence[str | None] | None = None,
        encode_on: Executor | None = None,
    ) -> list[Tokenized]:
        """Token ids per text (``prompt + text`` where a prompt is given, as
        sentence-transformers joins them, so prompt tokens count against the maximum), cut to
        the model's maximum with the truncated flag set. On a cross-encoder: the encodings of
        :meth:`tokenize_pairs`, (text, pair) where ``pairs`` gives the text a document, the
        text alone where not.

        The batch call runs in Rust and releases the GIL, so callers put it on a thread; with
        ``encode_on`` (single texts only) it runs on that executor's thread instead.
        """
        if pairs is not None or self.representation == "rerank":
            # a cross-encoder's texts go through its own tokenizer, paired or alone, as
            # CrossEncoder and the text-classification pipeline tokenize them
            return self.tokenize_pairs(texts, pairs if pairs is not None else [None] * len(texts))
        return self.text.tokenize(texts, prompts, encode_on)

    def tokenize_pairs(
        self, queries: Sequence[str], documents: Sequence[str | None]
    ) -> list[Tokenized]:
        """Token and segment ids of (query, document) pairs for a cross-encoder, cut to the
        model's maximum ``longest_first`` as ``CrossEncoder.predict`` cuts them (a document
        None: the query alone, one sequence); ``truncated`` says a pair lost tokens."""
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
        return self.text.collate(items, pin=pin)

    def _batch_of(self, texts: Sequence[str]) -> EncodeBatch:
        return self.collate(self.tokenize(list(texts)))

    def embed(self, batch: EncodeBatch) -> np.ndarray:
        """Vectors for one batch: float32, shape (batch, dim), normalised if the model says so
        (a cross-encoder's logits: :meth:`activate` gives its scores)."""
        return self.vectors(batch).cpu().numpy()

    def activate(self, rows: np.ndarray) -> np.ndarray:
        """Rows of :meth:`embed` as the model answers them by default: a cross-encoder's logits
        through its activation (``CrossEncoder.predict``'s scores); others unchanged."""
        return self._representation.activate(rows)

    def vectors(self, batch: EncodeBatch) -> torch.Tensor:
        """:meth:`embed`'s vectors left on the model's device (on CUDA: returns once queued)."""
        return self.eager.vectors(batch)

    def embed_images(self, pixels: np.ndarray) -> np.ndarray:
        """A dual encoder's image vectors for preprocessed images (workers/images.py): float32,
        shape (batch, dim), ``get_image_features``' values. Call on the model thread."""
        if not isinstance(self._model, TextTowerModel):
            raise ValueError(f"the model {self.name!r} embeds text only")
        with torch.inference_mode(), self.precision.context(self.device):
            features = self._model.image_features(torch.from_numpy(pixels).to(self.device))
        result: np.ndarray = features.float().cpu().numpy()
        return result

    def embed_texts(self, texts: Sequence[str]) -> np.ndarray:
        """Convenience for tests and the CLI: tokenize, one batch, embed."""
        return self.embed(self.collate(self.tokenize(texts)))

    def head(self, pooled: torch.Tensor) -> torch.Tensor:
        """The modules after pooling (Dense, Normalize), on float32 pooled vectors."""
        return self._sentence.head(pooled)

    def warm_up(self) -> None:
        """Two forward passes of different shapes (kernels chosen, memory allocated, on CUDA
        the cuBLAS handles made) before anything is timed. Call on the model thread."""
        self.embed_texts(list(PROBE_TEXTS[:2]))
        self.embed_texts(list(PROBE_TEXTS[:4]))

    # --- the query path ---------------------------------------------------------------
    def embed_query(self, batch: EncodeBatch) -> np.ndarray:
        """Like ``embed``, through the frozen graph when one was prepared (short inputs on a
        CPU, see workers/model/frozen.py). No layer hooks fire in it."""
        return self.serve_query(batch)[0]

    def serve_query(self, batch: EncodeBatch) -> tuple[np.ndarray, QueryPath]:
        """``embed_query``, and which path computed the vectors: the CUDA query path's graph or
        stream (workers/model/cuda_queries.py), the frozen CPU graph or int8 copy, or the bulk
        model (eager). A batch that asks for heads beyond the pooled vector (the token states,
        BGE-M3's) is the eager model's whatever the path: the copies end in pooling."""
        if batch.heads is not None:
            return self.eager.serve(batch)
        return self.query_path.serve(batch)

    @property
    def computes_in_reduced_precision(self) -> bool:
        """The model, or the copy kept for queries and frozen bulk, computes in less than
        float32: bf16/fp16, or int8 linear layers (the worker then runs bulk through the copy).
        Another engine's copy counts too, whatever it computes in: it was chosen
        (EMBEDFLEET_CPU_BACKEND) to run the bulk."""
        return (
            self.precision.dtype != torch.float32
            or self.computes_in_int8
            or self.engine is not None
        )

    @property
    def gate_reports(self) -> dict[str, GateReport]:
        """The held-out gate's verdict on each int8 copy built (workers/model/choose.py)."""
        return self.paths.gate_reports

    def prepare_query_graph(
        self,
        int8: bool | Int8Choice = False,
        backend: CpuBackend = "torch",
        openvino_precision: str = "default",
    ) -> bool:
        """Build the frozen query graph, once, where it helps and holds parity: on a CPU, with
        the weights in their compute dtype (not autocast). Returns whether queries use it.

        ``int8`` (EMBEDFLEET_CPU_INT8 and EMBEDFLEET_CPU_INT8_PATH): ``True``/``"auto"`` builds
        every int8 copy of workers/model/int8.py this CPU can run (``cpu_paths``), holds each to
        the float32 bar on the held-out set (:func:`~embedfleet.workers.model.precision.gate`), and
        keeps the fastest of those that pass and the frozen graph (or the eager model) on a
        timed bulk-shaped batch. ``"w8a8"``/``"dynamic"``: only that copy, kept whenever it
        passes the gate, without the race (to force a path for a benchmark). ``False``/``"off"``:
        no int8. Only with EMBEDFLEET_DTYPE=auto, which computes float32's vectors to gate on.
        ``backend`` (EMBEDFLEET_CPU_BACKEND, workers/model/backends.py): ``onnxruntime`` /
        ``openvino`` builds that engine's copy and keeps it where it holds the bar on the
        held-out set; ``auto`` races every installed one against the path above; ``default``
        takes the engine adopted for this CPU class (workers/model/backends.py's
        ``adopted_engine``) as if named, or the path above where none is.

        The choice is made once (workers/model/choose.py) and logged ("forward path chosen",
        :attr:`forward_path`). Call it on the thread that runs the model; it takes about a
        second (with the W8A8 copy, its compile: up to about a minute on 2 cores, less with
        inductor's cache warm).
        """
        if not self.has_query_graph:
            chosen = self.paths.choose(int8, backend, openvino_precision)
            self.query_path = chosen or self.query_path
        return self.has_query_graph

    def prepare_cuda_queries(self, mode: CudaQueryMode) -> bool:
        """On CUDA, the query path of workers/model/cuda_queries.py (``mode``: ``graph``
        captures CUDA graphs too, ``stream`` does not, ``off`` keeps queries on the bulk model).
        Returns whether queries use it. Call on the model thread, before serving queries."""
        if self.device.type != "cuda" or mode == "off" or not self.dense_only:
            return False
        if not self.serves_queries_concurrently:
            self.query_path = CudaQueryPath.prepare(
                self.eager.model,
                lambda *rows: pooled_on_host(self._sentence, *rows),
                self.precision,
                self.device,
                mode=mode,
                text=self.text,
                name=self.query_path.name,
            )
        return True


def pairs_of(chunks: Sequence[Chunk]) -> list[str | None] | None:
    """The chunks' ``pair`` documents for :meth:`Encoder.tokenize` (None for a chunk without
    one: a cross-encoder classifies its text alone), or None where no chunk has one."""
    if all(chunk.pair is None for chunk in chunks):
        return None
    return [chunk.pair for chunk in chunks]
