"""A tenant's room (producer/backlog_waits.py): the one comparison of its backlog against its
limit, and what a caller is told when the backlog stayed full."""

from __future__ import annotations

from embedfleet.producer.backlog_waits import TenantBacklogFullError, TenantRoom


def test_room_left_and_full() -> None:
    assert TenantRoom(held=3, limit=10).left == 7
    assert not TenantRoom(held=3, limit=10).full
    assert TenantRoom(held=10, limit=10).full
    assert TenantRoom(held=12, limit=10).left == 0  # over it (a lowered limit): no room
    unlimited = TenantRoom(held=10**9, limit=None)
    assert unlimited.left is None and not unlimited.full


def test_the_full_error_says_what_was_added_and_what_to_do() -> None:
    error = TenantBacklogFullError("tenant 'a' holds 10 of 10", handled=4)
    assert int(error.added) == 0 and error.handled == 4
    said = str(error)
    assert said.startswith("tenant 'a' holds 10 of 10; this call added 0 of its chunks")
    assert "enqueue them again once there is room" in said
