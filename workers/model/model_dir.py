"""What a sentence-transformers directory asks for, read without sentence-transformers.

The worker embeds exactly what ``SentenceTransformer(path).encode`` would, so it must honour
every module and option the directory declares. This module reads ``modules.json`` and each
module's config into a :class:`ModelSpec` and **refuses** (``UnsupportedModelError``, naming
the module and the option) anything it cannot reproduce faithfully, rather than serving vectors
computed with a guess. What it accepts:

- ``Transformer`` (``sentence_transformers.models.Transformer`` or the newer
  ``sentence_transformers.base.modules.transformer.Transformer``) first, feature extraction on
  text; ``max_seq_length`` and ``do_lower_case`` from ``sentence_bert_config.json``.
- ``Pooling``: modes ``mean``, ``cls``, ``max``, ``lasttoken``, ``weightedmean``,
  ``mean_sqrt_len_tokens``, alone or concatenated, legacy ``pooling_mode_*`` keys or the single
  ``pooling_mode`` key, and ``include_prompt``.
- ``Dense`` (a linear layer, an activation from ``torch.nn``, optional residual) after pooling.
- ``Normalize``.
- ``config_sentence_transformers.json``: ``prompts`` and ``default_prompt_name``.
- A ``SparseEncoder`` (SPLADE): an ``MLMTransformer`` (or a ``Transformer`` with
  ``transformer_task: fill-mask``) then ``SpladePooling`` (max or sum, relu or log1p_relu): the
  spec's ``representation`` is ``sparse``, one vocabulary-wide weight vector per text.
- A ``CrossEncoder``: one ``Transformer`` with ``transformer_task: sequence-classification``
  (or a v3/v4 cross-encoder directory without modules.json, ``model_type: CrossEncoder``),
  its ``activation_fn``: the spec's ``representation`` is ``rerank``, a score per (query,
  document) pair.
- A BGE-M3-shaped directory: a dense SentenceTransformer (Transformer, Pooling, Normalize) with
  FlagEmbedding's token heads beside it, ``sparse_linear.pt`` (hidden -> 1, relu: one weight
  per token, the max over a token id's occurrences) and ``colbert_linear.pt`` (hidden -> d, on
  every token state after CLS, normalised: ColBERT vectors): the spec's ``token_heads``, run on
  the same forward pass as the dense vector (workers/model/heads.py).

A plain Hugging Face directory (no ``modules.json``) gets what sentence-transformers gives it:
mean pooling (last-token for a ``*ForCausalLM`` architecture), not normalised.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

POOLING_MODES = ("cls", "max", "mean", "mean_sqrt_len_tokens", "weightedmean", "lasttoken")
# Legacy keys, in the order sentence-transformers concatenates them.
LEGACY_POOLING_KEYS = {
    "pooling_mode_cls_token": "cls",
    "pooling_mode_max_tokens": "max",
    "pooling_mode_mean_tokens": "mean",
    "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
    "pooling_mode_weightedmean_tokens": "weightedmean",
    "pooling_mode_lasttoken": "lasttoken",
}
POOLING_KEYS = {
    "embedding_dimension",
    "word_embedding_dimension",
    "pooling_mode",
    "include_prompt",
    *LEGACY_POOLING_KEYS,
}
DENSE_KEYS = {
    "in_features",
    "out_features",
    "bias",
    "activation_function",
    "module_input_name",
    "module_output_name",
    "use_residual",
}
# sentence_bert_config.json keys that change nothing the worker computes
TRANSFORMER_HARMLESS_KEYS = {
    "max_seq_length",
    "do_lower_case",
    "model_args",
    "tokenizer_args",
    "config_args",
    "processor_kwargs",
    "model_kwargs",
    "config_kwargs",
    "backend",
}


# What a model dir serves: dense vectors (SentenceTransformer), SPLADE-style sparse weights
# (SparseEncoder) or pair scores (CrossEncoder); a dense model with BGE-M3's token heads gives
# sparse and multivector (ColBERT) too, from the same forward pass (ModelSpec.token_heads).
Representation = Literal["dense", "sparse", "rerank"]
# BGE-M3's head files, FlagEmbedding's names (torch state dicts: weight, bias)
SPARSE_HEAD_FILE = "sparse_linear.pt"
COLBERT_HEAD_FILE = "colbert_linear.pt"
SPLADE_STRATEGIES = ("max", "sum")
SPLADE_ACTIVATIONS = ("relu", "log1p_relu")
SPLADE_KEYS = {
    "pooling_strategy",
    "activation_function",
    "embedding_dimension",
    "word_embedding_dimension",
    "chunk_size",
}
# CrossEncoder.predict's default activation for one label, and the ones it may declare
SIGMOID = "torch.nn.modules.activation.Sigmoid"


class UnsupportedModelError(RuntimeError):
    """The model directory asks for something the worker cannot reproduce; the message says
    which module or option. The worker refuses to start rather than serve different vectors."""


@dataclass(frozen=True)
class DenseSpec:
    """One ``Dense`` module: ``activation(x @ weight.T + bias) (+ residual)``."""

    path: str
    weight: torch.Tensor
    bias: torch.Tensor | None
    activation: str  # a class name in torch.nn
    residual: torch.Tensor | None  # projection when use_residual and in != out
    use_residual: bool

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0])


@dataclass(frozen=True)
class LinearWeights:
    """One ``torch.nn.Linear``'s saved weights (a BGE-M3 head file)."""

    weight: torch.Tensor  # (out, in)
    bias: torch.Tensor | None

    @property
    def out_features(self) -> int:
        return int(self.weight.shape[0])

    def linear(self) -> torch.nn.Linear:
        """A float32 ``torch.nn.Linear`` holding a copy of these weights."""
        layer = torch.nn.Linear(
            self.weight.shape[1], self.weight.shape[0], bias=self.bias is not None
        )
        with torch.no_grad():
            layer.weight.copy_(self.weight)
            if self.bias is not None:
                layer.bias.copy_(self.bias)
        return layer


@dataclass(frozen=True)
class TokenHeads:
    """BGE-M3's heads on the token states, beside the dense vector: ``sparse`` (hidden -> 1)
    and ``colbert`` (hidden -> d); either may be absent."""

    sparse: LinearWeights | None = None
    colbert: LinearWeights | None = None

    @property
    def representations(self) -> tuple[str, ...]:
        """What they add to ``dense``: ``sparse``, ``multivector`` (shared/protocol.py names)."""
        return tuple(
            name
            for name, head in (("sparse", self.sparse), ("multivector", self.colbert))
            if head is not None
        )


@dataclass(frozen=True)
class ModelSpec:
    """The pipeline a sentence-transformers directory declares, in worker terms."""

    transformer_dir: Path
    pooling_modes: tuple[str, ...] = ("mean",)
    include_prompt: bool = True
    dense: tuple[DenseSpec, ...] = ()
    normalize: bool = False
    max_seq_length: int | None = None
    do_lower_case: bool = False
    prompts: dict[str, str] = field(default_factory=dict)
    default_prompt_name: str | None = None
    representation: Representation = "dense"
    # sparse: SpladePooling's strategy and activation
    splade_strategy: str = "max"
    splade_activation: str = "relu"
    # rerank: the torch.nn class applied to the logits (CrossEncoder's activation_fn)
    score_activation: str = "Identity"
    # dense models with BGE-M3's token heads (sparse and ColBERT); None for every other
    token_heads: TokenHeads | None = None

    def output_dim(self, hidden_size: int) -> int:
        if self.dense:
            return self.dense[-1].out_features
        return hidden_size * len(self.pooling_modes)


def _module_kind(module_type: str) -> str:
    """``sentence_transformers.models.Pooling`` (and the 5.x+ paths) -> ``Pooling``."""
    return module_type.rsplit(".", 1)[-1]


def read_model_spec(model_dir: Path) -> ModelSpec:
    """The spec of ``model_dir``; UnsupportedModelError for anything not reproducible."""
    st_config = _read_json(model_dir / "config_sentence_transformers.json")
    prompts, default_prompt = _read_prompts(model_dir, st_config)
    model_type = st_config.get("model_type", "SentenceTransformer")
    if model_type == "CrossEncoder":
        return _read_cross_encoder(model_dir, st_config, prompts, default_prompt)
    if model_type == "SparseEncoder":
        return _read_sparse_encoder(model_dir, prompts, default_prompt)
    modules_file = model_dir / "modules.json"
    if not modules_file.is_file() and _is_sequence_classifier(model_dir):
        # a cross-encoder saved before sentence-transformers v4 (or by transformers alone):
        # what CrossEncoder(path) loads it as
        return _read_cross_encoder(model_dir, st_config, prompts, default_prompt)
    if not modules_file.is_file():
        modes = ("lasttoken",) if _is_causal_lm(model_dir) else ("mean",)
        return ModelSpec(
            transformer_dir=model_dir,
            pooling_modes=modes,
            prompts=prompts,
            default_prompt_name=default_prompt,
        )
    if model_type != "SentenceTransformer":
        raise UnsupportedModelError(
            f"{model_dir}: config_sentence_transformers.json says model_type={model_type!r}; "
            "the worker serves SentenceTransformer (dense embedding) models only"
        )
    return _read_sentence_transformer(model_dir, modules_file, prompts, default_prompt)


def _read_sentence_transformer(
    model_dir: Path, modules_file: Path, prompts: dict[str, str], default_prompt: str | None
) -> ModelSpec:
    """A SentenceTransformer's spec from its ``modules.json``: Transformer, Pooling, then
    Dense and Normalize modules, in that order."""
    modules = json.loads(modules_file.read_text())
    spec: dict[str, Any] = {
        "prompts": prompts,
        "default_prompt_name": default_prompt,
    }
    dense: list[DenseSpec] = []
    seen: list[str] = []
    for index, module in enumerate(modules):
        kind = _module_kind(str(module.get("type", "")))
        path = str(module.get("path", ""))
        where = f"{model_dir}: module {index} ({module.get('type')!r} at {path or '.'!r})"
        _read_module(index, kind, model_dir / path, path, where, seen, spec, dense)
        seen.append(kind)
    if "Pooling" not in seen:
        raise UnsupportedModelError(
            f"{model_dir}: modules.json has no Pooling module; the worker needs one sentence "
            "vector per text"
        )
    heads = _read_token_heads(
        model_dir, int(_read_json(spec["transformer_dir"] / "config.json").get("hidden_size", 0))
    )
    return ModelSpec(
        transformer_dir=spec.pop("transformer_dir"), dense=tuple(dense), token_heads=heads, **spec
    )


def _read_module(
    index: int,
    kind: str,
    module_dir: Path,
    path: str,
    where: str,
    seen: list[str],
    spec: dict[str, Any],
    dense: list[DenseSpec],
) -> None:
    """Module ``index`` of ``modules.json`` (of ``kind``, after the kinds ``seen``) into
    ``spec`` and ``dense``; UnsupportedModelError for one out of order or not supported."""
    if index == 0:
        if kind != "Transformer":
            raise UnsupportedModelError(
                f"{where}: the first module must be a Transformer; the worker cannot run "
                f"a {kind} input module"
            )
        spec.update(_read_transformer(module_dir, where))
    elif kind == "Pooling":
        if "Pooling" in seen or "Dense" in seen or "Normalize" in seen:
            raise UnsupportedModelError(
                f"{where}: Pooling must come once, right after the Transformer"
            )
        spec.update(_read_pooling(module_dir, where))
    elif kind == "Dense":
        if "Pooling" not in seen or "Normalize" in seen:
            raise UnsupportedModelError(
                f"{where}: a Dense module is supported only after Pooling and before "
                "Normalize (on the sentence embedding)"
            )
        dense.append(_read_dense(module_dir, path, where))
    elif kind == "Normalize":
        if "Pooling" not in seen or "Normalize" in seen:
            raise UnsupportedModelError(f"{where}: Normalize must come after Pooling, once")
        spec["normalize"] = True
    else:
        raise UnsupportedModelError(
            f"{where}: the worker cannot run a {kind} module (it supports Transformer, "
            "Pooling, Dense, Normalize); refusing rather than serving different vectors "
            "than sentence-transformers would"
        )


def _read_token_heads(model_dir: Path, hidden_size: int) -> TokenHeads | None:
    """BGE-M3's ``sparse_linear.pt`` and ``colbert_linear.pt`` beside modules.json, checked to
    read the transformer's token states; None where there are none."""
    found: dict[str, LinearWeights] = {}
    for name, file, out in (("sparse", SPARSE_HEAD_FILE, 1), ("colbert", COLBERT_HEAD_FILE, None)):
        path = model_dir / file
        if not path.is_file():
            continue
        where = f"{model_dir}: {file}"
        # weights_only: a tensor file, never arbitrary pickled objects
        state = torch.load(path, map_location="cpu", weights_only=True)
        weight = state.get("weight") if isinstance(state, dict) else None
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            raise UnsupportedModelError(f"{where}: expected a Linear's state dict ('weight')")
        if int(weight.shape[1]) != hidden_size or (out is not None and weight.shape[0] != out):
            raise UnsupportedModelError(
                f"{where}: weight of shape {tuple(weight.shape)} does not read the "
                f"transformer's {hidden_size}-wide token states"
                + (f" into {out} value per token" if out is not None else "")
            )
        bias = state.get("bias")
        found[name] = LinearWeights(
            weight=weight.float(), bias=bias.float() if isinstance(bias, torch.Tensor) else None
        )
    if not found:
        return None
    return TokenHeads(sparse=found.get("sparse"), colbert=found.get("colbert"))


def _modules(model_dir: Path) -> list[dict[str, Any]]:
    file = model_dir / "modules.json"
    return json.loads(file.read_text()) if file.is_file() else []


def _read_sparse_encoder(
    model_dir: Path, prompts: dict[str, str], default_prompt: str | None
) -> ModelSpec:
    """SPLADE: an MLM transformer then SpladePooling, as ``SparseEncoder`` runs them."""
    modules = _modules(model_dir)
    kinds = [_module_kind(str(m.get("type", ""))) for m in modules]
    if (
        len(kinds) != 2
        or kinds[0] not in ("MLMTransformer", "Transformer")
        or kinds[1] != ("SpladePooling")
    ):
        raise UnsupportedModelError(
            f"{model_dir}: a SparseEncoder is served as MLMTransformer + SpladePooling only; "
            f"this one has {' + '.join(kinds) or 'no modules'}"
        )
    where = f"{model_dir}: module 0 ({modules[0].get('type')!r})"
    transformer = _read_transformer(model_dir / str(modules[0].get("path", "")), where, "fill-mask")
    config = _read_json(model_dir / str(modules[1].get("path", "")) / "config.json")
    where = f"{model_dir}: SpladePooling"
    unknown = set(config) - SPLADE_KEYS
    if unknown:
        raise UnsupportedModelError(f"{where}: option(s) {sorted(unknown)} not supported")
    strategy = config.get("pooling_strategy", "max")
    activation = config.get("activation_function", "relu")
    if strategy not in SPLADE_STRATEGIES or activation not in SPLADE_ACTIVATIONS:
        raise UnsupportedModelError(
            f"{where}: pooling_strategy={strategy!r} activation_function={activation!r}; "
            f"supported: {SPLADE_STRATEGIES} and {SPLADE_ACTIVATIONS}"
        )
    return ModelSpec(
        **transformer,
        prompts=prompts,
        default_prompt_name=default_prompt,
        representation="sparse",
        splade_strategy=strategy,
        splade_activation=activation,
    )


def _read_cross_encoder(
    model_dir: Path, st_config: dict[str, Any], prompts: dict[str, str], default_prompt: str | None
) -> ModelSpec:
    """A cross-encoder: a sequence-classification transformer, its logits through
    ``activation_fn`` (CrossEncoder's default: Sigmoid for one label, else Identity)."""
    modules = _modules(model_dir)
    kinds = [_module_kind(str(m.get("type", ""))) for m in modules]
    if modules and kinds != ["Transformer"]:
        raise UnsupportedModelError(
            f"{model_dir}: a CrossEncoder is served as one Transformer module only; "
            f"this one has {' + '.join(kinds)}"
        )
    module_dir = model_dir / (str(modules[0].get("path", "")) if modules else "")
    transformer = _read_transformer(module_dir, f"{model_dir}: module 0", "sequence-classification")
    config = _read_json(module_dir / "config.json")
    labels = int(config.get("num_labels") or len(config.get("id2label") or {}) or 1)
    declared = st_config.get("activation_fn") or (
        (config.get("sentence_transformers") or {}).get("activation_fn")
    )
    activation = str(declared or (SIGMOID if labels == 1 else "torch.nn.modules.linear.Identity"))
    class_name = activation.rsplit(".", 1)[-1]
    if not activation.startswith("torch.") or not isinstance(
        getattr(torch.nn, class_name, None), type
    ):
        raise UnsupportedModelError(
            f"{model_dir}: activation_fn {activation!r} is not a torch.nn class"
        )
    return ModelSpec(
        **transformer,
        prompts=prompts,
        default_prompt_name=default_prompt,
        representation="rerank",
        score_activation=class_name,
    )


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text()) if path.is_file() else {}


def _read_prompts(model_dir: Path, st_config: dict[str, Any]) -> tuple[dict[str, str], str | None]:
    prompts = st_config.get("prompts") or {}
    if not isinstance(prompts, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in prompts.items()
    ):
        raise UnsupportedModelError(
            f"{model_dir}: config_sentence_transformers.json 'prompts' must map names to strings"
        )
    default = st_config.get("default_prompt_name")
    if default is not None and default not in prompts:
        raise UnsupportedModelError(
            f"{model_dir}: default_prompt_name {default!r} is not one of its prompts "
            f"({', '.join(prompts) or 'none'})"
        )
    return dict(prompts), default


def _is_sequence_classifier(model_dir: Path) -> bool:
    architectures = _read_json(model_dir / "config.json").get("architectures") or []
    return bool(architectures) and str(architectures[0]).endswith("ForSequenceClassification")


def _is_causal_lm(model_dir: Path) -> bool:
    config = _read_json(model_dir / "config.json")
    architectures = config.get("architectures") or []
    return bool(
        architectures
        and str(architectures[0]).endswith("ForCausalLM")
        and config.get("is_causal", True)
    )


# per transformer task: the forward output sentence-transformers reads, and the module's
TASK_OUTPUTS = {
    "feature-extraction": ("last_hidden_state", "token_embeddings"),
    "fill-mask": ("logits", "token_embeddings"),
    "sequence-classification": ("logits", "scores"),
}


def _read_transformer(
    module_dir: Path, where: str, expected_task: str = "feature-extraction"
) -> dict[str, Any]:
    config = _read_json(module_dir / "sentence_bert_config.json")
    unknown = set(config) - TRANSFORMER_HARMLESS_KEYS
    task = config.get("transformer_task", expected_task)
    if task != expected_task:
        raise UnsupportedModelError(
            f"{where}: transformer_task={task!r}; this kind of model runs {expected_task}"
        )
    unknown.discard("transformer_task")
    method_output, module_output = TASK_OUTPUTS[expected_task]
    expected_modality = {"text": {"method": "forward", "method_output_name": method_output}}
    modality = config.get("modality_config", expected_modality)
    if modality != expected_modality:
        raise UnsupportedModelError(
            f"{where}: modality_config={modality!r}; the worker runs text through the "
            f"model's forward pass only ({expected_modality!r})"
        )
    output_name = config.get("module_output_name", module_output)
    if output_name != module_output:
        raise UnsupportedModelError(
            f"{where}: module_output_name={output_name!r}; expected {module_output!r}"
        )
    unknown -= {"modality_config", "module_output_name"}
    if unknown:
        raise UnsupportedModelError(
            f"{where}: sentence_bert_config.json option(s) {sorted(unknown)} are not supported "
            "(the worker embeds plain text with the tokenizer and model as saved)"
        )
    for name in ("model_args", "tokenizer_args", "config_args"):
        if config.get(name):
            raise UnsupportedModelError(
                f"{where}: sentence_bert_config.json {name}={config[name]!r} is not supported; "
                "save the model with those settings applied instead"
            )
    max_length = config.get("max_seq_length")
    if not (module_dir / "config.json").is_file():
        raise UnsupportedModelError(f"{where}: no config.json for the transformer")
    return {
        "transformer_dir": module_dir,
        "max_seq_length": max_length if isinstance(max_length, int) and max_length > 0 else None,
        "do_lower_case": bool(config.get("do_lower_case", False)),
    }


def _read_pooling(module_dir: Path, where: str) -> dict[str, Any]:
    config = _read_json(module_dir / "config.json")
    unknown = set(config) - POOLING_KEYS
    if unknown:
        raise UnsupportedModelError(f"{where}: Pooling option(s) {sorted(unknown)} not supported")
    named = config.get("pooling_mode")
    if named is None:
        modes = tuple(mode for key, mode in LEGACY_POOLING_KEYS.items() if config.get(key))
        modes = modes or ("mean",)
    elif isinstance(named, str):
        modes = (named,)
    else:
        modes = tuple(named)
    for mode in modes:
        if mode not in POOLING_MODES:
            raise UnsupportedModelError(
                f"{where}: pooling mode {mode!r} is not one of {', '.join(POOLING_MODES)}"
            )
    return {"pooling_modes": modes, "include_prompt": bool(config.get("include_prompt", True))}


def _read_dense(module_dir: Path, path: str, where: str) -> DenseSpec:
    config = _read_json(module_dir / "config.json")
    unknown = set(config) - DENSE_KEYS
    if unknown:
        raise UnsupportedModelError(f"{where}: Dense option(s) {sorted(unknown)} not supported")
    for name in ("module_input_name", "module_output_name"):
        if config.get(name, "sentence_embedding") != "sentence_embedding":
            raise UnsupportedModelError(
                f"{where}: Dense {name}={config[name]!r}; only a Dense on the sentence "
                "embedding is supported (not on token embeddings)"
            )
    activation = str(config.get("activation_function", "torch.nn.modules.activation.Tanh"))
    class_name = activation.rsplit(".", 1)[-1]
    if not activation.startswith("torch.") or not isinstance(
        getattr(torch.nn, class_name, None), type
    ):
        raise UnsupportedModelError(
            f"{where}: Dense activation_function {activation!r} is not a torch.nn class"
        )
    state = _load_weights(module_dir, where)
    weight = state.get("linear.weight")
    if weight is None:
        raise UnsupportedModelError(f"{where}: Dense weights have no 'linear.weight'")
    expected = (int(config["out_features"]), int(config["in_features"]))
    if tuple(weight.shape) != expected:
        raise UnsupportedModelError(
            f"{where}: Dense weight has shape {tuple(weight.shape)}, config says {expected}"
        )
    use_residual = bool(config.get("use_residual", False))
    return DenseSpec(
        path=path,
        weight=weight.float(),
        bias=state["linear.bias"].float() if config.get("bias", True) else None,
        activation=class_name,
        residual=state["residual.weight"].float() if "residual.weight" in state else None,
        use_residual=use_residual,
    )


def _load_weights(module_dir: Path, where: str) -> dict[str, torch.Tensor]:
    safetensors_file = module_dir / "model.safetensors"
    if safetensors_file.is_file():
        from safetensors.torch import load_file

        return load_file(str(safetensors_file))
    torch_file = module_dir / "pytorch_model.bin"
    if torch_file.is_file():
        # weights_only: a tensor file, never arbitrary pickled objects
        return torch.load(torch_file, map_location="cpu", weights_only=True)
    raise UnsupportedModelError(f"{where}: no model.safetensors or pytorch_model.bin")


# Whether SentenceHead applies the model's Normalize on this thread (``head_normalizes``).
_HEAD = threading.local()


@contextlib.contextmanager
def head_normalizes(normalize: bool) -> Iterator[None]:
    """Within it, every SentenceHead on this thread applies Normalize only if ``normalize``:
    a batch holding a long input's windows (issue 42, workers/long_inputs.py) is computed
    before Normalize, so its windows are averaged as the model pooled them and normalised
    after. Per thread, and set again around each forward (the query stage sets it back on for
    the queries it serves at a layer boundary of such a batch), since every forward path runs
    the head in Python on the thread that launched it."""
    before = getattr(_HEAD, "normalize", True)
    _HEAD.normalize = normalize
    try:
        yield
    finally:
        _HEAD.normalize = before


class SentenceHead(torch.nn.Module):
    """Everything after pooling: the Dense modules, then Normalize, in float32."""

    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList()
        self.residuals: list[torch.nn.Module | None] = []
        for dense in spec.dense:
            linear = LinearWeights(dense.weight, dense.bias).linear()
            residual: torch.nn.Module | None = None
            if dense.use_residual:
                if dense.residual is not None:
                    residual = LinearWeights(dense.residual, None).linear()
                else:
                    residual = torch.nn.Identity()
            self.layers.append(torch.nn.Sequential(linear, getattr(torch.nn, dense.activation)()))
            self.residuals.append(residual)
        self.normalize = spec.normalize

    def forward(self, pooled: torch.Tensor) -> torch.Tensor:
        for layer, residual in zip(self.layers, self.residuals, strict=True):
            out = layer(pooled)
            pooled = out if residual is None else out + residual(pooled)
        if self.normalize and getattr(_HEAD, "normalize", True):
            pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)
        return pooled


# A Hugging Face cache snapshot's folder is the commit it holds: .../snapshots/<40 hex>/
_SNAPSHOT_COMMIT = re.compile(r"[0-9a-f]{40}")
_REVISION_CHUNK = 1 << 20


def directory_revision(model_dir: Path) -> str:
    """The model's revision, for the content key (shared/content_key.py): a Hugging Face cache
    snapshot's commit (``hf:<sha>``), else a digest of every file of the directory, names and
    bytes (``blake2b:<hex>``), so a fine-tuned copy with the same layout and sizes is another
    revision. Hashed once per process and directory state (a file's size and mtime); a
    directory of several GB takes seconds, which EMBEDFLEET_MODEL_REVISION saves."""
    resolved = Path(model_dir).resolve()
    parts = resolved.parts
    for index, part in enumerate(parts[:-1]):
        if part == "snapshots" and _SNAPSHOT_COMMIT.fullmatch(parts[index + 1]):
            return f"hf:{parts[index + 1]}"
    files = sorted(
        path
        for path in resolved.rglob("*")
        if path.is_file()
        and not any(
            p.startswith(".") or p == "__pycache__" for p in path.relative_to(resolved).parts
        )
    )
    state = tuple(
        (str(path.relative_to(resolved)), path.stat().st_size, path.stat().st_mtime_ns)
        for path in files
    )
    return _hashed_revision(resolved, state)


@functools.cache
def _hashed_revision(root: Path, state: tuple[tuple[str, int, int], ...]) -> str:
    digest = hashlib.blake2b(digest_size=16)
    for relative, size, _ in state:
        digest.update(f"{relative}\0{size}\0".encode())
        with (root / relative).open("rb") as source:
            while block := source.read(_REVISION_CHUNK):
                digest.update(block)
    return f"blake2b:{digest.hexdigest()}"
