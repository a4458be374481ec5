"""The forward paths: the ways a padded batch becomes vectors, behind one small interface.

A :class:`ForwardPath` serves a batch and says which path computed it. There are four, each
built on the module that owns its mechanism, and the encoder (workers/model/encoder.py) holds the
one chosen once at start for queries (and, where it is a copy in reduced precision, bulk):

- :class:`EagerPath`: the loaded model itself, then the representation (workers/model/base.py);
  the only path with layer boundaries (queries get in there on a CPU) and every representation;
- :class:`CopyPath` of a frozen graph (workers/model/frozen.py), an int8 copy
  (workers/model/int8.py) or another engine's copy (workers/model/backends.py: ONNX Runtime,
  OpenVINO): a copy that returns hidden states, then the sentence pipeline;
- ``CudaQueryPath`` (workers/model/cuda_queries.py): the query stage's own copy on CUDA.

Which of them a CPU worker keeps is workers/model/choose.py's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Literal, Protocol

import numpy as np
import torch

from embedfleet.shared.settings.query_stage import Engine
from embedfleet.workers.model.backends import ENGINES, BackendForward
from embedfleet.workers.model.base import Forward, Representation
from embedfleet.workers.model.cuda_queries import QueryPath
from embedfleet.workers.model.dense import Dense
from embedfleet.workers.model.frozen import FrozenForward
from embedfleet.workers.model.int8 import Int8Forward
from embedfleet.workers.model.precision import Precision
from embedfleet.workers.model.tokenizer import EncodeBatch

# eager: the bulk model; frozen / int8 / onnxruntime / openvino: a CPU copy (the last two in
# another engine), without layer boundaries but OpenVINO's cut at its layers; cuda: the query
# stage's own copy and stream, served from its own thread
PathKind = Literal["eager", "frozen", "int8", Engine, "cuda"]
# the kinds of a CPU copy (queries, and bulk batches whole): torch's and another engine's
COPY_KINDS: tuple[PathKind, ...] = ("frozen", "int8", *ENGINES)


class ForwardPath(Protocol):
    """One way of computing a padded batch's vectors."""

    @property
    def name(self) -> str:
        """As logged and published (the worker's ``forward_path``)."""

    @property
    def kind(self) -> PathKind: ...

    def serve(self, batch: EncodeBatch) -> tuple[np.ndarray, QueryPath]:
        """The batch's vectors on the host, and which path computed them."""


class KeptPath:
    """What the forward path kept for queries (and frozen bulk) is, read off its kind: the
    encoder (workers/model/encoder.py) takes these facts from here, its ``query_path`` set
    once at start."""

    __slots__ = ()

    if TYPE_CHECKING:  # what the encoder holds
        query_path: ForwardPath

    @property
    def forward_path(self) -> str:
        """The forward path kept for queries (and frozen bulk), as logged and published."""
        return self.query_path.name

    @property
    def has_query_graph(self) -> bool:
        """Queries (and frozen bulk) run through a CPU copy: frozen, int8, another engine's."""
        return self.query_path.kind in COPY_KINDS

    @property
    def computes_in_int8(self) -> bool:
        """The query (and frozen bulk) graph is one of the int8 copies of workers/model/int8.py."""
        return self.query_path.kind == "int8"

    @property
    def engine(self) -> Engine | None:
        """The other engine whose copy serves queries and frozen bulk (ONNX Runtime, OpenVINO:
        workers/model/backends.py), or None where torch computes."""
        return next((engine for engine in ENGINES if engine == self.query_path.kind), None)

    @property
    def serves_queries_concurrently(self) -> bool:
        """Queries have their own model copy and stream (CUDA): serve them from their own
        thread, beside the bulk pass, not at its layer boundaries."""
        return self.query_path.kind == "cuda"


class EagerPath:
    """The loaded model, in its precision, then the representation: every kind of model, and
    forward pre-hooks at its layer boundaries (:meth:`set_layer_callback`)."""

    kind: PathKind = "eager"

    def __init__(
        self,
        model: torch.nn.Module,
        representation: Representation,
        precision: Precision,
        device: torch.device,
    ) -> None:
        self.model = model
        self.representation = representation
        # the precision settled at load (workers/model/precision.py's settle_auto sets it)
        self.precision = precision
        self.device = device
        self._layer_hooks: list[torch.utils.hooks.RemovableHandle] = []

    @property
    def name(self) -> str:
        return f"{self.precision.name} eager"

    @torch.inference_mode()
    def vectors(self, batch: EncodeBatch) -> torch.Tensor:
        """The batch's rows left on the model's device (on CUDA: returns once queued)."""
        input_ids = batch.input_ids.to(self.device, non_blocking=True)
        attention_mask = batch.attention_mask.to(self.device, non_blocking=True)
        extra: dict[str, torch.Tensor] = {}
        if batch.token_type_ids is not None:
            extra["token_type_ids"] = batch.token_type_ids.to(self.device, non_blocking=True)
        with self.precision.context(self.device):
            output = self.model(input_ids=input_ids, attention_mask=attention_mask, **extra)
        return self.representation.vectors(
            Forward(output, input_ids, attention_mask, batch.prompt_lengths, batch.heads)
        )

    def embed(self, batch: EncodeBatch) -> np.ndarray:
        return self.vectors(batch).cpu().numpy()

    def serve(self, batch: EncodeBatch) -> tuple[np.ndarray, QueryPath]:
        return self.embed(batch), "eager"

    def set_layer_callback(self, callback: Callable[[], None] | None) -> int:
        """Call ``callback`` before every transformer layer (``Encoder.set_layer_callback``);
        the number of layers hooked."""
        for handle in self._layer_hooks:
            handle.remove()
        self._layer_hooks = []
        if callback is None:
            return 0
        # a dual encoder (CLIP, SigLIP) has a stack a tower; any other model, one
        stacks = getattr(self.model, "layer_stacks", None)
        layers = [layer for stack in stacks() for layer in stack] if stacks else []
        layers = layers or list(layer_stack(self.model))

        def before_layer(_module: torch.nn.Module, _args: object) -> None:
            callback()

        self._layer_hooks = [layer.register_forward_pre_hook(before_layer) for layer in layers]
        return len(layers)


class CopyPath:
    """A copy of the model that returns hidden states (the frozen graph, an int8 copy, another
    engine's copy), then the sentence pipeline (:meth:`Dense.pooled`): a dense model's vectors,
    without layer hooks."""

    def __init__(
        self, copy: FrozenForward | Int8Forward | BackendForward, sentence: Dense, name: str
    ) -> None:
        self.copy = copy
        self.sentence = sentence
        self.name = name
        self.kind: PathKind = copy_kind(copy)
        # an int8 or engine copy's own name (``int8-w8a8``, ``openvino``), as its gate and the
        # race log it
        self.copy_name = name if isinstance(copy, FrozenForward) else copy.name

    @torch.inference_mode()
    def embed(self, batch: EncodeBatch) -> np.ndarray:
        hidden = self.copy(batch.input_ids, batch.attention_mask)
        return pooled_on_host(self.sentence, hidden, batch.attention_mask, batch.prompt_lengths)

    def serve(self, batch: EncodeBatch) -> tuple[np.ndarray, QueryPath]:
        return self.embed(batch), self.served_as

    def set_layer_callback(self, callback: Callable[[], None] | None) -> int:
        """Call ``callback`` at the copy's layer boundaries where it has any (OpenVINO's copy cut
        at its layers, workers/model/openvino.py); the number of boundaries (0: none, a batch
        through it is one slice)."""
        set_callback = getattr(self.copy, "set_layer_callback", None)
        return 0 if set_callback is None else int(set_callback(callback))

    @property
    def served_as(self) -> QueryPath:
        """The query path label of this copy's kind."""
        return _SERVED_AS[self.kind]


# a copy's kind as the query path label it serves under (the same word)
_SERVED_AS: dict[PathKind, QueryPath] = {
    "frozen": "frozen",
    "int8": "int8",
    "onnxruntime": "onnxruntime",
    "openvino": "openvino",
}


def copy_kind(copy: FrozenForward | Int8Forward | BackendForward) -> PathKind:
    """The path kind of ``copy``: frozen, int8, or its engine's name."""
    if isinstance(copy, FrozenForward):
        return "frozen"
    if isinstance(copy, Int8Forward):
        return "int8"
    if copy.name == "onnxruntime":
        return "onnxruntime"
    if copy.name == "openvino":
        return "openvino"
    raise ValueError(f"not a CPU copy: {copy!r}")


def pooled_on_host(
    sentence: Dense,
    hidden: torch.Tensor,
    attention_mask: torch.Tensor,
    prompt_lengths: torch.Tensor | None = None,
) -> np.ndarray:
    """The sentence pipeline (:meth:`Dense.pooled`) on a copy's hidden states, on the host."""
    return sentence.pooled(hidden, attention_mask, prompt_lengths).cpu().numpy()


def layer_stack(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The stack of transformer layers: the longest ModuleList in the model (BERT's
    ``encoder.layer``, and the equivalent in other encoder architectures); an empty one if
    there is none."""
    candidates = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
    return max(candidates, key=len) if candidates else torch.nn.ModuleList()
