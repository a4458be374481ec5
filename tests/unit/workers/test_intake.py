"""workers/intake.py's reader: when the compute stage finds no window queued (the host bounds
the worker), the next read runs beside the opening of the one before and is opened beside it,
two at most (issue 53); otherwise,
and wherever a tenant has a token rate, a window is read only once the one before is opened.
Windows reach the compute stage in the order they were read either way. The stages around it
are fakes: what is tested is the order of reads and openings."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import redis

from embedfleet.workers import intake as intake_module
from embedfleet.workers.consumer import StreamEntry
from embedfleet.workers.intake import Intake
from embedfleet.workers.windows import Window

READS = 3  # windows the fake stream holds before the reader is stopped


@dataclass
class FakeOpener:
    """Opens read ``n`` as a window of one chunk, ``n``; read 1's opening may be held until
    read 2 has happened (``hold_first``) or until read 2's opening has begun
    (``until_second_opens``), read 2's for some turns of the event loop (``slow_second``)."""

    log: list[str]
    second_read: asyncio.Event
    hold_first: bool
    fail_first: bool
    slow_second: bool
    until_second_opens: bool = False
    second_opens: asyncio.Event = field(default_factory=asyncio.Event)
    # whether its windows had texts to tokenize (False: producers' ids, all Python)
    tokenizes: bool = True
    # turns of the event loop read 1's opening takes once read 2 has happened
    first_turns: int = 0

    async def open_window(self, entries: list[StreamEntry]) -> tuple[Window, list[Any]]:
        number = int(entries[0].entry_id.split("-")[0])
        self.log.append(f"open {number}")
        if number == 2:
            self.second_opens.set()
        if number == 1 and self.until_second_opens:
            await self.second_opens.wait()  # only a second opening beside this one gets past
        if number == 1 and self.hold_first:
            await self.second_read.wait()
            for _ in range(self.first_turns):
                await asyncio.sleep(0)
            if self.fail_first:  # Redis went away while it was opened (say, the cache lookup)
                raise redis.exceptions.ConnectionError("Connection refused")
        if number == 2 and self.slow_second:  # an opening that takes the event loop's turns
            for _ in range(50):
                await asyncio.sleep(0)
        self.log.append(f"opened {number}")
        return Window([f"chunk {number}"], [f"entry {number}"], []), []  # type: ignore[list-item]


READ_MAX_BYTES = 100  # the fake reads' EMBEDFLEET_READ_MAX_BYTES


def fake_parts(
    log: list[str], second_read: asyncio.Event, rated: list[str], payload: bytes = b""
) -> Any:
    stopping = asyncio.Event()
    reads = 0

    async def read_ingest(count: int, block_ms: int) -> list[StreamEntry]:
        nonlocal reads
        reads += 1
        if reads > READS:
            stopping.set()
            return []
        log.append(f"read {reads}")
        if reads == 2:
            second_read.set()
        return [StreamEntry("ingest", f"{reads}-0", payload, {})]

    async def nothing(*args: object, **kwargs: object) -> list[StreamEntry]:
        return []

    consumer = SimpleNamespace(
        read_ingest=read_ingest,
        finish_waiting=nothing,
        abandon_waiting=lambda: None,
        interactive_stream="interactive",
        rates=SimpleNamespace(rated=rated, charge_window=lambda *args: None),
    )
    return SimpleNamespace(
        stopping=stopping,
        consumer=consumer,
        batching=SimpleNamespace(read_count=READS, read_max_bytes=READ_MAX_BYTES),
        settings=SimpleNamespace(block_ms=10),
        events=SimpleNamespace(
            entries_read=lambda **kwargs: None, transient_fault=lambda **kwargs: None
        ),
        outages=SimpleNamespace(begin=lambda fault, doing: None, end=lambda system, doing: None),
        in_flight=SimpleNamespace(hold=lambda held: None, release=lambda rejected: None),
        dead_letters=SimpleNamespace(send=nothing),
    )


async def run_reader(
    *,
    starved: bool,
    rated: list[str],
    fail_first: bool = False,
    starved_once: bool = False,
    until_second_opens: bool = False,
    tokenizes: bool = True,
    first_turns: int = 0,
    payload: bytes = b"",
) -> tuple[list[str], list[list[str]]]:
    """The reader over the fake stream, with a compute stage that takes each window as it
    comes: through ``next_window`` (it finds none queued: ``starved``) or, not starved, by
    asking for the next one only once it holds a window (as ``pace_reads`` does);
    ``starved_once``: the first window through ``next_window``, the rest as not starved."""
    log: list[str] = []
    second_read = asyncio.Event()
    parts = fake_parts(log, second_read, rated, payload)
    reader = Intake(parts, prepare=lambda window: [])
    hold_first = starved and not rated
    opener = FakeOpener(
        log,
        second_read,
        hold_first and not until_second_opens,
        fail_first,
        slow_second=starved_once,
        until_second_opens=until_second_opens,
        tokenizes=tokenizes,
        first_turns=first_turns,
    )
    reader.opener = opener  # type: ignore[assignment]
    windows: asyncio.Queue[Window | None] = asyncio.Queue()
    ready = asyncio.Event()
    ready.set()
    reading = asyncio.ensure_future(reader.run(windows, ready))
    got: list[list[str]] = []
    while True:
        if starved:
            window = await asyncio.wait_for(reader.next_window(windows), timeout=30)
        elif starved_once and not got:
            window = await asyncio.wait_for(reader.next_window(windows), timeout=30)
            reader.want_window.set()  # pace_reads, during the window's batches
        else:
            window = await asyncio.wait_for(windows.get(), timeout=30)
            reader.want_window.set()
        if window is None:
            break
        got.append(list(window.chunks))  # type: ignore[arg-type]
    await asyncio.wait_for(reading, timeout=30)
    return log, got


@pytest.fixture(autouse=True)
def no_real_opener(monkeypatch: pytest.MonkeyPatch) -> None:
    """Intake builds a WindowOpener of the worker's parts; the fake replaces it."""
    monkeypatch.setattr(intake_module, "WindowOpener", lambda parts, prepare: None)


def test_a_starved_compute_stage_gets_the_next_read_beside_the_opening() -> None:
    log, got = asyncio.run(run_reader(starved=True, rated=[]))
    # read 1's opening is held until read 2 has happened: only a read ahead gets past it
    assert log.index("read 2") < log.index("opened 1")
    assert got == [["chunk 1"], ["chunk 2"], ["chunk 3"]]


def test_a_read_ahead_is_opened_beside_the_opening_before_it_and_queued_after_it() -> None:
    """Read 1's opening ends only once read 2's has begun: the two run at once (one window's
    texts in the tokenizer's Rust while the other's Python runs), and read 2's window still
    reaches the compute stage after read 1's. Opened one at a time, this would time out."""
    log, got = asyncio.run(run_reader(starved=True, rated=[], until_second_opens=True))
    assert log.index("open 2") < log.index("opened 1")
    assert got == [["chunk 1"], ["chunk 2"], ["chunk 3"]]
    # two openings at most: read 3 waits until read 1's is done
    assert log.index("opened 1") < log.index("read 3")


@pytest.mark.parametrize("tokenizes", [True, False], ids=["texts", "producers' ids"])
def test_a_read_ahead_is_opened_beside_only_windows_with_texts_to_tokenize(
    tokenizes: bool,
) -> None:
    """Read 1's opening takes 50 turns of the event loop once read 2 has happened: read 2's
    opening starts in them where the windows have texts to tokenize (one's Rust beside the
    other's Python), and only after it where they are producers' ids: all Python, which two
    threads would only take turns on."""
    log, got = asyncio.run(run_reader(starved=True, rated=[], tokenizes=tokenizes, first_turns=50))
    assert (log.index("open 2") < log.index("opened 1")) is tokenizes
    assert got == [["chunk 1"], ["chunk 2"], ["chunk 3"]]


@pytest.mark.parametrize(
    ("payload_bytes", "beside"), [(50, True), (51, False)], ids=["within", "over"]
)
def test_two_reads_are_opened_at_once_only_within_one_reads_bytes(
    payload_bytes: int, beside: bool
) -> None:
    """Two openings hold both reads' text at once: only while the two together stay within
    EMBEDFLEET_READ_MAX_BYTES, so that a worker's memory bound for one read holds
    (docs/OPERATIONS.md); reads of long texts, full by bytes, are opened in turn."""
    log, got = asyncio.run(
        run_reader(starved=True, rated=[], first_turns=50, payload=b"x" * payload_bytes)
    )
    assert (log.index("open 2") < log.index("opened 1")) is beside
    assert got == [["chunk 1"], ["chunk 2"], ["chunk 3"]]


def test_a_read_ahead_is_kept_when_the_opening_before_it_fails() -> None:
    """Read 1's opening fails on a transient fault after read 2 was read ahead: the reader
    rides the fault out, and read 2's window, opened beside it, is queued all the same, opened
    once and not read again (read 1's entries are left to their lease, as any window's that a
    fault drops)."""
    log, got = asyncio.run(run_reader(starved=True, rated=[], fail_first=True))
    assert got == [["chunk 2"], ["chunk 3"]]
    assert log.count("read 2") == 1 and log.count("opened 2") == 1
    assert "opened 1" not in log


def test_a_read_ahead_waits_for_the_compute_stage_to_wait() -> None:
    """The compute stage found no window queued once (its first), then runs each window while
    the next is opened: a read made beside that opening would be held behind it, and a tenant
    that came meanwhile would wait for both (the fault of stop 62's read-ahead that CI's
    test_tenant_pace found: 2.13x a share's time). Read 3 waits for read 2's window."""
    log, got = asyncio.run(run_reader(starved=False, rated=[], starved_once=True))
    assert log.index("opened 2") < log.index("read 3")
    assert got == [["chunk 1"], ["chunk 2"], ["chunk 3"]]


@pytest.mark.parametrize(
    ("starved", "rated"),
    [(False, []), (True, ["acme"])],
    ids=["the model bounds the worker", "a tenant has a token rate"],
)
def test_otherwise_a_window_is_read_once_the_one_before_is_opened(
    starved: bool, rated: list[str]
) -> None:
    log, got = asyncio.run(run_reader(starved=starved, rated=rated))
    assert log == [
        "read 1",
        "open 1",
        "opened 1",
        "read 2",
        "open 2",
        "opened 2",
        "read 3",
        "open 3",
        "opened 3",
    ]
    assert got == [["chunk 1"], ["chunk 2"], ["chunk 3"]]
