"""A stand-in for the model, for benchmarks of everything but the model (issue 29).

``EMBEDFLEET_BENCHMARK_STANDIN_ENCODER_US_PER_TOKEN`` set makes the worker build a
:class:`StandInEncoder` instead of the real one: the model's own tokenizer, maximum length,
prompts and dimension (the real :class:`Encoder` is loaded, so tokenization, sorting, planning
and collation are exactly the worker's), but no forward pass. Each batch "costs" the setting's
microseconds per real token (a sleep on the model thread, like a device the host waits on; 0: no
cost at all) and returns vectors of the right shape: unit vectors picked by a cheap hash of the
token ids, so equal texts get equal vectors and different ones mostly differ.

It is never chosen by accident: the setting's name says what it is, the worker logs a warning
at start, and the model card it publishes (and so every result's ``model``) is
``benchmark-standin:<model>``, which no producer or gateway confuses with the real model.

It always runs as a CPU device: the padded layout, synchronous launches, no frozen or CUDA query
graphs (those would compile and run the real model).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

import numpy as np
import torch

from embedfleet.shared.modelcard import ModelCard
from embedfleet.shared.settings import PACKAGED_MODEL
from embedfleet.workers.model.cuda_queries import CudaQueryMode, QueryPath
from embedfleet.workers.model.encoder import EncodeBatch, Encoder

STANDIN_PREFIX = "benchmark-standin:"
# distinct unit vectors the stand-in picks from (a hash of a text's token ids picks one)
BASIS_ROWS = 1021


class StandInEncoder(Encoder):
    """:class:`Encoder`'s interface with the forward pass replaced by a fixed cost per token."""

    def __init__(
        self,
        model: str = PACKAGED_MODEL,
        *,
        us_per_token: float = 0.0,
        threads: int = 0,
        name: str | None = None,
    ) -> None:
        if us_per_token < 0:
            raise ValueError("us_per_token must be 0 or more")
        super().__init__(model, device="cpu", dtype="float32", threads=threads, name=name)
        self.name = STANDIN_PREFIX + self.name
        self.us_per_token = us_per_token
        generator = np.random.default_rng(29)
        basis = generator.standard_normal((BASIS_ROWS, self.dim)).astype(np.float32)
        self._basis = basis / np.linalg.norm(basis, axis=1, keepdims=True)

    @property
    def card(self) -> ModelCard:
        return dataclasses.replace(super().card, name=self.name)

    def _made_up(self, batch: EncodeBatch) -> np.ndarray:
        ids, mask = batch.input_ids.numpy(), batch.attention_mask.numpy()
        real_tokens = int(mask.sum())
        if self.us_per_token:
            time.sleep(real_tokens * self.us_per_token / 1e6)
        # a cheap, deterministic hash of each row's real token ids
        weights = np.arange(1, ids.shape[1] + 1, dtype=np.int64)
        rows = ((ids * mask) * weights).sum(axis=1) % BASIS_ROWS
        return self._basis[rows]

    def embed(self, batch: EncodeBatch) -> np.ndarray:
        return self._made_up(batch)

    def vectors(self, batch: EncodeBatch) -> torch.Tensor:
        return torch.from_numpy(self._made_up(batch))

    def embed_query(self, batch: EncodeBatch) -> np.ndarray:
        return self._made_up(batch)

    def serve_query(self, batch: EncodeBatch) -> tuple[np.ndarray, QueryPath]:
        return self._made_up(batch), "eager"

    # nothing of the real model is prepared, compiled or hooked
    def set_layer_callback(self, callback: Callable[[], None] | None) -> int:
        return 0

    @property
    def has_query_graph(self) -> bool:
        return False

    @property
    def computes_in_reduced_precision(self) -> bool:
        return False

    @property
    def computes_in_int8(self) -> bool:
        return False

    def prepare_query_graph(self, *args: object, **kwargs: object) -> bool:
        # any arguments the real one takes (its int8 choices change): nothing is built
        return False

    def prepare_cuda_queries(self, mode: CudaQueryMode) -> bool:
        return False

    def warm_up(self) -> None:
        self.embed_texts(["warm up"])
