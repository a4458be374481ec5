"""Wire protocol v1: round trips and the decoder's answers to bad payloads (pure, no Redis)."""

from __future__ import annotations

import dataclasses

import msgpack
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from embedfleet.shared.dead_letters import (
    PAYLOAD_PREFIX_BYTES,
    DeadLetter,
    DeadReason,
    dead_letter_fields,
)
from embedfleet.shared.protocol import (
    MAX_ACTIVE_DIMS,
    MAX_DEADLINE_MS,
    MAX_DIMENSIONS,
    MAX_WINDOW_OVERLAP,
    Chunk,
    ChunkLimits,
    MultiVector,
    ProtocolError,
    QueryFailedError,
    Result,
    SparseVector,
    chunk_from_mapping,
    decode_chunk,
    decode_result,
    encode_chunk,
    encode_query_error,
    encode_result,
    encode_results,
    validate_chunk,
)

int64 = st.integers(min_value=-(2**63), max_value=2**64 - 1)
texts = st.text(min_size=1).filter(lambda t: t.strip())
ids = st.text(min_size=1, max_size=64)
metas = st.none() | st.dictionaries(st.text(max_size=8), int64 | st.text(max_size=8), max_size=4)


@given(chunk_id=ids, text=texts, job=st.none() | ids, meta=metas)
def test_chunk_round_trip(chunk_id: str, text: str, job: str | None, meta: dict | None) -> None:
    chunk = Chunk(id=chunk_id, text=text, job=job, meta=meta)
    assert decode_chunk(encode_chunk(chunk)) == chunk


@given(payload=st.binary(max_size=512))
@settings(max_examples=500)
def test_decoder_never_raises_anything_but_protocol_error(payload: bytes) -> None:
    try:
        chunk = decode_chunk(payload)
    except ProtocolError as error:
        assert str(error)  # a reason a person can read
    else:
        assert chunk.id and chunk.text.strip()


@given(
    value=st.recursive(
        st.none() | st.booleans() | int64 | st.floats() | st.text() | st.binary(),
        lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
        max_leaves=20,
    )
)
def test_decoder_rejects_wrong_shapes_cleanly(value: object) -> None:
    payload = msgpack.packb(value, use_bin_type=True)
    with pytest.raises(ProtocolError):
        decode_chunk(payload)


def test_result_round_trip_is_little_endian_fp16() -> None:
    vector = np.linspace(-1, 1, 384).astype(np.float16)
    payload = encode_result(Result(id="a", job="j", model="m", vector=vector, truncated=True))
    message = msgpack.unpackb(payload)
    assert message["dim"] == 384 and len(message["vec"]) == 768
    assert np.array_equal(np.frombuffer(message["vec"], dtype="<f2"), vector)
    decoded = decode_result(payload)
    assert decoded.truncated and decoded.job == "j" and np.array_equal(decoded.vector, vector)


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (b"\xc1garbage", "not msgpack"),
        (msgpack.packb([1, 2, 3]), "expected a msgpack map"),
        (msgpack.packb({"v": 2, "id": "a", "text": "x"}), "unknown protocol version"),
        (msgpack.packb({"v": 1, "text": "x"}), "'id'"),
        (msgpack.packb({"v": 1, "id": 7, "text": "x"}), "'id'"),
        (msgpack.packb({"v": 1, "id": "a"}), "'text'"),
        (msgpack.packb({"v": 1, "id": "a", "text": ""}), "'text' is empty"),
        (msgpack.packb({"v": 1, "id": "a", "text": b"bytes"}), "'text' must be a string"),
        (b"\x83\xa1v\x01\xa2id\xa1a\xa4text\xa2\xff\xfe", "invalid UTF-8"),
        (b"\xdb\xff\xff\xff\xffabc", "not msgpack"),  # str32 claiming 4 GiB
        (b"\xdd\xff\xff\xff\xff", "not msgpack"),  # array32 claiming 4 billion items
        (msgpack.packb({"v": 1, "id": "a", "text": "x", "meta": [1]}), "'meta' must be a map"),
        (msgpack.packb({"v": 1, "id": "a", "text": "x", "meta": {"k": "v" * 20000}}), "'meta' is"),
    ],
)
def test_bad_payloads_get_readable_reasons(payload: bytes, reason: str) -> None:
    with pytest.raises(ProtocolError, match=reason):
        decode_chunk(payload)


def test_size_limits() -> None:
    big = encode_chunk(Chunk(id="a", text="x" * 5000))
    with pytest.raises(ProtocolError, match="over the 1024-byte limit"):
        decode_chunk(big, ChunkLimits(max_message_bytes=1024))
    with pytest.raises(ProtocolError, match="over the 100 limit"):
        decode_chunk(big, ChunkLimits(max_text_chars=100))


def test_dead_letter_keeps_the_whole_payload_under_the_limit_and_a_prefix_over_it() -> None:
    def fields_for(payload: bytes) -> dict:
        return dead_letter_fields(
            reason=DeadReason.INVALID,
            detail="why",
            stream="s",
            entry_id="1-0",
            payload=payload,
            max_payload_bytes=1024,
        )

    small = encode_chunk(Chunk(id="a", text="short"))
    fields = fields_for(small)
    assert fields["payload"] == small and "payload_prefix" not in fields
    assert DeadLetter.from_fields("9-0", as_redis_reply(fields)).payload == small
    big = b"x" * 100_000
    fields = fields_for(big)
    assert "payload" not in fields and len(fields["payload_prefix"]) == PAYLOAD_PREFIX_BYTES
    assert fields["payload_bytes"] == "100000"
    letter = DeadLetter.from_fields("9-0", as_redis_reply(fields))
    assert not letter.replayable and letter.payload_bytes == 100_000


def test_a_dead_letter_without_a_known_code_reads_as_other_and_keeps_its_text() -> None:
    letter = DeadLetter.from_fields("9-0", {b"reason": b"added by hand: boom"})
    assert letter.reason is DeadReason.OTHER and letter.detail == "added by hand: boom"
    coded = DeadLetter.from_fields("9-1", {b"reason": b"invalid", b"detail": b"no id"})
    assert coded.reason is DeadReason.INVALID and coded.detail == "no id"


def as_redis_reply(fields: dict[str, str | bytes]) -> dict[bytes, bytes]:
    return {k.encode(): v if isinstance(v, bytes) else v.encode() for k, v in fields.items()}


@pytest.mark.parametrize(
    ("mapping", "code", "words"),
    [
        ({"id": "a", "text": ""}, DeadReason.INVALID, "empty"),
        ({"id": "", "text": "x"}, DeadReason.INVALID, "non-empty"),
        ({"id": "a" * 513, "text": "x"}, DeadReason.TOO_LARGE, "over the 512 limit"),
        ({"id": "a", "text": "x", "job": "j" * 513}, DeadReason.TOO_LARGE, "over the 512"),
        ({"id": "a", "text": "x", "meta": [1]}, DeadReason.INVALID, "'meta' must be a map"),
        ({"id": "a", "text": "x", "meta": {"k": object()}}, DeadReason.INVALID, "msgpack"),
    ],
)
def test_one_validator_with_codes(mapping: dict, code: DeadReason, words: str) -> None:
    with pytest.raises(ProtocolError, match=words) as caught:
        chunk_from_mapping(mapping)
    assert caught.value.code is code


# --- embedding options and result dtypes (issue 15) -------------------------------------------
def test_chunk_options_round_trip() -> None:
    chunk = Chunk(
        id="a", text="t", prompt_name="query", prompt="q: ", dimensions=64, dtype="ubinary"
    )
    assert decode_chunk(encode_chunk(chunk)) == chunk
    plain = msgpack.unpackb(encode_chunk(Chunk(id="a", text="t")))
    assert set(plain) == {"v", "id", "text"}  # a chunk without options is the v1 chunk of old


@pytest.mark.parametrize(
    ("chunk", "plain"),
    [
        (Chunk(id="a", text="t", job="j"), True),
        (Chunk(id="a", text="t", meta={"k": 1}, tenant="acme"), True),
        (Chunk(id="a", text="t", dimensions=64), False),
        (Chunk(id="a", text="t", normalize=False), False),
        (Chunk(id="a", text="t", representations=("sparse",)), False),
        (Chunk(id="a", text="t", prompt=""), False),
        (Chunk(id="a", image=b"\x89PNG"), False),
    ],
)
def test_a_chunk_is_plain_when_it_sets_no_option_built_or_decoded(
    chunk: Chunk, plain: bool
) -> None:
    """``Chunk.plain`` (the model's own output, worked out once) is the same for a chunk built
    and the same chunk decoded, by the common fields' fast path or the whole check."""
    assert chunk.plain is plain
    decoded = decode_chunk(encode_chunk(chunk))
    assert decoded == chunk and decoded.plain is plain


@pytest.mark.parametrize(
    ("field", "value", "reason"),
    [
        ("dimensions", -1, "'dimensions' must be an integer from 0 to 65,536"),
        ("dimensions", True, "'dimensions' must be an integer from 0 to 65,536"),
        ("dimensions", "64", "'dimensions' must be an integer from 0 to 65,536"),
        ("dtype", "int4", "'dtype' must be one of float16, float32, int8, uint8, binary, ubinary"),
        ("prompt_name", "", "'prompt_name' must be a non-empty string"),
        ("prompt", 5, "'prompt' must be a string"),
    ],
)
def test_bad_options_are_rejected(field: str, value: object, reason: str) -> None:
    payload = msgpack.packb({"v": 1, "id": "a", "text": "t", field: value})
    with pytest.raises(ProtocolError, match=reason):
        decode_chunk(payload)


# --- every numeric field bounded (issue 54) ----------------------------------------------------
# Each numeric field of a chunk, as the wire names it, with its range. A new numeric field of
# Chunk fails test_every_numeric_field_is_fuzzed until it is added here (and bounded).
NUMERIC_FIELDS = {
    "deadline": (0, MAX_DEADLINE_MS),
    "dimensions": (0, MAX_DIMENSIONS),
    "max_active_dims": (1, MAX_ACTIVE_DIMS),
    "window_overlap": (0, MAX_WINDOW_OVERLAP),
}
WIRE_NAMES = {"deadline_ms": "deadline"}
# what a caller, a JSON line or a request body may hold: huge (past msgpack's 64 bits, past
# 4,300 digits, where an int's repr fails), negative, fractional, NaN, infinite, strings, a bool
BAD_NUMBERS = [
    2**70,
    2**64,
    2**63,
    10**5000,
    -1,
    -(2**70),
    1.5,
    2.0,
    float("nan"),
    float("inf"),
    "5",
    "",
    "NaN",
    True,
    [1],
]


def test_every_numeric_field_is_fuzzed() -> None:
    numeric = {
        WIRE_NAMES.get(field.name, field.name)
        for field in dataclasses.fields(Chunk)
        if field.type in ("int | None", "int")
    }
    assert numeric == set(NUMERIC_FIELDS)


@pytest.mark.parametrize("field", sorted(NUMERIC_FIELDS))
@pytest.mark.parametrize("value", BAD_NUMBERS, ids=lambda value: type(value).__name__)
def test_a_bad_number_is_a_protocol_error(field: str, value: object) -> None:
    """Never an OverflowError (msgpack), a ValueError from an int's repr, or a chunk accepted
    that no worker could send on: ProtocolError, naming the field and its range."""
    lowest, highest = NUMERIC_FIELDS[field]
    expected = f"'{field}' must be an integer from {lowest} to {highest:,}"
    with pytest.raises(ProtocolError, match=expected):
        chunk_from_mapping({"id": "a", "text": "t", field: value})


@pytest.mark.parametrize("field", sorted(NUMERIC_FIELDS))
def test_each_bound_is_sent_and_one_past_it_refused(field: str) -> None:
    lowest, highest = NUMERIC_FIELDS[field]
    for edge in (lowest, highest):
        chunk = chunk_from_mapping({"id": "a", "text": "t", field: edge})
        assert decode_chunk(encode_chunk(chunk)) == chunk  # msgpack carries it
    for past in (lowest - 1, highest + 1):
        with pytest.raises(ProtocolError, match=f"from {lowest} to {highest:,}"):
            chunk_from_mapping({"id": "a", "text": "t", field: past})


@pytest.mark.parametrize("field", sorted(NUMERIC_FIELDS))
def test_a_huge_number_on_the_wire_is_dead_lettered_not_raised(field: str) -> None:
    """A producer in another language may send uint64's largest: the worker's decoder files it
    as the chunk's error (ProtocolError), keeping its id for the dead letter."""
    payload = msgpack.packb({"v": 1, "id": "a", "text": "t", field: 2**64 - 1})
    with pytest.raises(ProtocolError, match=f"'{field}'") as caught:
        decode_chunk(payload)
    assert caught.value.chunk_id == "a"


@pytest.mark.parametrize(
    ("dtype", "vector", "dim"),
    [
        ("float16", np.arange(5, dtype="<f2"), 5),
        ("float32", np.arange(5, dtype="<f4"), 5),
        ("int8", np.array([-128, 0, 127], dtype="i1"), 3),
        ("uint8", np.array([0, 128, 255], dtype="u1"), 3),
        ("binary", np.array([-128, 127], dtype="i1"), 13),  # 13 bits in 2 bytes
        ("ubinary", np.array([0, 255], dtype="u1"), 16),
    ],
)
def test_result_dtypes_round_trip(dtype: str, vector: np.ndarray, dim: int) -> None:
    result = Result(id="a", model="m", vector=vector, dtype=dtype, dimension=dim)
    decoded = decode_result(encode_result(result))
    assert (decoded.dtype, decoded.dim) == (dtype, dim)
    assert decoded.vector.dtype == vector.dtype
    assert decoded.vector.tobytes() == vector.tobytes()


def test_result_without_dtype_reads_as_float16() -> None:
    """A result written before the field existed (protocol v1 as first released)."""
    vector = np.array([0.5, -1.0], dtype="<f2")
    payload = msgpack.packb(
        {"v": 1, "id": "a", "job": None, "model": "m", "dim": 2, "vec": vector.tobytes()}
    )
    decoded = decode_result(payload)
    assert decoded.dtype == "float16" and np.array_equal(decoded.vector, vector)


def test_result_dim_must_fit_the_bytes() -> None:
    message = {"v": 1, "id": "a", "model": "m", "dim": 17, "dtype": "ubinary", "vec": b"\x00\x01"}
    with pytest.raises(ProtocolError, match="needs 3"):
        decode_result(msgpack.packb(message))


def test_a_query_error_reply_raises_with_id_and_reason_and_survives_pickling() -> None:
    import pickle

    with pytest.raises(QueryFailedError) as raised:
        decode_result(encode_query_error("req:0", "text is empty"))
    error = raised.value
    assert (error.chunk_id, error.reason) == ("req:0", "text is empty")
    copy = pickle.loads(pickle.dumps(error))
    assert (copy.chunk_id, copy.reason, str(copy)) == ("req:0", "text is empty", str(error))


def test_a_refused_chunk_still_says_whose_it_is() -> None:
    """An oversized chunk is refused, but its valid id, job and reply come with the error, so
    its dead letter counts against its job and its caller is answered."""
    payload = encode_chunk(Chunk("big", "x" * 50, job="j", reply="r"))
    with pytest.raises(ProtocolError) as refused:
        decode_chunk(payload, ChunkLimits(max_text_chars=10))
    error = refused.value
    assert (error.code, error.chunk_id, error.job, error.reply) == (
        DeadReason.TOO_LARGE,
        "big",
        "j",
        "r",
    )


# --- a batch of results packed at once (issue 29) --------------------------------------------
@settings(max_examples=60)
@given(
    rows=st.lists(
        st.tuples(
            ids,
            st.none() | ids,
            st.booleans(),
            metas,
            st.sampled_from(["float16", "float32", "int8", "ubinary"]),
        ),
        max_size=6,
    ),
    model=st.sampled_from(["m", "benchmark-standin:m"]),
)
def test_results_packed_as_a_batch_are_the_same_bytes(
    rows: list[tuple[str, str | None, bool, dict | None, str]], model: str
) -> None:
    """encode_results (the Redis sink's path) writes exactly what encode_result writes, for
    every mix of job, truncated flag, meta and dtype in one batch."""
    stored = {
        "float16": np.arange(8, dtype="<f2"),
        "float32": np.arange(8, dtype="<f4"),
        "int8": np.arange(-4, 4, dtype="i1"),
        "ubinary": np.array([3], dtype="u1"),
    }
    results = [
        Result(
            id=i,
            job=job,
            model=model,
            vector=stored[dtype],
            truncated=flag,
            meta=meta,
            dtype=dtype,
            dimension=8 if dtype == "ubinary" else None,
        )
        for i, job, flag, meta, dtype in rows
    ]
    assert encode_results(results) == [encode_result(result) for result in results]


def test_results_packed_as_a_batch_keep_sparse_vectors_and_scores() -> None:
    """The representations beyond a dense vector (a SPLADE row, a rerank score) survive the
    batch packing the Redis sink uses, beside dense rows in the same batch."""
    sparse = SparseVector(
        indices=np.array([3, 17], dtype="<u4"), values=np.array([0.5, 1.25], dtype="<f4"), dim=30
    )
    results = [
        Result(id="dense", job=None, model="m", vector=np.arange(4, dtype="<f2")),
        Result(id="sparse", job="j", model="m", vector=np.zeros(0, dtype="<f2"), sparse=sparse),
        Result(id="score", job="j", model="m", vector=np.zeros(0, dtype="<f2"), score=0.75),
    ]
    payloads = encode_results(results)
    assert payloads == [encode_result(result) for result in results]
    decoded = [decode_result(payload) for payload in payloads]
    assert decoded[1].sparse is not None and decoded[1].sparse.indices.tolist() == [3, 17]
    assert decoded[1].sparse.values.tolist() == [0.5, 1.25] and decoded[2].score == 0.75


def test_multivector_results_round_trip_in_float16_and_int8() -> None:
    """Per-token vectors on the wire: float16 values, or int8 codes with a scale per vector
    (cosine >= 0.999 to the float32 vectors); a malformed field is refused."""
    rng = np.random.default_rng(3)
    vectors = rng.normal(size=(7, 32)).astype(np.float32)
    vectors /= np.linalg.norm(vectors, axis=1, keepdims=True)
    for dtype in ("float16", "int8"):
        multi = MultiVector.of(vectors, dtype)
        back = decode_result(
            encode_result(
                Result(id="a", model="m", vector=np.zeros(0, np.float16), multivector=multi)
            )
        ).multivector
        assert back is not None and back.dtype == dtype and (back.count, back.dim) == (7, 32)
        floats = back.floats()
        cosines = np.sum(floats * vectors, axis=1) / np.linalg.norm(floats, axis=1)
        assert cosines.min() >= 0.999, dtype
    payload = msgpack.unpackb(
        encode_result(
            Result(id="a", model="m", vector=np.zeros(0), multivector=MultiVector.of(vectors))
        )
    )
    payload["multivector"]["count"] = 8
    with pytest.raises(ProtocolError, match="8 x 32 expected"):
        decode_result(msgpack.packb(payload))
    with pytest.raises(ProtocolError, match="multivector_dtype"):
        chunk_from_mapping({"id": "a", "text": "t", "multivector_dtype": "int4"})


def test_token_states_travel_as_a_bool_and_come_back_in_float32() -> None:
    """A chunk's ``token_states`` (TEI's /embed_all on a dense model) is true or false on the
    wire; the states come back in the result's ``multivector`` as float32, exactly."""
    chunk = chunk_from_mapping({"id": "a", "text": "t", "token_states": True})
    assert decode_chunk(encode_chunk(chunk)).token_states is True
    assert decode_chunk(encode_chunk(Chunk("a", "t"))).token_states is None
    for bad in ("true", 1, 0.5):
        with pytest.raises(ProtocolError, match="token_states"):
            chunk_from_mapping({"id": "a", "text": "t", "token_states": bad})
    states = np.random.default_rng(5).normal(scale=3.0, size=(6, 16)).astype(np.float32)
    result = Result(
        id="a",
        model="m",
        vector=np.zeros(16, np.float16),
        multivector=MultiVector.of(states, "float32"),
    )
    back = decode_result(encode_result(result)).multivector
    assert back is not None and back.dtype == "float32"
    np.testing.assert_array_equal(back.floats(), states)


def test_raw_scores_is_a_bool_that_travels() -> None:
    """A cross-encoder chunk's ``raw_scores`` (TEI's: the logits before the activation) is true
    or false on the wire, and comes back as sent."""
    chunk = chunk_from_mapping({"id": "a", "text": "q", "pair": "d", "raw_scores": True})
    assert chunk.raw_scores is True
    assert decode_chunk(encode_chunk(chunk)).raw_scores is True
    assert decode_chunk(encode_chunk(Chunk("a", "q"))).raw_scores is None
    for bad in ("true", 1, 0.5):
        with pytest.raises(ProtocolError, match="raw_scores"):
            chunk_from_mapping({"id": "a", "text": "q", "raw_scores": bad})


def test_a_lone_surrogate_is_no_text() -> None:
    """JSON's "\\ud800" makes a str that UTF-8 (msgpack, the tokenizer) cannot carry: refused as
    the caller's error, naming the field and the place (issue 40)."""
    for field in ("text", "pair"):
        message = {"id": "a", "text": "fine", field: "bad \ud800 text"}
        with pytest.raises(ProtocolError, match=rf"'{field}' holds a lone surrogate .* 4"):
            chunk_from_mapping(message)
    assert chunk_from_mapping({"id": "a", "text": "fine \U0001f600"}).text == "fine \U0001f600"


def test_an_image_chunk_round_trips_without_a_text() -> None:
    chunk = Chunk(id="img", image=b"\x89PNG\r\n\x1a\n-bytes", job="j")
    payload = encode_chunk(chunk)
    assert "text" not in msgpack.unpackb(payload)
    assert decode_chunk(payload) == chunk
    assert validate_chunk(chunk) == chunk
    referenced = Chunk(id="img", image=b"\x89PNG", image_ref="photos/cats/1 é.png")
    assert decode_chunk(encode_chunk(referenced)) == referenced
    # a reference alone: an image chunk the worker reads (no text on the wire, not plain)
    by_ref = Chunk(id="img", image_ref="s3://photos/cats/1.png", job="j")
    assert "text" not in msgpack.unpackb(encode_chunk(by_ref))
    assert decode_chunk(encode_chunk(by_ref)) == by_ref
    assert by_ref.is_image and not by_ref.plain and by_ref.row_text == "s3://photos/cats/1.png"
    # a database row keeps the reference in place of a text, never the bytes
    assert (referenced.row_text, chunk.row_text) == ("photos/cats/1 é.png", None)
    assert Chunk(id="t", text="a caption").row_text == "a caption"


@pytest.mark.parametrize(
    ("fields", "code", "fragment"),
    [
        ({"text": "a caption", "image": b"x"}, DeadReason.INVALID, "'text' or 'image', not both"),
        ({"image": b""}, DeadReason.INVALID, "got empty bytes"),
        ({"image": "not bytes"}, DeadReason.INVALID, "got str"),
        ({"image": b"x" * 11}, DeadReason.TOO_LARGE, "11 bytes, over the 10 limit"),
        ({"image": b"x", "image_ref": ""}, DeadReason.INVALID, "'image_ref' must be a non-empty"),
        ({"image": b"x", "image_ref": 5}, DeadReason.INVALID, "got int"),
        ({"image": b"x", "image_ref": "r" * 2049}, DeadReason.INVALID, "at most 2048"),
        ({"text": "t", "image_ref": "a.png"}, DeadReason.INVALID, r"\('image', 'image_ref'\), not"),
    ],
)
def test_an_image_is_checked_for_form(
    fields: dict[str, object], code: DeadReason, fragment: str
) -> None:
    payload = msgpack.packb({"v": 1, "id": "img", "job": "j", **fields}, use_bin_type=True)
    with pytest.raises(ProtocolError, match=fragment) as raised:
        decode_chunk(payload, ChunkLimits(max_image_bytes=10))
    assert raised.value.code is code
    assert (raised.value.chunk_id, raised.value.job) == ("img", "j")  # its job still counts it


def test_a_chunk_without_text_or_image_is_refused_as_before() -> None:
    with pytest.raises(ProtocolError, match="'text' is empty"):
        validate_chunk(Chunk(id="a", text=""))
    with pytest.raises(ProtocolError, match="'text' must be a string, got NoneType"):
        decode_chunk(msgpack.packb({"v": 1, "id": "a"}))
