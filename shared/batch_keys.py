"""The Batch API's Redis keys (the gateway's batches, embedfleet/gateway/batch/), a part of
``Keys`` (shared/keys.py): ``Keys`` takes them from ``BatchKeys``, so callers ask
``keys.batch(id)`` as for any other key.

Their own group because they follow their own rule: with partitions (Redis Cluster) they live
under one hash tag of their own, ``{ns}:{b}:...``, since a batch's record, the index and the
active set change together in one MULTI, which a cluster runs only within one slot. Fleet-wide:
no model lane or partition of their own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

BATCHES_TAG = "b"


class BatchKeys:
    """The Batch API's key names of a namespace (``Keys``' ``namespace`` and ``partitioned``)."""

    __slots__ = ()

    if TYPE_CHECKING:  # what ``Keys`` (a frozen dataclass) gives these builders
        namespace: str

        @property
        def partitioned(self) -> bool: ...

    @property
    def _batch_prefix(self) -> str:
        """Under the batches' own hash tag with partitions (the module docstring says why)."""
        return f"{self.namespace}:{{{BATCHES_TAG}}}" if self.partitioned else self.namespace

    def batch(self, batch_id: str) -> str:
        """Hash of one Batch API batch (the gateway's): its OpenAI fields and progress."""
        return f"{self._batch_prefix}:batch:{batch_id}"

    @property
    def batches(self) -> str:
        """Sorted set of batch ids by creation time, for ``GET /v1/batches``."""
        return f"{self._batch_prefix}:batches"

    @property
    def batches_active(self) -> str:
        """Set of batches some gateway still has to enqueue or finalize."""
        return f"{self._batch_prefix}:batches:active"

    def owner_batches(self, owner: str) -> str:
        """Sorted set of one owner's batch ids by creation time: ``GET /v1/batches`` lists only
        the caller's (an owner is a hash of its API key, gateway/auth.py)."""
        return f"{self._batch_prefix}:owner:{owner}:batches"

    def owner_batches_active(self, owner: str) -> str:
        """Set of one owner's active batches, for EMBEDFLEET_BATCH_MAX_ACTIVE_PER_OWNER."""
        return f"{self._batch_prefix}:owner:{owner}:batches:active"

    def batch_lease(self, batch_id: str) -> str:
        """Lease a gateway holds while it works on a batch, so replicas never both do."""
        return f"{self._batch_prefix}:batch:{batch_id}:lease"
