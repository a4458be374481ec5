"""The interactive stream: large requests someone waits on, encoded ahead of the bulk windows.

The interactive stream (``Keys.interactive``: the inputs of large requests a caller waits on)
jumps the queue: before each bulk batch the compute stage encodes its windows first, ahead of
the bulk windows this worker already holds (the current one's rest, and at most one more read
near its end: ``Intake.pace_reads``), so a request waits for one bulk batch, not for those
windows. ``InteractiveJump`` says which windows jump: first those the reader opened from the
stream (``Intake.urgent``); then, at most every URGENT_CHECK_S, the stream's new entries without
blocking (``StreamConsumer.read_interactive``), for entries that came while the reader waits for
the compute stage to want a window, those Redis handed to the reader's idle wait included.

Single queries (the query stream) are the query stage's (workers/queries.py), served between a
bulk batch's layers rather than between batches.
"""

from __future__ import annotations

import time

from embedfleet.shared.fault_kinds import System
from embedfleet.shared.logging import get_logger
from embedfleet.workers.intake import Intake
from embedfleet.workers.outages import transient_or_raise
from embedfleet.workers.parts import StageParts
from embedfleet.workers.windows import Window

log = get_logger("embedfleet.worker")
# The compute stage looks for interactive entries before a bulk batch at most this often: a
# request then waits about one batch, and a short-batch GPU pays one read per interval, not per
# batch.
URGENT_CHECK_S = 0.05


class InteractiveJump:
    """The windows of interactive entries, for the compute stage to encode before its next
    bulk batch."""

    def __init__(self, parts: StageParts, intake: Intake) -> None:
        self.parts = parts
        self.intake = intake
        # when the stream is next read without blocking (read_new)
        self._next_check = 0.0

    def opened(self) -> Window | None:
        """The next window the reader opened from interactive entries; None when none waits."""
        urgent = self.intake.urgent
        return None if urgent.empty() else urgent.get_nowait()

    async def read_new(self) -> Window | None:
        """At most every URGENT_CHECK_S, and not once draining: the stream's new entries, read
        without blocking and opened as a window that this worker now holds; None when nothing
        came (or no read was due). A Redis fault on that read is left to the reader and the
        reclaimer: entries read and not held are redelivered after their lease."""
        now = time.monotonic()
        if self.parts.stopping.is_set() or now < self._next_check:
            return None
        self._next_check = now + URGENT_CHECK_S
        consumer = self.parts.consumer
        try:
            entries = await consumer.read_interactive(self.parts.batching.read_count)
            if not entries:
                return None
            self.parts.events.entries_read(stream=entries[0].stream, count=len(entries))
            window, rejected = await self.intake.opener.open_window(entries)
            await self.intake.dead_letter(rejected)
            await self.intake.drop_expired(window.expired)
        except Exception as error:
            fault = transient_or_raise(error, System.REDIS)
            log.warning("interactive entries left for the reader", error=fault.detail)
            return None
        if window.empty:
            return None
        self.parts.in_flight.hold(window.held)
        return window
