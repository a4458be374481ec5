"""shared/batch_keys.py: the Batch API's key names, as ``Keys`` gives them (pure logic)."""

from __future__ import annotations

from embedfleet.shared.keys import Keys, key_slot


def _batch_keys(keys: Keys) -> list[str]:
    return [
        keys.batch("b1"),
        keys.batches,
        keys.batches_active,
        keys.owner_batches("o1"),
        keys.owner_batches_active("o1"),
        keys.batch_lease("b1"),
    ]


def test_one_partition_keeps_the_namespaces_plain_names() -> None:
    assert _batch_keys(Keys(namespace="ns")) == [
        "ns:batch:b1",
        "ns:batches",
        "ns:batches:active",
        "ns:owner:o1:batches",
        "ns:owner:o1:batches:active",
        "ns:batch:b1:lease",
    ]


def test_with_partitions_every_batch_key_shares_one_slot_of_its_own() -> None:
    """A batch's record, the index and the active sets change in one MULTI: one slot."""
    keys = Keys(namespace="ns", partitions=6)
    names = _batch_keys(keys)
    assert all(name.startswith("ns:{b}:") for name in names)
    assert {key_slot(name) for name in names} == {key_slot("{b}")}
    # the same from any partition's or lane's key set: the batches are fleet-wide
    assert _batch_keys(keys.partition(3)) == names
    assert _batch_keys(keys.for_model("other")) == names
