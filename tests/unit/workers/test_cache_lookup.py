"""workers/cache_lookup.py, the pure parts: which stored vectors a chunk may take, the counts
per job, and the results made from the hits (the round trips: tests/end_to_end/test_reingest.py
and the vector cache's own tests)."""

from __future__ import annotations

import numpy as np

from embedfleet.shared.protocol import Chunk, Result
from embedfleet.shared.vector_cache import CacheCounts, CachedVector
from embedfleet.sinks import Delivery
from embedfleet.workers.cache_lookup import answered, counts_per_job, usable_hits
from embedfleet.workers.decode import Accepted


def stored(tokens: int, *, truncated: bool = False) -> CachedVector:
    vector = np.ones(4, dtype=np.float16)
    return CachedVector(Result(id="", model="m", vector=vector, truncated=truncated), tokens)


def test_a_vector_of_a_cut_text_is_taken_only_where_cutting_is_allowed() -> None:
    whole, cut = stored(5), stored(9, truncated=True)
    found = [whole, None, cut]
    assert usable_hits([0, 3, 7], found, truncate=True) == {0: whole, 7: cut}
    assert usable_hits([0, 3, 7], found, truncate=False) == {0: whole}


def test_each_job_counts_its_hits_misses_and_the_tokens_its_hits_saved() -> None:
    chunks = [Chunk(id=str(i), text="t", job=job) for i, job in enumerate(["a", "a", "b", None])]
    hits = {0: stored(5), 2: stored(7)}
    assert counts_per_job(chunks, [0, 1, 2, 3], hits) == {
        "a": CacheCounts(hits=1, misses=1, tokens_saved=5),
        "b": CacheCounts(hits=1, misses=0, tokens_saved=7),
        None: CacheCounts(hits=0, misses=1, tokens_saved=0),
    }


def test_a_hit_answers_with_its_chunks_own_id_job_meta_and_text() -> None:
    chunk = Chunk(id="doc-1", text="hello", job="j", meta={"k": 1})
    item = Accepted(chunk, Delivery("ingest", "1-0", "j"))
    [(got_chunk, delivery, result)] = answered([item], {0: stored(3)})
    assert got_chunk is chunk and delivery is item.delivery
    assert (result.id, result.job, result.meta, result.text) == ("doc-1", "j", {"k": 1}, "hello")
