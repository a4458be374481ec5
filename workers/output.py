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
from dataclasses import dataclass

import numpy as np

from embedfleet.shared.content_key import VectorRecipe, content_key
from embedfleet.shared.modelcard import ModelCard
from embedfleet.shared.postprocess import QUANTIZED, quantize, truncate
from embedfleet.shared.postprocess import normalize as normalize_rows
from embedfleet.shared.protocol import (
    FULL_DIMENSIONS,
    LONG_INPUT_OPTION,
    OPTION_NAMES,
    REPRESENTATION_OPTION_NAMES,
    Chunk,
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
from embedfleet.workers.model.encoder import Encoder, Lane
from embedfleet.workers.model.heads import TOKEN_STATES
from embedfleet.workers.model.model_dir import directory_revision
from embedfleet.workers.model.packing import preferred_layout


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


class OutputOptionError(ValueError):
    """A chunk's dimensions or dtype cannot be produced for this model (dead-lettered)."""


def resolve_dimensions(requested: int | None, default: int, model_dim: int) -> int:
    """The dimension one chunk gets: its own (``FULL_DIMENSIONS``: the model's whole vector,
    whatever the setting says), else the setting (0 = full), checked."""
    if requested == FULL_DIMENSIONS:
        return model_dim
    dim = requested if requested is not None else (default or model_dim)
    if not 1 <= dim <= model_dim:
        raise OutputOptionError(
            f"dimensions={dim} is out of range for this model: use 1..{model_dim}"
        )
    return dim


# content-key recipes an Outputs keeps, by options (a few in practice: one per prompt and shape)
_RECIPES_HELD = 1024


@dataclass(frozen=True)
class OutputSpec:
    """What one chunk's vector becomes: its dimension and stored precision."""

    dim: int
    dtype: str


class Outputs:
    """Per-chunk prompts and output shapes for one worker: checks them on intake, turns the
    model's float32 vectors into results on the way out. Shared by the bulk path and the query
    lane, so both lanes apply the same rules."""

    def __init__(self, settings: Settings, encoder: Encoder, calibrations: CalibrationStore):
        self.settings = settings
        self.encoder = encoder
        self.calibrations = calibrations
        # a truncated vector of a normalising model is renormalised unless the operator asked
        # for sentence-transformers' truncate_dim exactly
        self.renormalize = settings.renormalize and encoder.pooling.normalize
        self._lane_defaults = {
            "query": settings.query_prompt_name,
            "document": settings.document_prompt_name,
        }
        self._recipes: dict[tuple[object, ...], VectorRecipe] = {}

    @functools.cached_property
    def card(self) -> ModelCard:
        """The model card the worker publishes, with the model's revision
        (EMBEDFLEET_MODEL_REVISION, else the directory's: hashing it the first time may take a
        while for a large model, so the worker asks for this at start, off the event loop)."""
        model_dir = getattr(self.encoder, "model_dir", None)  # (a test's stand-in may have none)
        revision = self.settings.model_revision or (
            directory_revision(model_dir) if model_dir is not None else ""
        )
        return dataclasses.replace(self.encoder.card, revision=revision)

    def content_key(self, chunk: Chunk, prompt: str) -> str | None:
        """The chunk's content key (shared/content_key.py) with its options as this worker
        resolves them; None where a stored vector must not be reused: int8/uint8 codes depend
        on the fleet's calibration ranges, which `embedfleet calibration` can replace."""
        spec = self.spec_for(chunk)
        if spec.dtype in QUANTIZED:
            return None
        # the recipe depends on the chunk's options, not its text: made once per set of options
        # (issue 43: rebuilt per chunk it cost more than the text's hash)
        options = (
            prompt,
            spec,
            chunk.max_active_dims,
            chunk.representations,
            chunk.multivector_dtype,
            chunk.normalize,
            chunk.window_overlap,
            chunk.raw_scores,
            chunk.token_states,
        )
        recipe = self._recipes.get(options)
        if recipe is None:
            if len(self._recipes) >= _RECIPES_HELD:  # (literal prompts are the callers': bounded)
                self._recipes.clear()
            recipe = self._recipes[options] = self._recipe(chunk, prompt, spec)
        return content_key(chunk.text, recipe, chunk.pair)

    def _recipe(self, chunk: Chunk, prompt: str, spec: OutputSpec) -> VectorRecipe:
        recipe = self.card.recipe(
            prompt=prompt,
            dimensions=spec.dim,
            renormalize=self.renormalize and spec.dim < self.encoder.dim,
            dtype=spec.dtype,
            max_active_dims=chunk.max_active_dims,
        )
        if chunk.representations:
            # what the chunk asks of a multi-head model (BGE-M3: dense, sparse, multivector from
            # one pass) is part of what it gets back, so of its key: an entry stored for a
            # dense-only chunk must not answer one that wants the per-token vectors too
            wanted = "+".join(sorted(chunk.representations))
            if "multivector" in chunk.representations:
                wanted += f":{chunk.multivector_dtype or 'float16'}"
            recipe = dataclasses.replace(recipe, representation=wanted)
        if chunk.raw_scores:
            # a cross-encoder's logits (TEI's raw_scores) are another answer than its scores
            recipe = dataclasses.replace(recipe, representation=f"{recipe.representation}:raw")
        if chunk.token_states:
            # the token states travel beside the pooled vector: an entry stored without them
            # must never answer a chunk that asks for them, nor theirs one that does not
            recipe = dataclasses.replace(
                recipe, representation=f"{recipe.representation}+{TOKEN_STATES}"
            )
        if chunk.normalize is False and recipe.normalize:
            # the vector before the model's Normalize (TEI's normalize=false) is another vector
            recipe = dataclasses.replace(recipe, normalize=False)
        if chunk.window_overlap is not None:
            # a long input embedded whole is another vector than the same text cut
            recipe = dataclasses.replace(
                recipe, representation=f"{recipe.representation}:windows:{chunk.window_overlap}"
            )
        return recipe

    def check_settings(self) -> None:
        """Fail at start on settings this model cannot honour (names the variable)."""
        model_dim = self.encoder.dim
        if self.settings.dimensions > model_dim:
            raise OutputOptionError(
                f"EMBEDFLEET_DIMENSIONS={self.settings.dimensions} is more than the model's "
                f"{model_dim} dimensions; use 1..{model_dim} or 0 for all"
            )
        for lane, name in self._lane_defaults.items():
            if name and name not in self.encoder.prompts:
                raise OutputOptionError(
                    f"EMBEDFLEET_{lane.upper()}_PROMPT_NAME={name!r} is not one of the model's "
                    f"prompts ({', '.join(sorted(self.encoder.prompts))})"
                )

    def prompt_for(self, chunk: Chunk, lane: Lane) -> str:
        """The chunk's prompt text, after checking its output options; ValueError with a
        reason to dead-letter (unknown prompt name, dimensions out of range, token states on a
        bulk lane that packs its batches)."""
        self.spec_for(chunk)
        if chunk.token_states and lane == "document" and self._bulk_packs:
            raise OutputOptionError(
                "'token_states' are computed on padded batches, and this worker's bulk lane "
                "packs its batches (the varlen layout): send them on the query stream (the "
                "gateway does), or run the workers with EMBEDFLEET_LAYOUT=padded"
            )
        if chunk.prompt_name is None and chunk.prompt is None:
            return self._lane_prompt(lane)  # most chunks: the lane's own, resolved once
        return self.encoder.resolve_prompt(
            lane,
            prompt_name=chunk.prompt_name,
            prompt=chunk.prompt,
            lane_default=self._lane_defaults[lane],
        )

    @functools.lru_cache(maxsize=4)  # noqa: B019 - two lanes, one Outputs per worker
    def _lane_prompt(self, lane: Lane) -> str:
        return self.encoder.resolve_prompt(
            lane, prompt_name=None, prompt=None, lane_default=self._lane_defaults[lane]
        )

    @functools.cached_property
    def _bulk_packs(self) -> bool:
        """Whether the bulk lane may run the varlen layout (workers/bulk.py resolve_layout), whose
        packed sequences give the pooled vectors alone; a model varlen cannot pool falls back to
        padded batches there, so this may refuse where padded would have run: the safe side."""
        layout = self.settings.layout
        if layout == "auto":
            layout = preferred_layout(self.encoder.device, self.encoder.dtype)
        return layout == "varlen" and self.encoder.dense_only

    def check_representation(self, chunk: Chunk) -> None:
        """ValueError (dead-lettered as options) for a chunk that asks what the model does not
        give: another representation, a pair for a model that embeds, or dense-only options on
        a sparse or rerank model. A cross-encoder's chunk without a pair is its text classified
        alone (one sequence, TEI's single-text /predict)."""
        served = self.encoder.representation
        offered = self.encoder.representations
        for wanted in chunk.wanted_representations:
            if wanted not in offered:
                raise OutputOptionError(
                    f"the model {self.encoder.name!r} serves {', '.join(offered)}, not {wanted}"
                )
        if served != "dense" and (chunk.dimensions is not None or chunk.dtype is not None):
            raise OutputOptionError(
                f"'dimensions' and 'dtype' shape dense vectors; this model gives {served}"
            )
        if chunk.max_active_dims is not None and "sparse" not in offered:
            raise OutputOptionError("'max_active_dims' prunes sparse weights; none here")
        if chunk.raw_scores is not None and "rerank" not in offered:
            raise OutputOptionError("'raw_scores' answers a cross-encoder's logits; none here")
        if chunk.multivector_dtype is not None and "multivector" not in offered:
            raise OutputOptionError("'multivector_dtype' shapes per-token vectors; none here")
        if chunk.token_states and "dense" not in offered:
            raise OutputOptionError(
                f"'token_states' answers the token states of a model with a dense pipeline; "
                f"the model {self.encoder.name!r} gives {served}"
            )
        if chunk.window_overlap is not None and (
            served != "dense"
            or any(wanted != "dense" for wanted in chunk.wanted_representations)
            or chunk.token_states
        ):
            # a sparse weight vector, per-token vectors or a pair's score have no mean over
            # windows that answers as the whole text's would
            raise OutputOptionError(
                f"'{LONG_INPUT_OPTION}' embeds a long input whole as one dense vector; it does "
                "not apply to sparse, multivector, token-state or rerank outputs"
            )

    def spec_for(self, chunk: Chunk) -> OutputSpec:
        if _without_output_options(chunk):
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
        if self.heads_for(chunks) is not None:  # packed rows hold token ids: float32
            return False
        if any(chunk.window_overlap is not None or chunk.normalize is False for chunk in chunks):
            # a long input's windows are pooled after the batch, and the batch's other rows
            # normalised after it (workers/long_inputs.py), from float32
            return False
        full = OutputSpec(dim=self.encoder.dim, dtype="float16")
        return all(self.spec_for(chunk) == full for chunk in chunks)

    def heads_for(self, chunks: Sequence[Chunk]) -> tuple[str, ...] | None:
        """The heads a batch of ``chunks`` computes on a multi-head model (``EncodeBatch.heads``;
        None: the dense vectors alone, as any dense model gives them)."""
        return self.encoder.heads_for([_heads_wanted(chunk) for chunk in chunks])

    def variant(self, dim: int) -> str:
        return variant_label(dim, self.encoder.dim, self.renormalize)

    async def prepare(
        self,
        chunks: Sequence[Chunk],
        run_on_model_thread: Callable[[Callable[[], Calibration]], Awaitable[Calibration]],
    ) -> None:
        """Load (or compute, once, fleet-wide) the calibrations these chunks' int8/uint8
        outputs need, so that :meth:`results` can run anywhere without I/O."""
        needed = {spec.dim for spec in map(self.spec_for, chunks) if spec.dtype in QUANTIZED}
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
            "document", lane_default=self._lane_defaults["document"]
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
    ) -> list[Result]:
        """Results in chunk order: each vector truncated and stored as its chunk asks, rows
        that ask for the same thing shaped together."""
        if self.encoder.representation != "dense":
            if self.encoder.representation == "rerank":
                # the model's rows are logits: its activation for every chunk but those that
                # ask for the logits themselves (raw_scores)
                raw = np.array([bool(chunk.raw_scores) for chunk in chunks])[:, None]
                vectors = np.where(raw, vectors, self.encoder.activate(vectors))
            return [
                self._sparse_or_score_result(chunk, vectors[row], truncated[row], with_meta)
                for row, chunk in enumerate(chunks)
            ]
        if self.heads_for(chunks) is not None:
            return self._head_results(chunks, vectors, truncated, with_meta=with_meta)
        return self._dense_results(chunks, vectors, truncated, with_meta=with_meta)

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
            self._result(
                chunk,
                truncated[row],
                with_meta,
                vector=stored[row],
                dtype=spec.dtype,
                dimension=spec.dim,
            )
            for row, (chunk, spec) in enumerate(zip(chunks, specs, strict=True))
        ]

    def _result(
        self,
        chunk: Chunk,
        truncated: bool,
        with_meta: bool,
        *,
        vector: np.ndarray,
        dtype: str,
        dimension: int,
        sparse: SparseVector | None = None,
        score: float | None = None,
    ) -> Result:
        """``chunk``'s result: its id and job, this model, whether its text was truncated and,
        ``with_meta``, its meta and text (a database sink stores them), with its
        representation's fields."""
        return Result(
            id=chunk.id,
            job=chunk.job,
            model=self.encoder.name,
            vector=vector,
            truncated=truncated,
            meta=chunk.meta if with_meta else None,
            text=chunk.text if with_meta else None,
            dtype=dtype,
            dimension=dimension,
            sparse=sparse,
            score=score,
        )

    def _head_results(
        self,
        chunks: Sequence[Chunk],
        rows: np.ndarray,
        truncated: Sequence[bool],
        *,
        with_meta: bool,
    ) -> list[Result]:
        """A multi-head model's packed rows (workers/model/heads.py): each chunk gets the
        representations it asked for (the dense vector shaped as any dense one is)."""
        layout = self.encoder.layout
        assert layout is not None
        unpacked = [layout.unpack(row) for row in rows]
        dense = np.stack([row.dense for row in unpacked])
        results = self._dense_results(chunks, dense, truncated, with_meta=with_meta)
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

    def _sparse_or_score_result(
        self, chunk: Chunk, row: np.ndarray, truncated: bool, with_meta: bool
    ) -> Result:
        """A sparse model's row as index/value pairs (pruned to ``max_active_dims``), a
        cross-encoder's as its scores."""
        values = np.asarray(row, dtype=np.float32)
        scores = self.encoder.representation != "sparse"  # else a sparse model's weights
        return self._result(
            chunk,
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


# every option a chunk may set (the protocol's lists, their one owner), read in one C call
_OPTIONS_OF = operator.attrgetter(*OPTION_NAMES, *REPRESENTATION_OPTION_NAMES)
_NO_OPTIONS = (None,) * (len(OPTION_NAMES) + len(REPRESENTATION_OPTION_NAMES))


def _heads_wanted(chunk: Chunk) -> tuple[str, ...]:
    """What a chunk asks of the model's heads: its representations, and the token states where
    it asks for them (workers/model/heads.py)."""
    wanted = chunk.wanted_representations
    return (*wanted, TOKEN_STATES) if chunk.token_states else wanted


def _without_output_options(chunk: Chunk) -> bool:
    """Whether ``chunk`` sets none of the protocol's options (its spec is then the model's own,
    the same for every such chunk; a chunk setting any goes through the whole check)."""
    return _OPTIONS_OF(chunk) == _NO_OPTIONS
