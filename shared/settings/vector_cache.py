"""Vector cache settings: re-ingestion of a text already embedded skips the model."""

from __future__ import annotations

from typing import ClassVar

from pydantic import Field

from embedfleet.shared.settings.section import Section


class VectorCacheSettings(Section):
    """The vector cache in Redis (shared/vector_cache.py): its size bound and its entries' life."""

    title: ClassVar[str] = "Re-ingestion: the vector cache"

    vector_cache_mb: int = Field(default=256, ge=0)
    """Size bound of the vector cache in Redis (MB, over all partitions), as Redis counts its
    memory: each entry's vector, its key (twice: the cache and the use order) and Redis's own
    overhead for them (strings, dict entries, skip list nodes, buckets, rounded up to the
    allocator's size classes), checked against MEMORY USAGE. Before a chunk reaches the model,
    the worker looks its content key (a digest of the text, model revision and every option
    that changes the vector) up there, and on a hit writes the row and result from the stored
    vector without running the model. The least recently used entries are evicted past the
    bound. 0 = no cache: every chunk is embedded."""
    vector_cache_ttl_s: int = Field(default=30 * 24 * 3600, ge=60)
    """A vector cache entry nobody has used for this long is dropped (at the next store into its
    partition's cache)."""
