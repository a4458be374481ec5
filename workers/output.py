"""The last stage before a sink: Matryoshka truncation and the output precision, per chunk
(the operations themselves are shared/postprocess.py's, which the gateway uses too).

The model gives float32 vectors of its full dimension. Per chunk (or job, or setting):

``dimensions``
    Keep the first ``dimensions`` values (Matryoshka). Where the model normalises, the kept part
    is normalised again (``renormalize``, the default; what TEI and vLLM do), because a
    truncated unit vector is no longer unit length and cosine/dot search then disagree.
    ``EMBEDFLEET_RENORMALIZE=false`` gives sentence-transformers' ``truncate_dim`` exactly
    (``SentenceTransformer(..., truncate_dim=d).encode``): the first d values, not renormalised.
``dtype``
    ``float16`` / ``float32``, or ``int8``, ``uint8``, ``binary``, ``ubinary`` as
    sentence-transformers' ``quantize_embeddings`` stores them. int8/uint8 need calibration
    ranges (workers/calibration.py).
"""

from __future__ import annotations

import dataclasses
import functools
import operator
from collections.abc import Awaitable, Callable, Sequence

import numpy as np

from embedfleet.shared.modelcard import ModelCard
from embedfleet.shared.options import (
    OptionError,
    check_dimensions_setting,
    check_modality,
    check_prompt_setting,
    check_representation,
    refuse_packed_token_states,
    resolve_dimensions,
)
from embedfleet.shared.postprocess import QUANTIZED, quantize, truncate
from embedfleet.shared.postprocess import normalize as normalize_rows
from embedfleet.shared.protocol import (
    COLUMNAR_DTYPES,
    Chunk,
    DenseResults,
    MultiVector,
    Result,
    SparseVector,
)
from embedfleet.shared.settings import Settings
from embedfleet.workers.batcher import plan_batches
from embedfleet.workers.calibration import (
    Calibration,
    CalibrationStore,
    calibration_texts,
    compute,
    variant_label,
)
from embedfleet.workers.model.encoder import Encoder, PromptRole
from embedfleet.workers.model.heads import TOKEN_STATES, HeadRow
from embedfleet.workers.model.model_dir import directory_revision
from embedfleet.workers.model.packing import preferred_layout
from embedfleet.workers.recipes import OutputSpec, Recipes


def pool_windows(
    vectors: np.ndarray, counts: Sequence[int], weights: Sequence[int], *, normalize: bool
) -> np.ndarray:
    """Long inputs' vectors (issue 42) from their windows' rows: ``vectors`` holds each input's
    ``counts[i]`` rows one after another; each input's vector is the mean of its rows weighted
    by ``weights`` (each window's real tokens), normalised where the model normalises. float32,
    one row per input; an input of one window keeps its row (normalised again: unchanged)."""
    rows = np.asarray(vectors, dtype=np.float32)
    if sum(counts) != len(rows) or len(weights) != len(rows) or min(counts, default=1) < 1:
        raise ValueError(f"{sum(counts)} windows counted, {len(rows)} rows given")
    if not counts:
        return rows.reshape(0, rows.shape[-1] if rows.ndim == 2 else 0)
    weighted = rows * np.asarray(weights, dtype=np.float32)[:, None]
    starts = np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.int64)
    totals = np.add.reduceat(weighted, starts, axis=0)
    pooled = totals / np.add.reduceat(np.asarray(weights, dtype=np.float32), starts)[:, None]
    return normalize_rows(pooled) if normalize else pooled.astype(np.float32, copy=False)


# whether a chunk asks for the model's own output alone (Chunk.plain), read in C over a batch
_PLAIN = operator.attrgetter("plain")

# The worker's name for the verifier's errors (workers/cli.py and tests catch it): every rule a
# chunk's options break raises a subclass of it, from shared/options.py
OutputOptionError = OptionError


class Outputs:
    """Per-chunk prompts and output shapes for one worker: checks them on intake, turns the
    model's float32 vectors into results on the way out. Shared by the bulk path and the query
    stage, so both apply the same rules."""

    def __init__(self, settings: Settings, encoder: Encoder, calibrations: CalibrationStore):
        self.settings = settings
        self.encoder = encoder
        self.calibrations = calibrations
        # a truncated vector of a normalising model is renormalised unless the operator asked
        # for sentence-transformers' truncate_dim exactly
        self.renormalize = settings.renormalize and encoder.pooling.normalize
        self._role_defaults = {
            "query": settings.query_prompt_name,
            "document": settings.document_prompt_name,
        }

    @functools.cached_property
    def card(self) -> ModelCard:
        """The card the worker publishes, with the model's revision (EMBEDFLEET_MODEL_REVISION,
        else the directory's: hashing it may take a while, so the worker asks at start)."""
        model_dir = getattr(self.encoder, "model_dir", None)  # (a test's stand-in may have none)
        revision = self.settings.model_revision or (
            directory_revision(model_dir) if model_dir is not None else ""
        )
        return dataclasses.replace(self.encoder.card, revision=revision)

    def content_key(self, chunk: Chunk, prompt: str) -> str | None:
        """The chunk's content key (shared/content_key.py) with its options as this worker
        resolves them; None where a stored vector must not be reused (int8/uint8 codes: the
        calibration `embedfleet calibration` can replace) or made (an image by reference)."""
        spec = self.spec_for(chunk)
        if spec.dtype in QUANTIZED or (chunk.image is None and chunk.image_ref is not None):
            return None
        return self._recipes.key(chunk, prompt, spec)

    @functools.cached_property
    def _recipes(self) -> Recipes:
        # made on first use: the card's revision may hash the model directory
        return Recipes(self.card, renormalize=self.renormalize, model_dim=self.encoder.dim)

    def check_settings(self) -> None:
        """Fail at start on settings this model cannot honour (names the variable)."""
        check_dimensions_setting(self.settings.dimensions, self.encoder.dim)
        for role, name in self._role_defaults.items():
            check_prompt_setting(role, name, self.encoder.prompts)

    def prompt_for(self, chunk: Chunk, role: PromptRole) -> str:
        """The chunk's prompt text, after checking its output options; an OptionError (the
        verifier's) to dead-letter: a prompt name, dimensions, token states on a packing lane."""
        self.spec_for(chunk)
        if chunk.token_states and role == "document" and self._bulk_packs:
            refuse_packed_token_states()
        if chunk.prompt_name is None and chunk.prompt is None:
            return self._role_prompt(role)  # most chunks: the role's own, resolved once
        return self.encoder.resolve_prompt(
            role,
            prompt_name=chunk.prompt_name,
            prompt=chunk.prompt,
            role_default=self._role_defaults[role],
        )

    @functools.lru_cache(maxsize=4)  # noqa: B019 - two prompt roles, one Outputs per worker
    def _role_prompt(self, role: PromptRole) -> str:
        return self.encoder.resolve_prompt(
            role, prompt_name=None, prompt=None, role_default=self._role_defaults[role]
        )

    @functools.cached_property
    def _bulk_packs(self) -> bool:
        """Whether the bulk path may run the varlen layout (workers/bulk.py resolve_layout), whose
        packed sequences give the pooled vectors alone; a model varlen cannot pool falls back to
        padded batches there, so this may refuse where padded would have run: the safe side."""
        layout = self.settings.layout
        if layout == "auto":
            layout = preferred_layout(self.encoder.device, self.encoder.dtype)
        return layout == "varlen" and self.encoder.dense_only

    def check_representation(self, chunk: Chunk) -> None:
        """The verifier's modality and representation checks (shared/options.py): options."""
        check_modality(chunk.is_image, self.card.modalities)
        check_representation(chunk, self.encoder.name, self.encoder.representations)

    def spec_for(self, chunk: Chunk) -> OutputSpec:
        if chunk.plain:
            # most chunks: the model's own output, checked and resolved once (it is asked for
            # several times per chunk; issue 53: a GPU host's CPU per text)
            return self._plain_spec
        return self._resolved_spec(chunk)

    @functools.cached_property
    def _plain_spec(self) -> OutputSpec:
        return self._resolved_spec(Chunk("", " "))

    def _resolved_spec(self, chunk: Chunk) -> OutputSpec:
        self.check_representation(chunk)
        if self.encoder.representation != "dense":  # scores and weights travel as float32
            return OutputSpec(dim=self.encoder.dim, dtype="float32")
        dim = resolve_dimensions(chunk.dimensions, self.settings.dimensions, self.encoder.dim)
        return OutputSpec(dim=dim, dtype=chunk.dtype or self.settings.output_dtype)

    def full_float16(self, chunks: Sequence[Chunk]) -> bool:
        """Whether every chunk stores the model's whole vector in float16 (the default): then
        the device may cast before the copy back, since nothing after it needs more precision
        (a truncated or quantized vector is computed from float32)."""
        if chunks and all(map(_PLAIN, chunks)):  # most batches: answered once per worker
            return self._plain_full_float16
        if self.heads_for(chunks) is not None:  # packed rows hold token ids: float32
            return False
        if any(chunk.window_overlap is not None or chunk.normalize is False for chunk in chunks):
            # a long input's windows are pooled after the batch, and the batch's other rows
            # normalised after it (workers/long_inputs.py), from float32
            return False
        full = OutputSpec(dim=self.encoder.dim, dtype="float16")
        return all(self.spec_for(chunk) == full for chunk in chunks)

    @functools.cached_property
    def _plain_full_float16(self) -> bool:
        """``full_float16`` of plain chunks: the same for every batch of them."""
        full = OutputSpec(dim=self.encoder.dim, dtype="float16")
        return self._plain_heads is None and self._plain_spec == full

    def heads_for(self, chunks: Sequence[Chunk]) -> tuple[str, ...] | None:
        """The heads a batch of ``chunks`` computes on a multi-head model (``EncodeBatch.heads``;
        None: the dense vectors alone, as any dense model gives them)."""
        if chunks and all(map(_PLAIN, chunks)):
            # most batches: no chunk asks for a representation or the token states, the same
            # answer every time (asked twice a batch on the event loop; issue 53)
            return self._plain_heads
        return self.encoder.heads_for([_heads_wanted(chunk) for chunk in chunks])

    @functools.cached_property
    def _plain_heads(self) -> tuple[str, ...] | None:
        return self.encoder.heads_for([()])

    def variant(self, dim: int) -> str:
        return variant_label(dim, self.encoder.dim, self.renormalize)

    async def prepare(
        self,
        chunks: Sequence[Chunk],
        run_on_model_thread: Callable[[Callable[[], Calibration]], Awaitable[Calibration]],
    ) -> None:
        """Load (or compute, once, fleet-wide) the calibrations these chunks' int8/uint8
        outputs need, so that :meth:`results` can run anywhere without I/O."""
        # a batch of plain chunks has one spec, the worker's own (asked per batch: issue 53)
        plain = bool(chunks) and all(map(_PLAIN, chunks))
        specs = [self._plain_spec] if plain else map(self.spec_for, chunks)
        needed = {spec.dim for spec in specs if spec.dtype in QUANTIZED}
        for dim in sorted(needed):
            variant = self.variant(dim)
            await self.calibrations.get(
                variant,
                functools.partial(
                    run_on_model_thread, functools.partial(self._calibrate, dim, variant)
                ),
            )

    def _calibrate(self, dim: int, variant: str) -> Calibration:
        """On the model thread: embed the calibration corpus as documents and measure."""
        texts = calibration_texts()
        prompt = self.encoder.resolve_prompt(
            "document", role_default=self._role_defaults["document"]
        )

        def embed(batch_texts: list[str]) -> np.ndarray:
            tokens = self.encoder.tokenize(batch_texts, [prompt] * len(batch_texts))
            vectors = np.zeros((len(tokens), self.encoder.dim), dtype=np.float32)
            for planned in plan_batches([t.length for t in tokens], 4096, 128):
                batch = self.encoder.collate([tokens[p] for p in planned.positions])
                vectors[planned.positions] = self.encoder.embed(batch)
            return truncate(vectors, dim, renormalize=self.renormalize)

        return compute(self.encoder.name, variant, embed, texts)

    def results(
        self,
        chunks: Sequence[Chunk],
        vectors: np.ndarray,
        truncated: Sequence[bool],
        *,
        with_meta: bool = True,
    ) -> Sequence[Result]:
        """Results in chunk order: each vector truncated and stored as its chunk asks, rows
        that ask for the same thing shaped together. A batch of plain chunks in float16 or
        float32 (the common case) comes back as columns (DenseResults), its Results made only
        where a consumer indexes them."""
        if self.encoder.representation != "dense":
            if self.encoder.representation == "rerank":
                # the model's rows are logits: its activation for every chunk but those that
                # ask for the logits themselves (raw_scores)
                raw = np.array([bool(chunk.raw_scores) for chunk in chunks])[:, None]
                vectors = np.where(raw, vectors, self.encoder.activate(vectors))
            scores = self.encoder.representation != "sparse"  # else a sparse model's weights
            return [
                sparse_or_score_result(
                    chunk, self.encoder.name, vectors[row], truncated[row], with_meta, scores=scores
                )
                for row, chunk in enumerate(chunks)
            ]
        if self.heads_for(chunks) is not None:
            layout = self.encoder.layout
            assert layout is not None
            unpacked = [layout.unpack(row) for row in vectors]
            dense = np.stack([row.dense for row in unpacked])
            results = self._dense_results(chunks, dense, truncated, with_meta=with_meta)
            return with_heads(chunks, results, unpacked)
        columns = self._columns(chunks, vectors, truncated, with_meta=with_meta)
        if columns is not None:
            return columns
        return self._dense_results(chunks, vectors, truncated, with_meta=with_meta)

    def _columns(
        self,
        chunks: Sequence[Chunk],
        vectors: np.ndarray,
        truncated: Sequence[bool],
        *,
        with_meta: bool,
    ) -> DenseResults | None:
        """The batch's results as columns where every chunk is plain (one output spec: the
        model's own) and that spec is float16 or float32: one cut and one cast of the whole
        matrix (issue 53). None otherwise: int8/uint8 (calibrated) and the binary types, and
        any chunk with its own options, take :meth:`_dense_results`."""
        spec = self._plain_spec
        if spec.dtype not in COLUMNAR_DTYPES or not chunks or not all(map(_PLAIN, chunks)):
            return None
        shaped = truncate(vectors, spec.dim, renormalize=self.renormalize)
        return DenseResults(
            chunks,
            quantize(shaped, spec.dtype),
            truncated,
            model=self.encoder.name,
            dtype=spec.dtype,
            with_meta=with_meta,
        )

    def _dense_results(
        self,
        chunks: Sequence[Chunk],
        vectors: np.ndarray,
        truncated: Sequence[bool],
        *,
        with_meta: bool,
    ) -> list[Result]:
        specs = [self.spec_for(chunk) for chunk in chunks]
        stored: dict[int, np.ndarray] = {}  # row -> its vector; every row is in one group
        # by spec, and whether the row is the vector before Normalize (``normalize`` false):
        # that one is cut to its dimensions as it is, not renormalised
        groups: dict[tuple[OutputSpec, bool], list[int]] = {}
        for row, spec in enumerate(specs):
            groups.setdefault((spec, chunks[row].normalize is False), []).append(row)
        for (spec, raw), rows in groups.items():
            renormalize = self.renormalize and not raw
            shaped = truncate(vectors[rows], spec.dim, renormalize=renormalize)
            ranges = None
            if spec.dtype in QUANTIZED:
                cached = self.calibrations.cached(self.variant(spec.dim))
                if cached is None:
                    raise RuntimeError("Outputs.prepare() must load calibrations first")
                ranges = cached.ranges
            quantized = quantize(shaped, spec.dtype, ranges)
            for index, row in enumerate(rows):
                stored[row] = quantized[index]
        return [
            chunk_result(
                chunk,
                self.encoder.name,
                truncated[row],
                with_meta,
                vector=stored[row],
                dtype=spec.dtype,
                dimension=spec.dim,
            )
            for row, (chunk, spec) in enumerate(zip(chunks, specs, strict=True))
        ]


def chunk_result(
    chunk: Chunk,
    model: str,
    truncated: bool,
    with_meta: bool,
    *,
    vector: np.ndarray,
    dtype: str,
    dimension: int,
    sparse: SparseVector | None = None,
    score: float | None = None,
) -> Result:
    """``chunk``'s result: its id and job, the model, whether its text was truncated and,
    ``with_meta``, its meta and text (a database sink stores them; an image's reference:
    ``Chunk.row_text``), with its representation's fields."""
    return Result(
        id=chunk.id,
        job=chunk.job,
        model=model,
        vector=vector,
        truncated=truncated,
        meta=chunk.meta if with_meta else None,
        text=chunk.row_text if with_meta else None,
        dtype=dtype,
        dimension=dimension,
        sparse=sparse,
        score=score,
    )


def with_heads(
    chunks: Sequence[Chunk], results: list[Result], unpacked: Sequence[HeadRow]
) -> list[Result]:
    """A multi-head model's results (workers/model/heads.py): each chunk's dense result, shaped
    as any dense one is, with the representations it asked for from its unpacked row."""
    shaped = []
    for chunk, result, row in zip(chunks, results, unpacked, strict=True):
        wanted = chunk.wanted_representations or ("dense",)
        changes: dict[str, object] = {}
        if "dense" not in wanted:
            changes.update(vector=np.zeros(0, np.float32), dimension=0, dtype="float32")
        if "sparse" in wanted:
            assert row.sparse is not None, "the batch computed the heads its chunks want"
            changes["sparse"] = pruned(row.sparse, chunk.max_active_dims)
        if "multivector" in wanted:
            assert row.multivector is not None
            changes["multivector"] = MultiVector.of(
                row.multivector, chunk.multivector_dtype or "float16"
            )
        if chunk.token_states:
            assert row.token_states is not None
            changes["multivector"] = MultiVector.of(row.token_states, "float32")
        shaped.append(dataclasses.replace(result, **changes) if changes else result)  # type: ignore[arg-type]
    return shaped


def sparse_or_score_result(
    chunk: Chunk, model: str, row: np.ndarray, truncated: bool, with_meta: bool, *, scores: bool
) -> Result:
    """A sparse model's row as index/value pairs (pruned to ``max_active_dims``), a
    cross-encoder's (``scores``) as its scores."""
    values = np.asarray(row, dtype=np.float32)
    return chunk_result(
        chunk,
        model,
        truncated,
        with_meta,
        vector=values if scores else np.zeros(0, dtype=np.float32),
        dtype="float32",
        dimension=int(values.shape[0]) if scores else 0,
        sparse=None if scores else sparse_vector(values, chunk.max_active_dims),
        score=float(values[0]) if scores else None,
    )


def pruned(vector: SparseVector, max_active_dims: int | None) -> SparseVector:
    """``vector`` with only its ``max_active_dims`` largest weights (as :func:`sparse_vector`
    prunes: top-k by magnitude, ties to the lower index), indices ascending."""
    if max_active_dims is None or vector.indices.shape[0] <= max_active_dims:
        return vector
    order = np.sort(np.argsort(-np.abs(vector.values), kind="stable")[:max_active_dims])
    return SparseVector(indices=vector.indices[order], values=vector.values[order], dim=vector.dim)


def sparse_vector(weights: np.ndarray, max_active_dims: int | None = None) -> SparseVector:
    """The non-zero weights of one vocabulary-wide row, indices ascending; with
    ``max_active_dims``, only the largest that many (``select_max_active_dims``: top-k by
    magnitude; ties fall to the lower index)."""
    indices = np.flatnonzero(weights)
    if max_active_dims is not None and indices.shape[0] > max_active_dims:
        order = np.argsort(-np.abs(weights[indices]), kind="stable")[:max_active_dims]
        indices = np.sort(indices[order])
    return SparseVector(
        indices=indices.astype(np.uint32),
        values=weights[indices].astype(np.float32),
        dim=int(weights.shape[0]),
    )


def _heads_wanted(chunk: Chunk) -> tuple[str, ...]:
    """What a chunk asks of the model's heads: its representations, and the token states where
    it asks for them (workers/model/heads.py)."""
    wanted = chunk.wanted_representations
    return (*wanted, TOKEN_STATES) if chunk.token_states else wanted
