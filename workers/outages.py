"""Riding out faults in the worker: wait on the passing ones, and know what is being waited on.

The kinds come from ``shared/fault_kinds.py``. Here the worker's side of them:

- ``RideOut``: one activity's capped backoff (reading the ingest stream, writing results, ...).
  Each wait logs which system failed and why, counts it (``transient_fault``), and opens an
  outage in ``Outages``; the first success closes it.
- ``Outages``: the systems this worker is waiting for right now. ``/readyz`` answers 503 while
  any is open, with what and since when, so a load balancer and a person both see it.
- ``ride_out``: call a coroutine until it succeeds, waiting out transient faults and raising
  anything else (used where there is nothing to do meanwhile, as at start-up).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from embedfleet.shared.fault_kinds import BackoffPolicy, Fault, FaultKind, System, classify
from embedfleet.shared.logging import get_logger
from embedfleet.sinks.sink import SinkSetupError
from embedfleet.workers.events import WorkerEvents

log = get_logger("embedfleet.worker")
T = TypeVar("T")


class Outages:
    """Open outages by (system, activity), with when each began and the last error seen."""

    def __init__(self, events: WorkerEvents | None = None) -> None:
        self.events = events or WorkerEvents()
        self._open: dict[tuple[System, str], tuple[float, str]] = {}

    def begin(self, fault: Fault, doing: str) -> None:
        key = (fault.system, doing)
        since = self._open.get(key, (time.monotonic(), ""))[0]
        was_down = self.is_down(fault.system)
        self._open[key] = (since, fault.detail)
        if not was_down:
            self.events.outage(system=fault.system.value, active=True)

    def end(self, system: System, doing: str) -> float | None:
        """Close the outage; returns how long it lasted, None when there was none."""
        opened = self._open.pop((system, doing), None)
        if opened is None:
            return None
        if not self.is_down(system):
            self.events.outage(system=system.value, active=False)
        return time.monotonic() - opened[0]

    def is_down(self, system: System) -> bool:
        return any(key[0] is system for key in self._open)

    def describe(self) -> dict[str, str]:
        """System name → what a person reading /readyz should know."""
        now = time.monotonic()
        described: dict[str, str] = {}
        for (system, doing), (since, detail) in sorted(self._open.items()):
            line = f"unavailable for {now - since:.1f}s while {doing}, retrying: {detail}"
            described.setdefault(system.value, line)
        return described

    def __bool__(self) -> bool:
        return bool(self._open)


class RideOut:
    """Capped backoff for one activity; never gives up on a transient fault."""

    def __init__(
        self,
        doing: str,
        outages: Outages,
        events: WorkerEvents,
        *,
        base_s: float = 0.1,
        cap_s: float = 5.0,
    ) -> None:
        self.doing = doing
        self.outages = outages
        self.events = events
        self.policy = BackoffPolicy(base_s=base_s, cap_s=cap_s)
        self._systems: set[System] = set()

    async def wait(self, fault: Fault) -> None:
        delay = self.policy.next_delay()
        self._systems.add(fault.system)
        self.outages.begin(fault, self.doing)
        self.events.transient_fault(system=fault.system.value, doing=self.doing)
        log.warning(
            f"{fault.system} unavailable, retrying",
            system=fault.system.value,
            doing=self.doing,
            error=fault.detail,
            attempt=self.policy.attempt,
            retry_in_s=round(delay, 2),
        )
        await asyncio.sleep(delay)

    async def pause(self, fault: Fault) -> None:
        """Wait before retrying a fault that is not known to pass (no outage is declared)."""
        await asyncio.sleep(self.policy.next_delay())

    def succeeded(self) -> None:
        for system in self._systems:
            lasted = self.outages.end(system, self.doing)
            if lasted is not None:
                log.info(
                    f"{system} is back",
                    system=system.value,
                    doing=self.doing,
                    after_s=round(lasted, 1),
                )
        self._systems.clear()
        self.policy.reset()


def classify_sink_error(error: Exception, system: System) -> Fault:
    """``classify``, seeing through a SinkSetupError to the database's own error it wraps
    (a sink reconnecting mid-run raises one): unreachable is waited out, a bad password is not.
    A SinkSetupError of its own (another model's table) is the worker's: a person must act."""
    if isinstance(error, SinkSetupError):
        cause = error.__cause__
        if isinstance(cause, Exception):
            fault = classify(cause, system)
            return Fault(fault.kind, fault.system, error)
        return Fault(FaultKind.WORKER, system, error)
    return classify(error, system)


def transient_or_raise(error: Exception, system: System) -> Fault:
    """The fault, when it is transient; any other kind is re-raised for the caller's caller."""
    fault = classify(error, system)
    if fault.kind is not FaultKind.TRANSIENT:
        raise error
    return fault


async def ride_out(
    ride: RideOut,
    system: System,
    action: Callable[[], Awaitable[T]],
    classify_error: Callable[[Exception, System], Fault] = classify,
) -> T:
    """``await action()`` until it succeeds; transient faults are waited out, others raised."""
    while True:
        try:
            result = await action()
        except Exception as error:
            fault = classify_error(error, system)
            if fault.kind is not FaultKind.TRANSIENT:
                raise
            await ride.wait(fault)
            continue
        ride.succeeded()
        return result
