"""A lane's calls for what a model gives beyond dense vectors: sparse weights, pair scores and
several representations of one forward pass, on the query or interactive stream.

``Producer`` (producer/client.py) extends ``RepresentationCalls``; each call is a request on a
request stream, sent and answered by ``Queries`` (producer/queries.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cached_property

import numpy as np

from embedfleet.producer.chunks import EmbeddingOptions
from embedfleet.producer.lane import ProducerLane
from embedfleet.producer.queries import Queries, RequestStream
from embedfleet.shared.protocol import Result, SparseVector


class RepresentationCalls(ProducerLane):
    """A lane's calls for sparse weights, pair scores and several representations."""

    @cached_property
    def _queries(self) -> Queries:
        return Queries(self)

    async def embed_sparse(
        self,
        texts: Sequence[str],
        *,
        timeout: float = 10.0,
        max_active_dims: int | None = None,
        lane: RequestStream = "query",
    ) -> list[SparseVector]:
        """Sparse (SPLADE) weights of ``texts`` from a fleet serving a SparseEncoder, as
        ``SparseEncoder.encode`` gives them (``max_active_dims``: only the largest that many
        per text). ``lane``: the query stream (few, short texts) or the interactive one.
        Timeouts and Redis faults as :meth:`embed_queries`."""
        return await self._queries.embed_sparse(texts, timeout, max_active_dims, lane)

    async def rerank(
        self,
        query: str,
        documents: Sequence[str],
        *,
        timeout: float = 10.0,
        lane: RequestStream = "query",
        raw_scores: bool = False,
    ) -> np.ndarray:
        """Scores of (``query``, document) for each document, in the documents' order, from a
        fleet serving a cross-encoder: ``CrossEncoder.predict``'s values (``raw_scores``: the
        logits before the model's activation, as TEI's ``raw_scores``). Sort them to rank.
        A thousand documents belong on ``lane="texts"`` (bulk-sized batches)."""
        return await self._queries.rerank(query, documents, timeout, lane, raw_scores)

    async def score_pairs(
        self,
        pairs: Sequence[tuple[str, str | None]],
        *,
        timeout: float = 10.0,
        lane: RequestStream = "query",
        raw_scores: bool = False,
    ) -> np.ndarray:
        """Every label's score of each (text, text) pair from a cross-encoder fleet, shape
        (len(pairs), labels): ``CrossEncoder.predict``'s values (one column for a reranker;
        ``raw_scores``: the logits before its activation). A pair ``(text, None)`` is the text
        classified alone, one sequence (TEI's single-text ``/predict``, the text-classification
        pipeline's input)."""
        return await self._queries.score_pairs(pairs, timeout, lane, raw_scores)

    async def embed_representations(
        self,
        texts: Sequence[str],
        representations: Sequence[str],
        *,
        timeout: float = 10.0,
        lane: RequestStream = "query",
        options: EmbeddingOptions | None = None,
        max_active_dims: int | None = None,
        multivector_dtype: str | None = None,
        token_states: bool = False,
    ) -> list[Result]:
        """Several representations of each text from one forward pass of a model that gives
        them (BGE-M3: ``dense``, ``sparse``, ``multivector``): each text's Result, in order,
        with ``vector`` (dense), ``sparse`` and ``multivector`` (per-token vectors, float16 or
        ``multivector_dtype="int8"`` on the wire) filled as asked. ``token_states``: the
        ``multivector`` holds instead every token's last hidden state, float32, special tokens
        included (sentence-transformers' ``output_value="token_embeddings"``), from any model
        with a dense pipeline (``representations=["dense"]``). ``lane`` and timeouts as
        :meth:`embed_sparse`; ``options`` shape the dense vector as :meth:`embed_queries`."""
        return await self._queries.embed_representations(
            texts,
            representations,
            timeout,
            lane,
            options,
            max_active_dims,
            multivector_dtype,
            token_states,
        )
