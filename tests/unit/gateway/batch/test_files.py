"""The Batch API's file ids and File objects (embedfleet/gateway/batch/files.py): an id names its
time and its folder's tag, and sorts by time."""

from __future__ import annotations

from embedfleet.gateway.batch.files import (
    StoredFile,
    folder_tag_of,
    new_file_id,
    order_key_of,
)


def test_an_id_carries_its_time_and_folder_tag() -> None:
    created_ns = 1_700_000_000_123_456_789
    file_id = new_file_id(created_ns, "abcd1234")
    assert file_id.startswith("file-") and len(file_id) == len("file-") + 16 + 8 + 16
    assert folder_tag_of(file_id) == "abcd1234"
    assert order_key_of(file_id) == (1_700_000_000, file_id)  # whole seconds, then the id
    assert new_file_id(created_ns, "abcd1234") != file_id  # a random tail


def test_ids_made_elsewhere_have_no_tag_or_place() -> None:
    old = "file-" + "0" * 16 + "f" * 16  # before folder tags: no tag
    assert folder_tag_of(old) is None and order_key_of(old) == (0, old)
    for foreign in ("file-xyz", "batch_123", "file-" + "0" * 41):
        assert folder_tag_of(foreign) is None
    assert order_key_of("file-zzzzzzzzzzzzzzzz-rest") is None
    assert order_key_of("upload-1") is None


def test_a_file_object_hides_its_owner_and_expires() -> None:
    stored = StoredFile("file-1", 10, 100, "in.jsonl", "batch", expires_at=200, owner="k1")
    assert "owner" not in stored.as_dict() and stored.record()["owner"] == "k1"
    assert not stored.expired(199) and stored.expired(200)
    assert not StoredFile("file-2", 1, 1, "f", "batch").expired(10**12)
    assert stored.order_key == (100, "file-1")
