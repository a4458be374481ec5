"""Long inputs embedded whole (issue 42), the pure logic: the token windows
(workers/model/tokenizer.py ``split_windows``), their weighted mean (workers/output.py
``pool_windows``) and the rejoining of a window's rows after the model
(workers/long_inputs.py ``Rejoin``)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from embedfleet.shared.protocol import Chunk, ProtocolError, chunk_from_mapping, validate_chunk
from embedfleet.sinks import Delivery
from embedfleet.workers.long_inputs import Rejoin, Rows, expand, token_windows
from embedfleet.workers.model.tokenizer import Tokenized, split_windows
from embedfleet.workers.output import pool_windows

CLS, SEP = 101, 102


def framed(count: int) -> list[int]:
    return [CLS, *range(1000, 1000 + count), SEP]


def test_a_text_that_fits_is_one_window() -> None:
    assert split_windows(framed(8), max_length=10, lead=1, trail=1, overlap=2) == [framed(8)]


def test_windows_cover_the_text_with_the_overlap_and_the_frame() -> None:
    ids = framed(20)
    windows = split_windows(ids, max_length=10, lead=1, trail=1, overlap=3)
    body = ids[1:-1]
    assert all(w[0] == CLS and w[-1] == SEP and len(w) <= 10 for w in windows)
    spans = [w[1:-1] for w in windows]
    assert spans[0] == body[:8] and spans[1] == body[5:13] and spans[2] == body[10:18]
    assert spans[-1][-1] == body[-1]  # the last window ends at the text's end
    for before, after in itertools.pairwise(spans):
        assert before[-3:] == after[:3]  # neighbours share the overlap
    covered = sorted({token for span in spans for token in span})
    assert covered == body


def test_a_prompt_opens_every_window() -> None:
    prompt = [CLS, 7, 8]
    ids = [*prompt, *range(1000, 1030), SEP]
    windows = split_windows(ids, max_length=12, lead=3, trail=1, overlap=0)
    assert all(w[:3] == prompt and w[-1] == SEP for w in windows)
    assert [t for w in windows for t in w[3:-1]] == list(range(1000, 1030))  # no overlap


@pytest.mark.parametrize("overlap", [-1, 8, 50])
def test_an_overlap_that_leaves_no_room_is_refused(overlap: int) -> None:
    with pytest.raises(ValueError, match="window_overlap"):
        split_windows(framed(30), max_length=10, lead=1, trail=1, overlap=overlap)


def test_pool_windows_is_the_token_weighted_mean_normalised() -> None:
    rng = np.random.default_rng(7)
    rows = rng.standard_normal((5, 6)).astype(np.float32)
    pooled = pool_windows(rows, [3, 1, 1], [256, 256, 40, 9, 12], normalize=True)
    expected = np.average(rows[:3], axis=0, weights=[256, 256, 40])
    assert pooled.shape == (3, 6) and pooled.dtype == np.float32
    assert np.allclose(pooled[0], expected / np.linalg.norm(expected), atol=1e-6)
    assert np.allclose(pooled[1], rows[3] / np.linalg.norm(rows[3]), atol=1e-6)
    raw = pool_windows(rows, [3, 2], [256, 256, 40, 9, 12], normalize=False)
    assert np.allclose(raw[0], expected, atol=1e-6)  # a model without Normalize: the mean
    with pytest.raises(ValueError):
        pool_windows(rows, [3, 3], [1] * 5, normalize=True)


def test_the_protocol_carries_the_overlap_and_checks_its_form() -> None:
    chunk = validate_chunk(Chunk("a", "text", window_overlap=16))
    assert chunk.window_overlap == 16
    assert chunk_from_mapping({"id": "a", "text": "t"}).window_overlap is None
    for bad in (-1, "16", True, 1.5):
        with pytest.raises(ProtocolError, match="window_overlap"):
            chunk_from_mapping({"id": "a", "text": "t", "window_overlap": bad})


def _tokens(length: int) -> Tokenized:
    return Tokenized(ids=list(range(length)), truncated=False)


def test_rejoin_holds_a_long_inputs_rows_across_batches_then_pools_them() -> None:
    chunks = [Chunk("short", "s"), Chunk("long", "l " * 999, window_overlap=0)]
    deliveries = [Delivery("s", "1-0", None), Delivery("s", "2-0", None)]
    rejoin = Rejoin(normalize=True)
    rows, entries, tokens = expand(
        chunks,
        deliveries,
        [_tokens(5), _tokens(10)],
        {1: [_tokens(10), _tokens(10), _tokens(4)]},
        rejoin,
    )
    assert [c.id for c in rows] == ["short", "long", "long", "long"] and rejoin.waiting == 1
    vectors = np.eye(4, dtype=np.float32)
    accounted = [
        Delivery(d.stream, d.entry_id, d.job, model="m", tokens=t.length, model_us=t.length)
        for d, t in zip(entries, tokens, strict=True)
    ]
    # the first batch: the short text and two windows; the long input waits for its third
    first = rejoin.take(Rows(rows[:3], accounted[:3], tokens[:3], vectors[:3], ["k1", "k2", "k2"]))
    assert [c.id for c in first[0]] == ["short"] and first[3].shape == (1, 4)
    assert first[4] == ["k1"]
    second = rejoin.take(Rows(rows[3:], accounted[3:], tokens[3:], vectors[3:], ["k2"]))
    (chunk,), (delivery,), (whole,), pooled, keys = second
    assert chunk.id == "long" and keys == ["k2"] and rejoin.waiting == 0
    assert delivery.entry_id == "2-0" and delivery.tokens == 24 and delivery.model_us == 24
    assert whole.length == 24 and not whole.truncated
    expected = np.array([0, 10, 10, 4], dtype=np.float32)
    assert np.allclose(pooled[0], expected / np.linalg.norm(expected))


def test_a_failed_window_drops_its_input_once() -> None:
    rejoin = Rejoin(normalize=True)
    delivery = Delivery("s", "2-0", None)
    rejoin.expect(delivery, 3)
    assert delivery in rejoin and rejoin.fail(delivery) and not rejoin.fail(delivery)
    taken = rejoin.take(
        Rows([Chunk("long", "l")], [delivery], [_tokens(3)], np.ones((1, 4), np.float32), [])
    )
    assert taken[0] == [] and taken[3].shape == (0, 4)


def test_head_normalizes_is_per_thread_and_restored() -> None:
    """The batches of a window with long inputs are computed before Normalize; the switch is
    the launching thread's alone (a query on the CUDA query thread normalises meanwhile) and
    set back after, also when nested (a query served at a layer boundary)."""
    import threading
    from types import SimpleNamespace

    import torch

    from embedfleet.workers.model.model_dir import SentenceHead, head_normalizes

    head = SentenceHead(SimpleNamespace(dense=[], normalize=True))  # type: ignore[arg-type]
    pooled = torch.tensor([[3.0, 4.0]])
    seen: list[torch.Tensor] = []
    with head_normalizes(False):
        assert torch.equal(head(pooled), pooled)
        other = threading.Thread(target=lambda: seen.append(head(pooled)))
        other.start()
        other.join()
        with head_normalizes(True):
            assert torch.allclose(head(pooled), torch.tensor([[0.6, 0.8]]))
        assert torch.equal(head(pooled), pooled)
    assert torch.allclose(seen[0], torch.tensor([[0.6, 0.8]]))
    assert torch.allclose(head(pooled), torch.tensor([[0.6, 0.8]]))


def test_token_windows_splits_the_cut_chunks_that_ask_and_refuses_a_roomless_overlap() -> None:
    asked: list[tuple[list[str], list[str] | None, int]] = []

    def windows_of(texts, prompts, overlap):  # a tokenizer's ``windows``, recorded
        asked.append((list(texts), None if prompts is None else list(prompts), overlap))
        if overlap >= 8:
            raise ValueError("window_overlap 8 leaves a window no room")
        return [[Tokenized([1, 2], False), Tokenized([3, 4], False)]]

    chunks = [
        Chunk(id="whole", text="long", window_overlap=2),
        Chunk(id="fits", text="short", window_overlap=2),
        Chunk(id="cut", text="long"),  # no overlap asked: cut as TRUNCATE says
        Chunk(id="roomless", text="long", window_overlap=8),
    ]
    deliveries = [Delivery("ingest", f"{i}-0", None) for i in range(4)]
    tokens = [Tokenized([9] * 4, truncated) for truncated in (True, False, True, True)]
    windows, refused = token_windows(windows_of, chunks, deliveries, tokens, ["q: ", "", "", ""])
    assert asked == [(["long"], ["q: "], 2), (["long"], None, 8)]
    assert list(windows) == [0] and len(windows[0]) == 2
    assert list(refused) == [3] and refused[3].chunk_id == "roomless"
    assert "no room" in refused[3].detail
