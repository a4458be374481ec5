"""Wire protocol v1: what goes into the streams, as msgpack.

Every stream entry has one field, ``m``, holding a msgpack map with ``v`` (the protocol version).
Anything that can speak Redis and msgpack can produce chunks and read results; nothing is ever
pickled, and unpacking is bounded so a hostile payload cannot make a worker allocate gigabytes.

The messages (chunk, query fields, result, error reply, dead letter), field by field, and how a
caller waits for a query's answer are listed once, in ``shared/protocol_doc.py``: the README's
protocol section is generated from it, and ``tests/integration/shared/test_protocol_doc.py`` checks
it against what
this module writes and accepts.

Why still v1: every new field is optional and a v1 reader that ignores them still reads every
result it asked for (fp16 unless it asked otherwise), and a v1 chunk without them means what it
always meant. A version bump would have made every existing producer's chunks unreadable to new
workers, or every new worker's results unreadable to existing consumers, for no gain.

dead letter (dead-letter stream): plain string fields for ``redis-cli XRANGE``, described in
``shared/dead_letters.py``.

Validation of a chunk is written once, here (``chunk_from_mapping``), with the limits Settings
holds (``ChunkLimits``): the producer, the JSON Lines reader and the worker's decoder all call it,
so what a producer accepts is what a worker embeds.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import operator
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, get_args, overload

import msgpack
import numpy as np

from embedfleet.shared.dead_letters import DeadReason
from embedfleet.shared.keys import TENANT_PATTERN
from embedfleet.shared.records import require_class_defaults
from embedfleet.shared.tokens import TOKEN_ID_BYTES

PROTOCOL_VERSION = 1
PAYLOAD_FIELD = b"m"
MAX_ID_CHARS = 512
MAX_PROMPT_NAME_CHARS = 256
MAX_PROMPT_CHARS = 16_384
# a chunk's producer-made token ids: at most this many (the producer sends ids cut at the
# model's maximum + 1, so any model's input fits), and the fingerprint's length
MAX_TOKEN_IDS = 65_536
MAX_TOKENIZER_CHARS = 128
# ``window_overlap``: a long input embedded whole, in token windows of the model's length that
# share this many tokens with their neighbour (issue 42). Its form is checked here; whether it
# leaves a window room to advance is the worker's check, against the model's length.
LONG_INPUT_OPTION = "window_overlap"
# What a model may give for a text (the model card's ``representations``): a dense vector, a
# SPLADE-style sparse weight vector, ColBERT-style per-token vectors (``multivector``), or, for
# a (query, document) pair, a relevance score. A model with several (BGE-M3: dense, sparse and
# multivector) computes every one a chunk asks for from one forward pass.
Representation = Literal["dense", "sparse", "multivector", "rerank"]
REPRESENTATIONS: tuple[str, ...] = get_args(Representation)
# How per-token vectors travel: float16 values, float32 values (a dense model's token states
# always: they are no unit vectors), or int8 codes with one float32 scale per vector
# (value = code * scale; symmetric, scale = max |value| / 127)
MultivectorDtype = Literal["float16", "float32", "int8"]
MULTIVECTOR_DTYPES: tuple[str, ...] = get_args(MultivectorDtype)
# numpy storage type of a multivector's ``data`` for each of them
MULTIVECTOR_STORAGE: dict[str, str] = {"float16": "<f2", "float32": "<f4", "int8": "i1"}
MAX_PAIR_CHARS = 1_000_000
# ``dimensions`` meaning "the model's whole vector", whatever the fleet's EMBEDFLEET_DIMENSIONS
# says: what a caller that does not know the model's dimension (the gateway before any worker
# published it) sends to get the model's native output.
FULL_DIMENSIONS = 0

# Output precisions, as sentence-transformers names them (plus float16, the default).
OutputDtype = Literal["float16", "float32", "int8", "uint8", "binary", "ubinary"]
OUTPUT_DTYPES: tuple[str, ...] = get_args(OutputDtype)
DEFAULT_DTYPE = "float16"
# numpy storage type of ``vec`` for each output precision (binary types are bit-packed)
STORAGE_DTYPES: dict[str, str] = {
    "float16": "<f2",
    "float32": "<f4",
    "int8": "i1",
    "uint8": "u1",
    "binary": "i1",
    "ubinary": "u1",
}


def stored_length(dtype: str, dim: int) -> int:
    """How many values ``vec`` holds for a ``dim``-dimensional vector of ``dtype``."""
    return (dim + 7) // 8 if dtype in ("binary", "ubinary") else dim


class ProtocolError(ValueError):
    """A payload that is not a valid v1 message; the message says why, for a person to read,
    and ``code`` is the dead-letter reason it files under."""

    def __init__(self, message: str, code: DeadReason = DeadReason.INVALID) -> None:
        super().__init__(message)
        self.code = code
        # Who the refused message belongs to, where it says so in valid fields: the dead letter
        # then counts against its job and its caller's reply list gets the error, so a job with
        # an oversized chunk still finishes and a waiting caller is answered.
        self.chunk_id: str | None = None
        self.job: str | None = None
        self.reply: str | None = None
        self.tenant: str | None = None


# the largest image a chunk carries by default: room under the 4 MiB message for its fields
DEFAULT_MAX_IMAGE_BYTES = 3 * 1024 * 1024
# what an image chunk's ``image`` may hold: encoded files the worker decodes (workers/images.py)
IMAGE_FORMATS = ("JPEG", "PNG", "WEBP", "GIF")
# the most pixels an image may decode to (workers/images.py sets Pillow's bound to it): a
# 40-megapixel photo passes; a small file that expands past it (a decompression bomb) is refused
# before its pixels are held. Embedding models see a few hundred pixels a side.
MAX_IMAGE_PIXELS = 40_000_000
# an image chunk's ``image_ref`` (where the image came from: a path, an s3:// URI): S3's keys
# reach 1,024 bytes, a bucket 63 characters; a database row stores it in place of a text
MAX_IMAGE_REF_CHARS = 2048


@dataclass(frozen=True)
class ChunkLimits:
    """What a chunk may hold. ``Settings.chunk_limits`` gives the configured ones."""

    max_id_chars: int = MAX_ID_CHARS
    max_text_chars: int = 1_000_000
    max_meta_bytes: int = 16 * 1024
    max_message_bytes: int = 4 * 1024 * 1024
    # an image chunk's encoded bytes (EMBEDFLEET_MAX_IMAGE_BYTES): below the message's limit
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES


DEFAULT_LIMITS = ChunkLimits()


@dataclass(frozen=True, kw_only=True)
class ChunkOptions:
    """The optional embedding options a chunk may carry (see the module docstring), None where
    unset; a job's or a request's options (producer/chunks.py ``EmbeddingOptions``, this record)
    fill in the same names."""

    prompt_name: str | None = None
    prompt: str | None = None
    dimensions: int | None = None
    dtype: str | None = None
    # embed a text over the model's maximum whole (issue 42): split into token windows of the
    # model's length overlapping by this many tokens, one forward row each, pooled back into
    # one vector (workers/long_inputs.py); None: cut or refused as EMBEDFLEET_TRUNCATE says
    window_overlap: int | None = None
    # false: the dense vector before the model's Normalize module (TEI's normalize=false, issue
    # 42); None or true: the model's pipeline whole. No effect on a model that does not normalise
    normalize: bool | None = None


@dataclass(frozen=True, kw_only=True)
class RepresentationOptions:
    """A chunk's options of the other representations (sparse weights, pair scores), None
    where unset; a v1 worker that predates them never sees them (the gateway checks the model
    card first)."""

    # which representations to compute (None: the one the model serves)
    representations: tuple[str, ...] | None = None
    # sparse: keep only the largest this many weights (SparseEncoder's max_active_dims)
    max_active_dims: int | None = None
    # rerank: the document scored against ``text`` (the query), as CrossEncoder.predict's pair;
    # None on a cross-encoder: ``text`` classified alone, one sequence (TEI's single-text /predict)
    pair: str | None = None
    # multivector: how the per-token vectors travel (None: float16)
    multivector_dtype: str | None = None
    # rerank: true answers the classifier's logits, before the model's activation (TEI's
    # raw_scores); None or false: CrossEncoder.predict's activated scores
    raw_scores: bool | None = None
    # true: the result's ``multivector`` holds the last hidden state of every token of the
    # input, special tokens included, float32, before pooling (sentence-transformers'
    # output_value="token_embeddings", TEI's /embed_all), beside the pooled vector; a model
    # with a dense pipeline only
    token_states: bool | None = None


# the options' names, in the records' order: what a chunk's mapping, the wire and a job's
# options read and write by name
OPTION_NAMES = tuple(option.name for option in dataclasses.fields(ChunkOptions))
REPRESENTATION_OPTION_NAMES = tuple(
    option.name for option in dataclasses.fields(RepresentationOptions)
)


@dataclass(frozen=True)
class Chunk(RepresentationOptions, ChunkOptions):
    """One text (or image) to embed. ``id`` is the caller's idempotency key. Its options
    (``ChunkOptions``, ``RepresentationOptions``) are keyword-only."""

    id: str
    text: str = ""  # empty on an image chunk
    job: str | None = None
    meta: dict[str, Any] | None = None
    reply: str | None = None
    deadline_ms: int | None = None
    # the producer it is accounted to and shares the fleet as (None: the default tenant)
    tenant: str | None = None
    # embed it with the model even where the vector cache holds its vector (issue 31): a
    # per-chunk opt-out of the cache (`embedfleet enqueue --reembed` sets it on every chunk)
    reembed: bool = False
    # token ids of ``prompt + text`` made by the producer with the model lane's published
    # tokenizer (issue 53: tokenize where the CPUs are), little-endian uint32; ``tokenizer``
    # is that tokenizer's fingerprint (shared/tokens.py ``ids_fingerprint``). The worker embeds
    # these ids instead of tokenizing ``text``, and dead-letters ids of another tokenizer.
    token_ids: bytes | None = None
    tokenizer: str | None = None
    # an image to embed instead of ``text`` (a CLIP or SigLIP lane: issue 56): an encoded file
    # of IMAGE_FORMATS (GIF: its first frame), at most ``ChunkLimits.max_image_bytes``
    image: bytes | None = None
    # where ``image`` came from (a file's path, an s3:// URI), for a person to find it again:
    # a database row stores it in place of a text, never the bytes (sinks: ``Result.text``).
    # Without ``image``: the worker reads the image from there, a folder or S3 bucket that
    # EMBEDFLEET_IMAGE_SOURCES allows (workers/image_sources.py)
    image_ref: str | None = None

    @property
    def is_image(self) -> bool:
        """An image chunk: its bytes inline, or a reference the worker reads them from."""
        return self.image is not None or self.image_ref is not None

    @property
    def row_text(self) -> str | None:
        """What a database row keeps in its ``text`` column: the text, or an image chunk's
        ``image_ref`` (where it came from; None without one), never the image's bytes."""
        return self.image_ref if self.is_image else self.text

    @property
    def wanted_representations(self) -> tuple[str, ...]:
        """What the chunk asks for explicitly: its ``representations``, and ``rerank`` for a
        pair (empty: whatever the model serves)."""
        wanted = tuple(self.representations or ())
        if self.pair is not None and "rerank" not in wanted:
            wanted = (*wanted, "rerank")
        return wanted

    @functools.cached_property
    def plain(self) -> bool:
        """Whether the chunk sets none of the options and carries no image: its output is the
        model's own, the same for every such chunk. Worked out once a chunk (the worker asks
        at several stages; a GPU host's CPU per text, issue 53); ``_plain_chunk`` knows it."""
        return _OPTIONS_OF(self) == _NO_OPTIONS


# every option a chunk may set, read in one C call (an image chunk is not plain either: its
# modality is the model's or not; by its bytes or its reference alone)
_OPTIONS_OF = operator.attrgetter(*OPTION_NAMES, *REPRESENTATION_OPTION_NAMES, "image", "image_ref")
_NO_OPTIONS = (None,) * (len(OPTION_NAMES) + len(REPRESENTATION_OPTION_NAMES) + 2)

# ``_plain_chunk`` always sets a chunk's id and text; the other fields, job and token ids
# included where it has none, read as their defaults from the class
require_class_defaults(Chunk, ("id", "text"))


@dataclass(frozen=True)
class SparseVector:
    """A sparse weight vector: the non-zero ``values`` at ``indices`` (ascending) of a
    ``dim``-wide vector (the vocabulary, for SPLADE). On the wire: ``indices`` little-endian
    uint32 bytes, ``values`` little-endian float32 bytes."""

    indices: np.ndarray  # uint32, ascending
    values: np.ndarray  # float32, same length
    dim: int


@dataclass(frozen=True)
class MultiVector:
    """Per-token vectors (ColBERT, late interaction: ``count`` vectors of ``dim`` values, unit
    length; or a dense model's token states). On the wire: ``data`` is the (count, dim) matrix
    row-major, little-endian float16 or float32, or int8 codes with ``scales`` (little-endian
    float32, one per vector: value = code * scale)."""

    values: np.ndarray  # (count, dim): float16 or float32 values, or int8 codes
    dtype: str = "float16"  # MULTIVECTOR_DTYPES
    scales: np.ndarray | None = None  # (count,) float32, int8 only

    @property
    def count(self) -> int:
        return int(self.values.shape[0])

    @property
    def dim(self) -> int:
        return int(self.values.shape[1])

    def floats(self) -> np.ndarray:
        """The vectors as float32, (count, dim)."""
        values = np.asarray(self.values, dtype=np.float32)
        if self.dtype == "int8":
            assert self.scales is not None
            return values * np.asarray(self.scales, dtype=np.float32)[:, None]
        return values

    @classmethod
    def of(cls, vectors: np.ndarray, dtype: str = "float16") -> MultiVector:
        """float32 (count, dim) vectors in their wire form ``dtype``."""
        vectors = np.asarray(vectors, dtype=np.float32).reshape(len(vectors), -1)
        if dtype == "int8":
            peak = np.abs(vectors).max(axis=1) if vectors.size else np.zeros(len(vectors))
            scales = np.where(peak > 0, peak / 127.0, 1.0).astype(np.float32)
            codes = np.clip(np.rint(vectors / scales[:, None]), -127, 127).astype(np.int8)
            return cls(values=codes, dtype="int8", scales=scales)
        if dtype == "float32":
            return cls(values=vectors, dtype="float32")
        return cls(values=vectors.astype(np.float16), dtype="float16")


@dataclass(frozen=True)
class Result:
    """One embedding, as stored by the Redis sink.

    ``vector`` is in its stored form: float16/float32 values, int8/uint8 codes, or packed bits
    for the binary types (then ``dimension`` gives the unpacked dimension).
    """

    id: str
    model: str
    vector: np.ndarray  # STORAGE_DTYPES[dtype], shape (stored_length(dtype, dim),)
    job: str | None = None
    truncated: bool = False
    meta: dict[str, Any] | None = field(default=None)
    dtype: str = DEFAULT_DTYPE
    dimension: int | None = None  # needed only for the bit-packed types
    # The chunk's text, in the process only: a database sink stores it beside the vector
    # (EMBEDFLEET_STORE_TEXT); the results stream does not carry it (the producer has it).
    text: str | None = None
    # a sparse model's weights (then ``vector`` is empty, ``dimension`` 0)
    sparse: SparseVector | None = None
    # a cross-encoder's score of (text, pair), CrossEncoder.predict's value; ``vector`` holds
    # all its labels' scores in float32 (one, for a reranker)
    score: float | None = None
    # a multivector model's per-token vectors (ColBERT), or a dense model's token states
    # (``token_states``), where the chunk asked for them
    multivector: MultiVector | None = None

    @property
    def dim(self) -> int:
        if self.dimension is not None:
            return self.dimension
        if self.dtype in ("binary", "ubinary"):
            return int(self.vector.shape[0]) * 8
        return int(self.vector.shape[0])


# the output dtypes a batch's results may travel as columns (DenseResults): one value per
# dimension, so each row's vector is a fixed run of the matrix's bytes
COLUMNAR_DTYPES = ("float16", "float32")


class DenseResults(Sequence[Result]):
    """The dense results of one batch whose rows all share one output (model, dimension,
    float16 or float32): columns, not one Result per row (issue 53: the CPU a GPU host spends
    per text). Row ``i`` is ``chunks[i]``'s vector ``vectors[i]`` (already in ``dtype``), with
    ``truncated[i]``; its meta and text as ``with_meta`` says.

    A Sequence[Result], so every sink keeps its contract: a row's Result is made when it is
    indexed (a database sink, the vector cache). The Redis sink never indexes it:
    :func:`encode_results` packs the columns, byte for byte what ``encode_result`` writes."""

    __slots__ = ("chunks", "dtype", "model", "truncated", "vectors", "with_meta")

    def __init__(
        self,
        chunks: Sequence[Chunk],
        vectors: np.ndarray,
        truncated: Sequence[bool],
        *,
        model: str,
        dtype: str,
        with_meta: bool = True,
    ) -> None:
        if dtype not in COLUMNAR_DTYPES:
            raise ValueError(f"{dtype} vectors do not travel as columns")
        if vectors.ndim != 2 or len(vectors) != len(chunks) or len(truncated) != len(chunks):
            raise ValueError(f"{len(chunks)} chunks, {len(truncated)} flags, {vectors.shape} rows")
        self.chunks = chunks
        self.vectors = np.asarray(vectors, dtype=STORAGE_DTYPES[dtype])
        self.truncated = truncated
        self.model = model
        self.dtype = dtype
        self.with_meta = with_meta

    def __len__(self) -> int:
        return len(self.chunks)

    @overload
    def __getitem__(self, index: int) -> Result: ...

    @overload
    def __getitem__(self, index: slice) -> DenseResults: ...

    def __getitem__(self, index: int | slice) -> Result | DenseResults:
        if isinstance(index, slice):
            return self.take(range(len(self))[index])
        chunk = self.chunks[index]  # (an index out of range raises IndexError here)
        meta, text = (chunk.meta, chunk.row_text) if self.with_meta else (None, None)
        return Result(
            id=chunk.id,
            job=chunk.job,
            model=self.model,
            vector=self.vectors[index],
            truncated=self.truncated[index],
            meta=meta,
            text=text,
            dtype=self.dtype,
            dimension=int(self.vectors.shape[1]),
        )

    def __iter__(self) -> Iterator[Result]:
        return (self[row] for row in range(len(self)))

    def take(self, rows: Sequence[int]) -> DenseResults:
        """The rows ``rows``, in that order, as columns again."""
        return DenseResults(
            [self.chunks[row] for row in rows],
            self.vectors[list(rows)],
            [self.truncated[row] for row in rows],
            model=self.model,
            dtype=self.dtype,
            with_meta=self.with_meta,
        )


def _chunk_fields(chunk: Chunk) -> dict[str, Any]:
    """A chunk's wire fields (all but ``v``), the unset optional ones left out."""
    fields = {
        "id": chunk.id,
        # an image chunk has no text; an empty text without one is refused as empty
        "text": (chunk.text or None) if chunk.is_image else chunk.text,
        "job": chunk.job,
        "meta": chunk.meta,
        "reply": chunk.reply,
        "deadline": chunk.deadline_ms,  # the one field named otherwise on the wire
        **{name: getattr(chunk, name) for name in OPTION_NAMES},
        "representations": list(chunk.representations) if chunk.representations else None,
        "max_active_dims": chunk.max_active_dims,
        "pair": chunk.pair,
        "multivector_dtype": chunk.multivector_dtype,
        "raw_scores": chunk.raw_scores,
        "token_states": chunk.token_states,
        "tenant": chunk.tenant,
        "reembed": True if chunk.reembed else None,
        "token_ids": chunk.token_ids,
        "tokenizer": chunk.tokenizer,
        "image": chunk.image,
        "image_ref": chunk.image_ref,
    }
    return {name: value for name, value in fields.items() if value is not None}


def encode_chunk(chunk: Chunk) -> bytes:
    message = {"v": PROTOCOL_VERSION, **_chunk_fields(chunk)}
    return msgpack.packb(message, use_bin_type=True)


# Every numeric field's upper bound (docs/PROTOCOL.md): far above any model's (a dimension,
# a vocabulary, a length), and within msgpack's 64-bit integers and a C long, so a value past
# them is refused here as the caller's error, never raised later as an OverflowError by msgpack,
# numpy or torch.
MAX_DIMENSIONS = 65_536
MAX_WINDOW_OVERLAP = 1_000_000  # tokens: no text the default limits pass holds more
MAX_ACTIVE_DIMS = 1_000_000  # a sparse vector's weights: a vocabulary's size (BGE-M3: 250,002)
MAX_DEADLINE_MS = 253_402_300_799_999  # 9999-12-31T23:59:59.999Z, unix milliseconds


def _shown(value: object) -> str:
    """``value`` for an error message, kept short: a huge integer by its size (its repr alone
    may fail past 4,300 digits), anything else cut to 60 characters."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 64:
        return f"an integer of {value.bit_length()} bits"
    shown = repr(value)
    return shown if len(shown) <= 60 else shown[:57] + "..."


def check_count(name: str, value: object, lowest: int, highest: int, meaning: str) -> None:
    """Raise ProtocolError unless ``value`` is an integer from ``lowest`` to ``highest``
    (``meaning`` says what it counts): the one check of every numeric field, so a float, NaN, a
    bool, a string or a number past the bound is refused alike, naming the range."""
    if isinstance(value, int) and not isinstance(value, bool) and lowest <= value <= highest:
        return
    raise ProtocolError(
        f"'{name}' must be an integer from {lowest} to {highest:,} ({meaning}), got {_shown(value)}"
    )


def check_embedding_options(
    *,
    prompt_name: object = None,
    prompt: object = None,
    dimensions: object = None,
    dtype: object = None,
    window_overlap: object = None,
    normalize: object = None,
) -> None:
    """Raise ProtocolError unless the optional embedding options are well-formed.

    Whether they fit the model (a prompt name it declares, a dimension it has) is the worker's
    check (and the producer's, when a worker has published its model card: ``Keys.model``).
    """
    if prompt_name is not None and (
        not isinstance(prompt_name, str)
        or not prompt_name
        or len(prompt_name) > MAX_PROMPT_NAME_CHARS
    ):
        raise ProtocolError("'prompt_name' must be a non-empty string when given")
    if prompt is not None and (not isinstance(prompt, str) or len(prompt) > MAX_PROMPT_CHARS):
        raise ProtocolError(f"'prompt' must be a string of at most {MAX_PROMPT_CHARS} characters")
    if dimensions is not None:
        check_dimensions(dimensions)
    if dtype is not None and dtype not in OUTPUT_DTYPES:
        raise ProtocolError(f"'dtype' must be one of {', '.join(OUTPUT_DTYPES)}, got {dtype!r}")
    check_window_overlap(window_overlap)
    if normalize is not None and not isinstance(normalize, bool):
        raise ProtocolError(f"'normalize' must be true or false when given, got {normalize!r}")


def check_dimensions(dimensions: object, *, whole: bool = True) -> None:
    """Raise ProtocolError unless ``dimensions`` is an integer from 1 to ``MAX_DIMENSIONS``, or
    ``FULL_DIMENSIONS`` (the model's whole vector) where ``whole`` allows it: a chunk may ask for
    it, an HTTP request may not (it leaves ``dimensions`` out). Whether it fits the model is the
    model card's check (shared/modelcard.py, ``ModelCard.check_dimensions``)."""
    meaning = "the vector's leading dimensions to keep"
    if whole:
        meaning += f"; {FULL_DIMENSIONS}: the model's whole vector"
    check_count("dimensions", dimensions, FULL_DIMENSIONS if whole else 1, MAX_DIMENSIONS, meaning)


def _unpack_bounded(payload: bytes, max_bytes: int) -> Any:
    """Unpack msgpack with every container and string bounded by the payload's own size.

    msgpack-python's ``max_*_len`` limits reject a header that claims more elements than the
    buffer could possibly hold, before anything is allocated: the memory-bomb defence.
    """
    if len(payload) > max_bytes:
        raise ProtocolError(
            f"payload is {len(payload)} bytes, over the {max_bytes}-byte limit",
            DeadReason.TOO_LARGE,
        )
    try:
        # unpackb's defaults are those bounds (each container and string at most the payload's
        # size, a map half of it; msgpack >= 1.0), text as str, string map keys; ext types are
        # refused. Spelled out as keywords they cost as much as the unpacking (issue 53); the
        # refusals are the same, word for word, over a fuzz of mutated chunks
        return msgpack.unpackb(payload, max_ext_len=0)
    except UnicodeDecodeError as error:
        raise ProtocolError(
            f"invalid UTF-8 in a string: {error.reason}", DeadReason.NOT_MSGPACK
        ) from None
    except (msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as error:
        raise ProtocolError(f"not msgpack: {error}", DeadReason.NOT_MSGPACK) from None
    except ValueError as error:  # msgpack raises ValueError for limits and truncated input
        raise ProtocolError(f"not msgpack: {error}", DeadReason.NOT_MSGPACK) from None
    except Exception as error:
        raise ProtocolError(
            f"not msgpack: {type(error).__name__}: {error}", DeadReason.NOT_MSGPACK
        ) from None


def decode_chunk(payload: bytes, limits: ChunkLimits = DEFAULT_LIMITS) -> Chunk:
    """Parse and validate one chunk from the wire; raise ProtocolError with a readable reason."""
    message = _unpack_bounded(payload, limits.max_message_bytes)
    if not isinstance(message, dict):
        raise ProtocolError(
            f"expected a msgpack map, got {type(message).__name__}", DeadReason.NOT_MSGPACK
        )
    version = message.get("v")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(f"unknown protocol version {version!r} (this worker speaks v1)")
    try:
        return chunk_from_mapping(message, limits)
    except ProtocolError as error:
        error.chunk_id, error.job, error.reply = (
            _identity(message.get(name), limits.max_id_chars) for name in ("id", "job", "reply")
        )
        tenant = message.get("tenant")
        error.tenant = (
            tenant if isinstance(tenant, str) and TENANT_PATTERN.fullmatch(tenant) else None
        )
        raise


def check_unicode(name: str, text: str) -> None:
    """ProtocolError if ``text`` holds a character no UTF-8 can carry: a lone surrogate, which
    JSON's ``"\\ud800"`` escape makes. Such a string is no text (msgpack cannot send it, no
    tokenizer reads it), so every door refuses it as the caller's error; ``name`` says where."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as error:
        at = error.start
        raise ProtocolError(
            f"'{name}' holds a lone surrogate (U+{ord(text[at]):04X}) at character {at}: it is "
            "not valid Unicode text (send the text itself, UTF-8 encoded)"
        ) from None


def _identity(value: Any, max_chars: int) -> str | None:
    """An id-like field of a refused message, when it is itself valid."""
    return value if isinstance(value, str) and 0 < len(value) <= max_chars else None


# The fields most chunks have: once they are checked, such a chunk is built by ``_plain_chunk``
# without looking up the twenty fields it does not have (a GPU host decodes tens of thousands
# of chunks a second: issue 53)
_PLAIN_FIELDS = frozenset({"v", "id", "text", "job", "token_ids", "tokenizer"})


def chunk_from_mapping(
    message: Mapping[str, Any], limits: ChunkLimits = DEFAULT_LIMITS, *, job: str | None = None
) -> Chunk:
    """The one chunk validator: a mapping (a decoded message, a JSON line, a caller's dict)
    becomes a Chunk, or ProtocolError says what is wrong. ``job`` overrides the mapping's."""
    chunk_id = message.get("id")
    if not isinstance(chunk_id, str) or not chunk_id:
        raise ProtocolError("'id' must be a non-empty string")
    if len(chunk_id) > limits.max_id_chars:
        raise ProtocolError(
            f"'id' has {len(chunk_id)} characters, over the {limits.max_id_chars} limit",
            DeadReason.TOO_LARGE,
        )
    text = message.get("text")
    if isinstance(text, str):
        if not text:
            # only the empty string: whitespace is text, embedded as sentence-transformers and
            # TEI embed it (to the special tokens alone)
            raise ProtocolError("'text' is empty")
        if len(text) > limits.max_text_chars:
            raise ProtocolError(
                f"'text' has {len(text)} characters, over the {limits.max_text_chars} limit",
                DeadReason.TOO_LARGE,
            )
        check_unicode("text", text)
    elif text is None and (message.get("image") is not None or message.get("image_ref")):
        text = ""  # an image chunk: its bytes or reference checked with its other fields
    else:
        raise ProtocolError(f"'text' must be a string, got {type(text).__name__}")
    job = job if job is not None else message.get("job")
    if job is not None and (not isinstance(job, str) or not job):
        raise ProtocolError("'job' must be a non-empty string when given")
    if job is not None and len(job) > limits.max_id_chars:
        raise ProtocolError(
            f"'job' has {len(job)} characters, over the {limits.max_id_chars} limit",
            DeadReason.TOO_LARGE,
        )
    if message.keys() <= _PLAIN_FIELDS:
        return _plain_chunk(chunk_id, text, job, *_token_id_fields(message))
    return _full_chunk(message, limits, chunk_id, text, job)


def _image_field(message: Mapping[str, Any], limits: ChunkLimits, text: str) -> bytes | None:
    """``image``, checked for form: bytes within ``max_image_bytes``, in place of a text.
    Whether they decode is the worker's check (workers/images.py)."""
    image = message.get("image")
    if image is None:
        return None
    if text:
        raise ProtocolError("a chunk carries 'text' or 'image', not both")
    if not isinstance(image, bytes) or not image:
        got = "empty bytes" if isinstance(image, bytes) else type(image).__name__
        raise ProtocolError(f"'image' must be msgpack bin holding an encoded image, got {got}")
    if len(image) > limits.max_image_bytes:
        raise ProtocolError(
            f"'image' is {over_image_limit(len(image), limits.max_image_bytes)}",
            DeadReason.TOO_LARGE,
        )
    return image


def over_image_limit(size: int, limit: int) -> str:
    """How an image over EMBEDFLEET_MAX_IMAGE_BYTES is refused, wherever it is met (a chunk, a
    file the producer reads, a reference the worker reads, a decoded image): after what it
    is, ``"<size> bytes, over the <limit> limit (EMBEDFLEET_MAX_IMAGE_BYTES)"``."""
    return f"{size} bytes, over the {limit} limit (EMBEDFLEET_MAX_IMAGE_BYTES)"


def _image_ref_field(message: Mapping[str, Any], text: str) -> str | None:
    """``image_ref``, checked for form: a string of at most ``MAX_IMAGE_REF_CHARS``, beside an
    ``image`` (where its bytes came from) or alone (where the worker reads them: whether it
    may is the worker's check, workers/image_sources.py)."""
    ref = message.get("image_ref")
    if ref is None:
        return None
    if not isinstance(ref, str) or not ref or len(ref) > MAX_IMAGE_REF_CHARS:
        got = f"{len(ref)} characters" if isinstance(ref, str) else type(ref).__name__
        raise ProtocolError(
            f"'image_ref' must be a non-empty string of at most {MAX_IMAGE_REF_CHARS} "
            f"characters when given, got {got}"
        )
    check_unicode("image_ref", ref)
    if text:
        raise ProtocolError("a chunk carries 'text' or an image ('image', 'image_ref'), not both")
    return ref


def _full_chunk(
    message: Mapping[str, Any], limits: ChunkLimits, chunk_id: str, text: str, job: str | None
) -> Chunk:
    """A chunk with fields beyond ``_PLAIN_FIELDS`` (its id, text and job already checked):
    its meta, reply, deadline, tenant and options checked for form."""
    meta = message.get("meta")
    if meta is not None:
        if not isinstance(meta, dict):
            raise ProtocolError(f"'meta' must be a map, got {type(meta).__name__}")
        try:
            meta_size = len(msgpack.packb(meta, use_bin_type=True))
        except (TypeError, ValueError, OverflowError) as error:
            raise ProtocolError(f"'meta' cannot be sent as msgpack: {error}") from None
        if meta_size > limits.max_meta_bytes:
            raise ProtocolError(
                f"'meta' is {meta_size} bytes, over the {limits.max_meta_bytes} limit",
                DeadReason.TOO_LARGE,
            )
    reply = message.get("reply")
    if reply is not None and (not isinstance(reply, str) or not reply):
        raise ProtocolError("'reply' must be a non-empty string when given")
    deadline = message.get("deadline")
    if deadline is not None:
        check_count("deadline", deadline, 0, MAX_DEADLINE_MS, "unix time in milliseconds")
    tenant = message.get("tenant")
    if tenant is not None and (not isinstance(tenant, str) or not TENANT_PATTERN.fullmatch(tenant)):
        raise ProtocolError(
            "'tenant' must be a name of letters, digits, '.', '_' and '-' (starting with a letter "
            f"or digit, at most 64) when given, got {tenant!r}"
        )
    options = {name: message.get(name) for name in OPTION_NAMES}
    check_embedding_options(**options)
    extra = _representation_options(message)
    reembed = message.get("reembed") or False
    if not isinstance(reembed, bool):
        raise ProtocolError(f"'reembed' must be true or false when given, got {reembed!r}")
    token_ids, tokenizer = _token_id_fields(message)
    image = _image_field(message, limits, text)
    image_ref = _image_ref_field(message, text)
    return Chunk(
        chunk_id,
        text,
        job=job,
        meta=meta,
        reply=reply,
        deadline_ms=deadline,
        tenant=tenant,
        **options,
        **extra,
        reembed=reembed,
        token_ids=token_ids,
        tokenizer=tokenizer,
        image=image,
        image_ref=image_ref,
    )


def _plain_chunk(
    chunk_id: str, text: str, job: str | None, token_ids: bytes | None, tokenizer: str | None
) -> Chunk:
    """A checked chunk of ``_PLAIN_FIELDS`` only, every other field its default. A frozen
    dataclass's __init__ sets each of its twenty-odd fields through object.__setattr__; this is
    the same instance with the fields it has set (4.7 -> 0.3 µs a chunk): the others read
    as their defaults, which a dataclass keeps on the class (shared/records.py checks it at
    import), and equality, hashing, ``replace`` and pickling read fields by name."""
    chunk = object.__new__(Chunk)
    fields = chunk.__dict__  # one store a field: fewer calls than update(**fields)
    fields["id"] = chunk_id
    fields["text"] = text
    fields["plain"] = True  # no option is among _PLAIN_FIELDS: Chunk.plain, known
    if job is not None:
        fields["job"] = job
    if token_ids is not None:
        fields["token_ids"] = token_ids
        fields["tokenizer"] = tokenizer
    return chunk


def _token_id_fields(message: Mapping[str, Any]) -> tuple[bytes | None, str | None]:
    """``token_ids`` and ``tokenizer``, checked for form: both or neither, the ids as
    little-endian uint32 bytes. Whether they are the model's tokenizer's is the worker's check
    (its fingerprint, dead-letter reason ``tokenizer``)."""
    token_ids, tokenizer = message.get("token_ids"), message.get("tokenizer")
    if token_ids is None and tokenizer is None:
        return None, None
    if token_ids is None or tokenizer is None:
        raise ProtocolError(
            "'token_ids' and 'tokenizer' go together: the ids and the fingerprint of the "
            "tokenizer that made them (the model card's tokenizer_fingerprint)"
        )
    if (
        not isinstance(token_ids, bytes)
        or not token_ids
        or len(token_ids) % TOKEN_ID_BYTES
        or len(token_ids) > MAX_TOKEN_IDS * TOKEN_ID_BYTES
    ):
        got = (
            f"{len(token_ids)} bytes" if isinstance(token_ids, bytes) else type(token_ids).__name__
        )
        raise ProtocolError(
            f"'token_ids' must be msgpack bin holding 1 to {MAX_TOKEN_IDS} little-endian uint32 "
            f"ids (4 bytes each), got {got}"
        )
    if not isinstance(tokenizer, str) or not tokenizer or len(tokenizer) > MAX_TOKENIZER_CHARS:
        raise ProtocolError(
            f"'tokenizer' must be a tokenizer fingerprint (a string of 1 to "
            f"{MAX_TOKENIZER_CHARS} characters), got {tokenizer!r}"
        )
    return token_ids, tokenizer


def check_window_overlap(overlap: object) -> None:
    """Raise ProtocolError unless ``window_overlap`` is absent or an integer from 0 to
    ``MAX_WINDOW_OVERLAP`` (the tokens a long input's neighbouring windows share). Whether it
    fits the model's length is the worker's check (workers/model/tokenizer.py,
    ``split_windows``)."""
    if overlap is not None:
        check_count(
            LONG_INPUT_OPTION,
            overlap,
            0,
            MAX_WINDOW_OVERLAP,
            "tokens neighbouring windows share, less than the model's maximum",
        )


def _representation_options(message: Mapping[str, Any]) -> dict[str, Any]:
    """``representations``, ``max_active_dims``, ``pair``, ``multivector_dtype``,
    ``raw_scores`` and ``token_states``, checked for form (whether the
    model serves them is the worker's check, and the gateway's from the model card)."""
    wanted = message.get("representations")
    if wanted is not None:
        if (
            not isinstance(wanted, list | tuple)
            or not wanted
            or any(name not in REPRESENTATIONS for name in wanted)
            or len(set(wanted)) != len(wanted)
        ):
            raise ProtocolError(
                f"'representations' must be a non-empty list of distinct names from "
                f"{', '.join(REPRESENTATIONS)}, got {wanted!r}"
            )
        wanted = tuple(wanted)
    top = message.get("max_active_dims")
    if top is not None:
        check_count("max_active_dims", top, 1, MAX_ACTIVE_DIMS, "sparse weights to keep")
    pair = message.get("pair")
    if pair is not None and (
        not isinstance(pair, str) or not pair.strip() or len(pair) > MAX_PAIR_CHARS
    ):
        raise ProtocolError(
            f"'pair' must be a non-empty string of at most {MAX_PAIR_CHARS} characters"
        )
    if pair is not None:
        check_unicode("pair", pair)
    multivector_dtype = message.get("multivector_dtype")
    if multivector_dtype is not None and multivector_dtype not in MULTIVECTOR_DTYPES:
        raise ProtocolError(
            f"'multivector_dtype' must be one of {', '.join(MULTIVECTOR_DTYPES)}, "
            f"got {multivector_dtype!r}"
        )
    raw_scores = message.get("raw_scores")
    if raw_scores is not None and not isinstance(raw_scores, bool):
        raise ProtocolError(f"'raw_scores' must be true or false when given, got {raw_scores!r}")
    token_states = message.get("token_states")
    if token_states is not None and not isinstance(token_states, bool):
        raise ProtocolError(
            f"'token_states' must be true or false when given, got {token_states!r}"
        )
    return {
        "representations": wanted,
        "max_active_dims": top,
        "pair": pair,
        "multivector_dtype": multivector_dtype,
        "raw_scores": raw_scores,
        "token_states": token_states,
    }


def validate_chunk(chunk: Chunk, limits: ChunkLimits = DEFAULT_LIMITS) -> Chunk:
    """A Chunk built in code passes the same checks as one read from the wire."""
    return chunk_from_mapping(_chunk_fields(chunk), limits)


def encode_result(result: Result) -> bytes:
    vector = np.asarray(result.vector, dtype=STORAGE_DTYPES[result.dtype])
    message: dict[str, Any] = {
        "v": PROTOCOL_VERSION,
        "id": result.id,
        "job": result.job,
        "model": result.model,
        "dim": result.dim,
        "dtype": result.dtype,
        "vec": vector.tobytes(),
        "truncated": result.truncated,
    }
    if result.meta is not None:
        message["meta"] = result.meta
    if result.sparse is not None:
        message["sparse"] = {
            "indices": np.asarray(result.sparse.indices, dtype="<u4").tobytes(),
            "values": np.asarray(result.sparse.values, dtype="<f4").tobytes(),
            "dim": result.sparse.dim,
        }
    if result.score is not None:
        message["score"] = float(result.score)
    if result.multivector is not None:
        multi = result.multivector
        fields: dict[str, Any] = {
            "dtype": multi.dtype,
            "dim": multi.dim,
            "count": multi.count,
            "data": np.asarray(multi.values, dtype=MULTIVECTOR_STORAGE[multi.dtype]).tobytes(),
        }
        if multi.scales is not None:
            fields["scales"] = np.asarray(multi.scales, dtype="<f4").tobytes()
        message["multivector"] = fields
    return msgpack.packb(message, use_bin_type=True)


_PACKED_V = msgpack.packb("v") + msgpack.packb(PROTOCOL_VERSION)
_PACKED_ID, _PACKED_JOB, _PACKED_VEC, _PACKED_META = (
    msgpack.packb(name) for name in ("id", "job", "vec", "meta")
)
_PACKED_TRUNCATED = {
    flag: msgpack.packb("truncated") + msgpack.packb(flag) for flag in (False, True)
}
# a result's map header (8 fields, 9 with meta), its version and its id's key
_HEAD_8, _HEAD_9 = (header + _PACKED_V + _PACKED_ID for header in (b"\x88", b"\x89"))
_ID_OF, _JOB_OF, _META_OF = (operator.attrgetter(name) for name in ("id", "job", "meta"))


def encode_results(results: Sequence[Result]) -> list[bytes]:
    """``[encode_result(r) for r in results]``, byte for byte, at about half the cost per
    result (issue 29, docs/BENCHMARKS.md): the map's keys and the fields a batch shares (model,
    dim, dtype) are packed once, not per result, and no dict is built per result. The fields
    keep encode_result's order, so the bytes are the same. A batch's :class:`DenseResults`
    is packed from its columns (:func:`_encode_columns`), with no Result made."""
    if isinstance(results, DenseResults):
        return _encode_columns(results)
    packer = msgpack.Packer(use_bin_type=True)
    shared: dict[tuple[str, int, str], bytes] = {}
    payloads: list[bytes] = []
    for result in results:
        if result.sparse is not None or result.score is not None or result.multivector is not None:
            # the representations beyond a dense vector take encode_result's own path, so the
            # field list has one owner and a field added there is never dropped here
            payloads.append(encode_result(result))
            continue
        dim = result.dim
        key = (result.model, dim, result.dtype)
        middle = shared.get(key)
        if middle is None:
            middle = shared[key] = b"".join(
                packer.pack(value) for value in ("model", key[0], "dim", dim, "dtype", key[2])
            )
        vector = np.asarray(result.vector, dtype=STORAGE_DTYPES[result.dtype])
        parts = [
            b"\x88" if result.meta is None else b"\x89",  # fixmap of 8 (9 with meta) fields
            _PACKED_V,
            _PACKED_ID,
            packer.pack(result.id),
            _PACKED_JOB,
            packer.pack(result.job),
            middle,
            _PACKED_VEC,
            packer.pack(vector.tobytes()),
            _PACKED_TRUNCATED[bool(result.truncated)],
        ]
        if result.meta is not None:
            parts += [_PACKED_META, packer.pack(result.meta)]
        payloads.append(b"".join(parts))
    return payloads


def _encode_columns(results: DenseResults) -> list[bytes]:
    """``encode_result`` of each row of ``results``, byte for byte, from the columns: every
    payload is the same head, its id, a piece shared by the rows of its job (job, model, dim,
    dtype and the vector's header, packed once per job), the row's run of the one vector
    matrix's bytes and its truncated flag (and its meta, where it has one). Joined per row by
    map and zip over the columns: no Result, dict or array, and no Python loop body, per row."""
    chunks = results.chunks
    if not chunks:
        return []
    pack = msgpack.Packer(use_bin_type=True).pack
    matrix = np.ascontiguousarray(results.vectors)  # already in STORAGE_DTYPES[dtype]
    width = matrix.shape[1] * matrix.itemsize
    after_job = b"".join(
        pack(value)
        for value in ("model", results.model, "dim", matrix.shape[1], "dtype", results.dtype)
    )
    # the vector's bin header, as msgpack writes it for a bin of ``width`` bytes
    packed_vector = pack(bytes(width))
    after_job += _PACKED_VEC + packed_vector[: len(packed_vector) - width]
    jobs = list(map(_JOB_OF, chunks))
    pieces = {job: _PACKED_JOB + pack(job) + after_job for job in set(jobs)}
    blob = matrix.tobytes()
    columns: list[Iterable[bytes]] = [
        itertools.repeat(_HEAD_8),
        map(pack, map(_ID_OF, chunks)),
        map(pieces.__getitem__, jobs),
        [blob[start : start + width] for start in range(0, len(blob), width)]
        if width
        else itertools.repeat(b""),  # (vectors of no values)
        map(_PACKED_TRUNCATED.__getitem__, results.truncated),
    ]
    metas = list(map(_META_OF, chunks)) if results.with_meta else []
    if metas.count(None) < len(metas):  # some rows carry meta: a map of 9 fields for them
        columns[0] = [_HEAD_8 if meta is None else _HEAD_9 for meta in metas]
        columns.append([b"" if meta is None else _PACKED_META + pack(meta) for meta in metas])
    # (not strict: the repeated columns run on; DenseResults checked the others' lengths)
    return list(map(b"".join, zip(*columns, strict=False)))


class QueryFailedError(RuntimeError):
    """The worker could not embed a query (the reason comes from the worker)."""

    def __init__(self, chunk_id: object, reason: object) -> None:
        super().__init__(f"query {chunk_id!r}: {reason}")
        self.chunk_id = chunk_id
        self.reason = reason

    def __reduce__(self) -> tuple[type[QueryFailedError], tuple[object, object]]:
        # args holds the message only; pickling (a process pool, a task queue) rebuilds from both
        return type(self), (self.chunk_id, self.reason)


def encode_query_error(chunk_id: str, reason: str) -> bytes:
    """What a worker pushes to a reply key instead of a result when a query cannot be embedded."""
    return msgpack.packb({"v": PROTOCOL_VERSION, "id": chunk_id, "error": reason})


def decode_result(payload: bytes) -> Result:
    """Parse a result; a query error reply raises QueryFailedError with the worker's reason."""
    message = _unpack_bounded(payload, max(len(payload), 1))
    if not isinstance(message, dict) or message.get("v") != PROTOCOL_VERSION:
        raise ProtocolError("not a v1 result")
    if "error" in message:
        raise QueryFailedError(message.get("id"), message["error"])
    dtype = message.get("dtype", DEFAULT_DTYPE)  # results written before dtype existed: fp16
    if dtype not in STORAGE_DTYPES:
        raise ProtocolError(f"unknown result dtype {dtype!r}")
    vector = np.frombuffer(message["vec"], dtype=STORAGE_DTYPES[dtype])
    dim = message["dim"]
    if vector.shape[0] != stored_length(dtype, dim):
        raise ProtocolError(
            f"vector has {vector.shape[0]} values, 'dim' {dim} in {dtype} needs "
            f"{stored_length(dtype, dim)}"
        )
    sparse = None
    if isinstance(message.get("sparse"), dict):
        fields = message["sparse"]
        indices = np.frombuffer(fields["indices"], dtype="<u4")
        values = np.frombuffer(fields["values"], dtype="<f4")
        if indices.shape != values.shape:
            raise ProtocolError("sparse 'indices' and 'values' differ in length")
        sparse = SparseVector(indices=indices, values=values, dim=int(fields["dim"]))
    score = message.get("score")
    return Result(
        id=message["id"],
        job=message.get("job"),
        model=message["model"],
        vector=vector,
        truncated=bool(message.get("truncated", False)),
        meta=message.get("meta"),
        dtype=dtype,
        dimension=dim,
        sparse=sparse,
        score=float(score) if score is not None else None,
        multivector=_multivector(message.get("multivector")),
    )


def _multivector(fields: Any) -> MultiVector | None:
    """A result's ``multivector`` field, checked: ``count`` x ``dim`` values in ``data``."""
    if not isinstance(fields, dict):
        return None
    dtype = fields.get("dtype", "float16")
    if dtype not in MULTIVECTOR_DTYPES:
        raise ProtocolError(f"unknown multivector dtype {dtype!r}")
    count, dim = int(fields["count"]), int(fields["dim"])
    values = np.frombuffer(fields["data"], dtype=MULTIVECTOR_STORAGE[dtype])
    if values.shape[0] != count * dim:
        raise ProtocolError(
            f"multivector 'data' has {values.shape[0]} values, {count} x {dim} expected"
        )
    scales = None
    if dtype == "int8":
        scales = np.frombuffer(fields.get("scales", b""), dtype="<f4")
        if scales.shape[0] != count:
            raise ProtocolError("multivector 'scales' must hold one float32 per vector")
    return MultiVector(values=values.reshape(count, dim), dtype=dtype, scales=scales)
