"""The CUDA query path (workers/model/cuda_queries.py): its shape logic and its wiring, on a CPU.

The CUDA code itself (stream, graphs) runs only on a GPU (the device check's latency step
reports which path served); everything that decides is checked here.
"""

from __future__ import annotations

import numpy as np
import pytest
import redis.asyncio as aioredis
import torch

from embedfleet.producer import Producer
from embedfleet.shared.settings import Settings
from embedfleet.workers.model.cuda_queries import (
    BATCH_BUCKETS,
    CudaQueryRunner,
    Shape,
    bucket_for,
    choose_path,
    graph_shapes,
    graph_wins,
    length_buckets,
    pad_to_shape,
    shape_for,
)
from embedfleet.workers.model.encoder import EncodeBatch
from embedfleet.workers.model.precision import FP32, cosines
from tests.conftest import ThreadsOf, WorkerLauncher


def test_bucket_is_the_smallest_that_holds_the_value() -> None:
    assert [bucket_for(n, BATCH_BUCKETS) for n in (1, 2, 3, 8, 9, 16)] == [1, 2, 4, 8, 16, 16]
    assert bucket_for(17, BATCH_BUCKETS) is None


def test_length_buckets_end_at_the_model_maximum() -> None:
    assert length_buckets(256) == (16, 32, 64, 128, 256)
    assert length_buckets(384) == (16, 32, 64, 128, 256, 384), "the longest query fits a graph"
    assert length_buckets(8192) == (16, 32, 64, 128, 256, 512), "capped at the largest bucket"
    assert length_buckets(100) == (16, 32, 64, 100)


def test_graph_shapes_are_every_bucket_largest_first() -> None:
    shapes = graph_shapes(256)
    assert len(shapes) == len(BATCH_BUCKETS) * 5
    assert shapes[0] == Shape(16, 256) and shapes[-1] == Shape(1, 16)


def test_path_is_the_smallest_captured_graph_else_the_stream() -> None:
    every = graph_shapes(512)
    assert choose_path(1, 9, every, pad_left=False) == ("graph", Shape(1, 16))
    assert choose_path(3, 40, every, pad_left=False) == ("graph", Shape(4, 64))
    assert choose_path(16, 512, every, pad_left=False) == ("graph", Shape(16, 512))
    assert choose_path(17, 10, every, pad_left=False) == ("stream", None), "too many rows"
    assert choose_path(1, 513, every, pad_left=False) == ("stream", None), "too long"
    assert choose_path(1, 9, every, pad_left=True) == ("stream", None), "left padding: no graph"
    assert choose_path(1, 9, [], pad_left=False) == ("stream", None), "none captured"
    # only the graphs that were kept count: a bigger one serves, the smallest area first
    kept = [Shape(8, 16), Shape(2, 64), Shape(16, 512)]
    assert shape_for(1, 9, kept) == Shape(8, 16)
    assert shape_for(2, 20, kept) == Shape(2, 64)
    assert shape_for(4, 20, kept) == Shape(16, 512)


def test_padding_to_a_bucket() -> None:
    ids = torch.tensor([[101, 7, 102], [101, 102, 0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 0]])
    padded_ids, padded_mask = pad_to_shape(ids, mask, Shape(4, 5), pad_id=0)
    assert padded_ids.tolist() == [
        [101, 7, 102, 0, 0],
        [101, 102, 0, 0, 0],
        [0, 0, 0, 0, 0],
        [0, 0, 0, 0, 0],
    ]
    # padding columns masked out; padding rows keep one token so no row is all masked
    assert padded_mask.tolist() == [
        [1, 1, 1, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 0, 0, 0, 0],
        [1, 0, 0, 0, 0],
    ]
    assert padded_ids.dtype == ids.dtype and padded_mask.dtype == mask.dtype
    with pytest.raises(ValueError, match="does not fit"):
        pad_to_shape(ids, mask, Shape(1, 5), pad_id=0)
    with pytest.raises(ValueError, match="does not fit"):
        pad_to_shape(ids, mask, Shape(4, 2), pad_id=0)


def test_a_query_padded_to_its_bucket_embeds_as_it_is(encoder) -> None:
    """What a graph replay computes (the batch grown to its bucket, vectors of the real rows)
    matches the query's own batch: the padding logic, run through the model on a CPU."""
    texts = ["how do I open a file?", "a second, somewhat longer question about files"]
    batch = encoder.collate(encoder.tokenize(texts))
    rows, longest = batch.input_ids.shape
    _, shape = choose_path(rows, longest, graph_shapes(encoder.max_length), pad_left=False)
    assert shape == Shape(2, 16)
    wide = Shape(8, 64)  # a bigger bucket too: more padding rows and columns
    for bucket in (shape, wide):
        ids, mask = pad_to_shape(batch.input_ids, batch.attention_mask, bucket, encoder.pad_id)
        padded = encoder.embed(EncodeBatch(input_ids=ids, attention_mask=mask))
        assert np.isfinite(padded).all(), "padding rows must not produce NaN"
        assert cosines(encoder.embed(batch), padded[:rows]).min() > 0.99999


def test_graph_kept_only_where_it_wins() -> None:
    assert graph_wins([0.001, 0.001, 0.009], [0.002, 0.002, 0.002])
    assert not graph_wins([0.003, 0.003, 0.001], [0.002, 0.002, 0.002])


def test_cpu_never_builds_the_cuda_lane(encoder) -> None:
    assert encoder.device.type == "cpu"
    assert encoder.prepare_cuda_queries("graph") is False
    assert not encoder.serves_queries_concurrently
    vectors, path = encoder.serve_query(encoder.collate(encoder.tokenize(["a query"])))
    assert path == ("frozen" if encoder.has_query_graph else "eager")
    assert vectors.shape == (1, encoder.dim)
    with pytest.raises(ValueError, match="CUDA device"):
        CudaQueryRunner(
            torch.nn.Linear(1, 1),
            lambda *_: np.zeros(0),
            FP32,
            torch.device("cpu"),
            pad_id=0,
            pad_left=False,
            max_length=16,
        )


async def test_a_concurrent_lane_serves_from_its_own_thread_without_hooks(
    workers: WorkerLauncher,
    settings: Settings,
    client: aioredis.Redis,
    encoder,
    monkeypatch: pytest.MonkeyPatch,
    threads_of: ThreadsOf,
) -> None:
    """The wiring of the CUDA query path, with a CPU standing in for it: when the encoder says
    its query path is ready, no layer hook is installed and queries are served on the CUDA
    query thread, not the model thread."""
    monkeypatch.setattr(encoder, "prepare_cuda_queries", lambda mode: mode != "off")
    callbacks: list[object] = []
    set_callback = encoder.set_layer_callback
    monkeypatch.setattr(
        encoder, "set_layer_callback", lambda cb: callbacks.append(cb) or set_callback(cb)
    )
    serving_threads = threads_of(encoder, "serve_query")
    async with Producer(settings, client) as producer, workers.run(settings):
        vector = await producer.embed_query("how do I open a file?", timeout=30)
    assert float(vector @ encoder.embed_texts(["how do I open a file?"])[0]) > 0.999
    assert serving_threads and all(name.startswith("queries") for name in serving_threads)
    assert all(callback is None for callback in callbacks), "no layer hook on the CUDA query path"

    serving_threads.clear()
    off = settings.model_copy(update={"cuda_query_lane": "off"})
    async with Producer(off, client) as producer, workers.run(off):
        await producer.embed_query("and with the lane off?", timeout=30)
    assert serving_threads and all(name.startswith("model") for name in serving_threads)
    assert any(callback is not None for callback in callbacks), "off: the CPU design, hooks"
