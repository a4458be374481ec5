"""workers/outages.py's bookkeeping: an outage per system and activity, one event when a system
goes down and one when its last activity is back; the backoff that declares and closes them;
which sink errors are waited out."""

from __future__ import annotations

import asyncio

import pytest
import redis.exceptions

from embedfleet.shared.fault_kinds import Fault, FaultKind, System
from embedfleet.sinks.sink import SinkSetupError
from embedfleet.workers.events import WorkerEvents
from embedfleet.workers.outages import (
    Outages,
    RideOut,
    classify_sink_error,
    ride_out,
    transient_or_raise,
)


class Recorded(WorkerEvents):
    def __init__(self) -> None:
        self.outages: list[tuple[str, bool]] = []
        self.faults: list[tuple[str, str]] = []

    def outage(self, *, system: str, active: bool) -> None:
        self.outages.append((system, active))

    def transient_fault(self, *, system: str, doing: str) -> None:
        self.faults.append((system, doing))


def redis_down() -> Fault:
    return Fault(FaultKind.TRANSIENT, System.REDIS, ConnectionError("refused"))


def test_a_system_is_down_until_its_last_activity_is_back() -> None:
    events = Recorded()
    outages = Outages(events)
    assert not outages and outages.end(System.REDIS, "reading") is None
    outages.begin(redis_down(), "reading")
    outages.begin(redis_down(), "writing results")
    assert outages.is_down(System.REDIS) and not outages.is_down(System.QDRANT)
    assert outages.describe()["redis"].endswith("retrying: ConnectionError: refused")
    assert outages.end(System.REDIS, "reading") is not None
    assert outages.is_down(System.REDIS), "still down while results cannot be written"
    assert outages.end(System.REDIS, "writing results") is not None
    assert not outages
    assert events.outages == [("redis", True), ("redis", False)], "one event each way"


def test_a_repeated_fault_keeps_when_the_outage_began() -> None:
    outages = Outages()
    outages.begin(redis_down(), "reading")
    first = outages.describe()
    outages.begin(Fault(FaultKind.TRANSIENT, System.REDIS, TimeoutError("slow")), "reading")
    assert outages.describe()["redis"].endswith("TimeoutError: slow"), "the last error seen"
    assert len(outages.describe()) == len(first) == 1


async def test_ride_out_waits_out_transient_faults_and_closes_the_outage() -> None:
    events = Recorded()
    outages = Outages(events)
    ride = RideOut("reading", outages, events, base_s=0.0, cap_s=0.0)
    failures = [redis.exceptions.ConnectionError("down"), redis.exceptions.TimeoutError("slow")]

    async def action() -> str:
        if failures:
            raise failures.pop(0)
        return "read"

    assert await ride_out(ride, System.REDIS, action) == "read"
    assert events.faults == [("redis", "reading"), ("redis", "reading")]
    assert events.outages == [("redis", True), ("redis", False)]
    assert not outages


async def test_ride_out_raises_what_does_not_pass() -> None:
    outages = Outages()
    ride = RideOut("reading", outages, WorkerEvents(), base_s=0.0, cap_s=0.0)

    async def action() -> None:
        raise redis.exceptions.ResponseError("WRONGTYPE Operation against a key")

    with pytest.raises(redis.exceptions.ResponseError):
        await asyncio.wait_for(ride_out(ride, System.REDIS, action), 5)
    assert not outages, "no outage declared for a fault that is not waited out"


def test_a_sink_setup_error_is_judged_by_the_error_it_wraps() -> None:
    try:
        raise SinkSetupError("cannot connect") from ConnectionError("refused")
    except SinkSetupError as error:
        wrapped_unreachable = error
    fault = classify_sink_error(wrapped_unreachable, System.QDRANT)
    assert (fault.kind, fault.system) == (FaultKind.TRANSIENT, System.QDRANT)
    assert fault.error is wrapped_unreachable
    own = classify_sink_error(SinkSetupError("another model's table"), System.POSTGRESQL)
    assert own.kind is FaultKind.WORKER, "a person must act"
    assert classify_sink_error(ValueError("NaN"), System.QDRANT).kind is FaultKind.ROW


def test_transient_or_raise_hands_back_only_transient_faults() -> None:
    assert transient_or_raise(TimeoutError(), System.REDIS).kind is FaultKind.TRANSIENT
    error = PermissionError("read-only folder")
    with pytest.raises(PermissionError) as raised:
        transient_or_raise(error, System.PARQUET)
    assert raised.value is error
