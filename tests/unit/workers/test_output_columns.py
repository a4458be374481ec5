"""A batch's results as columns (issue 53): a batch of plain chunks in float16 or float32 comes
out of ``Outputs.results`` as a DenseResults, which the Redis sink packs without a Result per
row. Its payloads must be byte for byte what the per-row path (``_dense_results`` and
``encode_result``) writes, and every other batch must stay on that path."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, ClassVar

import msgpack
import numpy as np
import pytest
from hypothesis import given
from hypothesis import settings as examples
from hypothesis import strategies as st

from embedfleet.shared.keys import TENANT_STREAM_INFIX
from embedfleet.shared.modelcard import ModelCard
from embedfleet.shared.protocol import (
    Chunk,
    DenseResults,
    Result,
    encode_result,
    encode_results,
)
from embedfleet.shared.settings import Settings
from embedfleet.shared.vector_cache import pack_entries, pack_entry
from embedfleet.sinks.sink import Delivery, queue_acknowledgement_script
from embedfleet.workers.output import Outputs
from embedfleet.workers.write import picked

DIM = 12
MODEL = "benchmark-standin:m"


class TinyEncoder:
    """What Outputs reads of an encoder: a dense, normalising model of DIM dimensions."""

    name = MODEL
    dim = DIM
    representation = "dense"
    representations = ("dense",)
    prompts: ClassVar[dict[str, str]] = {}
    pooling = SimpleNamespace(normalize=True)
    card = ModelCard(name=MODEL, dim=DIM, max_length=128, normalize=True)

    def heads_for(self, wanted: Any) -> None:
        return None


class Ranges:
    """A calibration store with int8/uint8 ranges ready (``Outputs.prepare`` loads them)."""

    def cached(self, variant: str) -> SimpleNamespace:
        return SimpleNamespace(ranges=np.vstack((np.full(DIM, -1.0), np.full(DIM, 1.0))))


def outputs(**settings: Any) -> Outputs:
    return Outputs(Settings(**settings), TinyEncoder(), Ranges())  # type: ignore[arg-type]


def vectors(rows: int, seed: int = 0) -> np.ndarray:
    found = np.random.default_rng(seed).standard_normal((rows, DIM)).astype(np.float32)
    return found / np.linalg.norm(found, axis=1, keepdims=True)


def batch() -> list[Chunk]:
    """Plain chunks of every kind the columns must keep: jobs and none, meta (nested, unicode),
    a long id, a reply (the writer's other destination), an image's reference for a text."""
    return [
        Chunk("a", "x"),
        Chunk("b", "y", job="j1", meta={"k": [1, "é"], "n": None}),
        Chunk("c" * 300, "z", job="j1"),
        Chunk("d", "w", job="j2", reply="r1"),
        Chunk("é", "v", meta={}),
    ]


def reference(out: Outputs, chunks: list[Chunk], rows: np.ndarray, flags: list[bool], **kw: Any):
    """The per-row path's results (one Result per chunk), as every batch took it before."""
    return out._dense_results(chunks, rows, flags, with_meta=kw.get("with_meta", True))


def assert_same_result(ours: Result, theirs: Result) -> None:
    assert ours.__dict__.keys() == theirs.__dict__.keys()
    for name, value in theirs.__dict__.items():
        if isinstance(value, np.ndarray):
            mine = getattr(ours, name)
            assert mine.dtype == value.dtype and mine.tobytes() == value.tobytes(), name
        else:
            assert getattr(ours, name) == value, name


@pytest.mark.parametrize("dtype", ["float16", "float32"])
@pytest.mark.parametrize("with_meta", [True, False])
@pytest.mark.parametrize("dimensions", [0, 5])
def test_plain_batches_come_as_columns_with_the_reference_bytes(
    dtype: str, with_meta: bool, dimensions: int
) -> None:
    out = outputs(output_dtype=dtype, dimensions=dimensions)
    chunks = batch()
    rows, flags = vectors(len(chunks)), [False, True, False, True, False]
    results = out.results(chunks, rows, flags, with_meta=with_meta)
    assert isinstance(results, DenseResults)
    expected = reference(out, chunks, rows, flags, with_meta=with_meta)
    assert encode_results(results) == [encode_result(result) for result in expected]
    assert len(results) == len(expected)
    for ours, theirs in zip(results, expected, strict=True):
        assert_same_result(ours, theirs)
    assert_same_result(results[-1], expected[-1])
    # a slice and a pick of rows are columns again, with their rows' bytes
    assert isinstance(results[1:3], DenseResults)
    assert encode_results(results[1:3]) == [encode_result(r) for r in expected[1:3]]
    assert encode_results(results.take([4, 0])) == [encode_result(expected[r]) for r in (4, 0)]
    with pytest.raises(IndexError):
        results[len(chunks)]


def test_device_cast_rows_and_an_empty_batch() -> None:
    """Rows the device already cast to float16 (``full_float16``) pack the same; no rows, no
    payloads."""
    out = outputs()
    chunks = batch()
    rows = vectors(len(chunks)).astype(np.float16)
    results = out.results(chunks, rows, [False] * len(chunks))
    assert isinstance(results, DenseResults)
    expected = reference(out, chunks, rows, [False] * len(chunks))
    assert encode_results(results) == [encode_result(result) for result in expected]
    empty = DenseResults([], np.zeros((0, DIM), np.float16), [], model=MODEL, dtype="float16")
    assert encode_results(empty) == [] and list(empty) == []


@given(
    rows=st.lists(
        st.tuples(
            st.text(min_size=1, max_size=40),
            st.one_of(st.none(), st.sampled_from(["j1", "j2", "é"])),
            st.booleans(),
            st.one_of(
                st.none(),
                st.dictionaries(st.text(max_size=5), st.integers(-(2**40), 2**40), max_size=3),
            ),
        ),
        max_size=8,
    ),
    dtype=st.sampled_from(["float16", "float32"]),
    with_meta=st.booleans(),
)
@examples(max_examples=60, deadline=None)
def test_columns_pack_as_encode_result_for_any_mix(
    rows: list[tuple[str, str | None, bool, dict | None]], dtype: str, with_meta: bool
) -> None:
    chunks = [Chunk(id_, "t", job=job, meta=meta) for id_, job, _, meta in rows]
    matrix = vectors(len(rows), seed=len(rows)).astype(dtype)
    results = DenseResults(
        chunks,
        matrix,
        [flag for _, _, flag, _ in rows],
        model=MODEL,
        dtype=dtype,
        with_meta=with_meta,
    )
    assert encode_results(results) == [encode_result(result) for result in results]


@pytest.mark.parametrize("width", [100, 200, 40_000])  # bin 8, bin 16 and bin 32 vectors
def test_columns_pack_every_size_of_vector(width: int) -> None:
    matrix = np.random.default_rng(width).standard_normal((3, width)).astype(np.float16)
    chunks = [Chunk(f"r{row}", "t", job="j") for row in range(3)]
    results = DenseResults(chunks, matrix, [False, True, False], model=MODEL, dtype="float16")
    assert encode_results(results) == [encode_result(result) for result in results]


@pytest.mark.parametrize("dtype", ["int8", "uint8", "binary", "ubinary"])
def test_quantized_and_bit_dtypes_keep_the_per_row_path(dtype: str) -> None:
    out = outputs(output_dtype=dtype)
    chunks = batch()
    rows, flags = vectors(len(chunks)), [True] * len(chunks)
    results = out.results(chunks, rows, flags)
    assert isinstance(results, list) and not isinstance(results, DenseResults)
    expected = reference(out, chunks, rows, flags)
    assert encode_results(results) == [encode_result(result) for result in expected]


@pytest.mark.parametrize(
    "odd",
    [
        Chunk("o", "x", dtype="float32"),
        Chunk("o", "x", dimensions=4),
        Chunk("o", "x", normalize=False),
        Chunk("o", "x", dtype="float16"),  # the default, asked for: still its own options
    ],
)
def test_a_chunk_with_options_keeps_its_batch_on_the_per_row_path(odd: Chunk) -> None:
    out = outputs()
    chunks = [*batch(), odd]
    rows, flags = vectors(len(chunks), seed=1), [False] * len(chunks)
    results = out.results(chunks, rows, flags)
    assert not isinstance(results, DenseResults)
    expected = reference(out, chunks, rows, flags)
    assert encode_results(results) == [encode_result(r) for r in expected]
    # and the plain rows of it, as columns on their own, pack to the same bytes
    plain = out.results(chunks[:-1], rows[:-1], flags[:-1])
    assert isinstance(plain, DenseResults)
    assert encode_results(plain) == [encode_result(r) for r in expected[:-1]]


def test_plain_batches_answer_heads_and_device_cast_as_the_general_rule() -> None:
    """The once-per-worker answers for plain batches are what the per-chunk rule gives for a
    batch that asks for the same output with an option set."""
    for settings in ({}, {"output_dtype": "float32"}, {"dimensions": 6}):
        out = outputs(**settings)
        plain = batch()
        explicit = [*plain, Chunk("e", "x", dtype=out.spec_for(plain[0]).dtype)]
        assert out.full_float16(plain) == out.full_float16(explicit)
        assert out.heads_for(plain) is None and out.heads_for(explicit) is None


def test_columns_refuse_what_they_cannot_carry() -> None:
    chunks = [Chunk("a", "x")]
    with pytest.raises(ValueError, match="int8 vectors do not travel as columns"):
        DenseResults(chunks, np.zeros((1, 4), np.int8), [False], model=MODEL, dtype="int8")
    with pytest.raises(ValueError, match="1 chunks, 2 flags"):
        DenseResults(chunks, np.zeros((1, 4)), [False, True], model=MODEL, dtype="float32")


def test_the_writer_picks_rows_without_making_results() -> None:
    out = outputs()
    chunks = batch()
    results = out.results(chunks, vectors(len(chunks)), [False] * len(chunks))
    assert picked(results, list(range(len(chunks)))) is results
    some = picked(results, [1, 3])
    assert isinstance(some, DenseResults) and [r.id for r in some] == ["b", "d"]
    assert picked(["p", "q", "r"], [0, 2]) == ["p", "r"]


def test_cache_entries_of_columns_are_pack_entry_bytes() -> None:
    """The vector cache's entries of a batch (the writer stores them before its write), from
    the columns: what pack_entry makes of each row's Result; a list of Results as before."""
    for settings in ({}, {"output_dtype": "float32"}, {"dimensions": 5}):
        out = outputs(**settings)
        chunks = batch()
        flags = [True, False, False, True, False]
        results = out.results(chunks, vectors(len(chunks)), flags)
        assert isinstance(results, DenseResults)
        counts = [3, 61, 512, 70_000, 1]
        expected = [pack_entry(results[row], counts[row]) for row in range(len(chunks))]
        assert pack_entries(results, counts) == expected
        assert pack_entries(results.take([3, 1]), [70_000, 61]) == [expected[3], expected[1]]
        assert pack_entries(list(results), counts) == expected
    empty = DenseResults([], np.zeros((0, 4)), [], model=MODEL, dtype="float32")
    assert pack_entries(empty, []) == []


# --- the acknowledgement's argument --------------------------------------------------------
class RecordingPipe:
    def __init__(self) -> None:
        self.commands: list[tuple[Any, ...]] = []

    def execute_command(self, *args: Any) -> None:
        self.commands.append(args)


def per_entry_argument(keys: Any, deliveries: list[Delivery], replies, payloads) -> dict:
    """The entries argument as it was built before the columns: a list extended per entry."""
    by_stream: dict[str, list[Any]] = {}
    for delivery, reply, payload in zip(deliveries, replies, payloads, strict=True):
        by_stream.setdefault(delivery.stream, []).extend(
            [
                delivery.entry_id,
                delivery.job or "",
                reply,
                payload,
                delivery.tenant or keys.tenant_of(delivery.stream) or "",
                delivery.model,
                int(delivery.tokens),
                int(delivery.model_us),
            ]
        )
    return {s: msgpack.packb(v, use_bin_type=False) for s, v in by_stream.items()}


def test_the_acknowledgement_argument_is_the_per_entry_one() -> None:
    keys = Settings().keys
    tenant_stream = keys.prefix + TENANT_STREAM_INFIX + "acme"
    deliveries = [
        Delivery(keys.ingest, "1-0", None, model=MODEL, tokens=7, model_us=120),
        Delivery(tenant_stream, "1-1", "job", model=MODEL, tokens=300, model_us=70000),
        Delivery(keys.ingest, "1-2", "job", tenant="t2", model=MODEL, tokens=1, model_us=0),
        Delivery(tenant_stream, "2-0", None, tenant="own", model="", tokens=0, model_us=0),
    ]
    replies = ["", "reply-1", "", ""]
    payloads = [b"", b"\x00" * 40, b"x" * 300, bytes(range(256)) * 300]
    for picked_rows in ([0, 2], [1, 3], [0, 1, 2, 3]):
        chosen = [deliveries[r] for r in picked_rows]
        answers = [replies[r] for r in picked_rows]
        bodies = [payloads[r] for r in picked_rows]
        pipe = RecordingPipe()
        queue_acknowledgement_script(pipe, keys, chosen, "done", answers, bodies, 30)
        expected = per_entry_argument(keys, chosen, answers, bodies)
        assert {command[3]: command[-1] for command in pipe.commands} == expected
        assert [command[3] for command in pipe.commands] == list(expected)
        assert all(command[10] == "30" for command in pipe.commands)
    with pytest.raises(ValueError, match="2 deliveries, 1 replies"):
        queue_acknowledgement_script(RecordingPipe(), keys, deliveries[:2], "done", [""], [b""])
    pipe = RecordingPipe()
    queue_acknowledgement_script(pipe, keys, [], "done", [], [])
    assert pipe.commands == []
