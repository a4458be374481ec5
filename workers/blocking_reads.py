"""The idle wait's blocking reads: one per stream set, kept until they return.

When every stream a worker reads is empty, the reader blocks on all of them at once: one
blocking XREADGROUP per partition (and one on the interactive stream), and goes on as soon as
the first returns. The reads still waiting then are kept here and collected by the next call,
so an entry they deliver is never left behind (workers/consumer.py).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine
from typing import Any, Generic, TypeVar

Entry = TypeVar("Entry")


class BlockingReads(Generic[Entry]):
    """Blocking reads by name (a stream, or a partition's prefix), each a task."""

    def __init__(self) -> None:
        self._tasks: dict[str, asyncio.Task[list[Entry]]] = {}

    def __bool__(self) -> bool:
        return bool(self._tasks)

    def start(self, name: str, read: Callable[[], Coroutine[Any, Any, list[Entry]]]) -> None:
        """Start ``read`` as ``name``'s blocking read unless one is still waiting."""
        if name not in self._tasks:
            self._tasks[name] = asyncio.create_task(read())

    def blocked(self, name: str) -> bool:
        """Whether ``name``'s read is still waiting (nothing came: Redis would have handed it)."""
        task = self._tasks.get(name)
        return task is not None and not task.done()

    async def first(self, timeout: float) -> None:
        """Wait until the first read returns, ``timeout`` seconds at most."""
        if self._tasks:
            await asyncio.wait(self._tasks.values(), timeout=timeout, return_when="FIRST_COMPLETED")

    def collect(self, only: str | None = None) -> list[Entry]:
        """Entries of the reads that have returned (``only``: that name's read); a failed read
        raises only when no other read brought anything (then the caller backs off and reads
        again)."""
        entries: list[Entry] = []
        failure: BaseException | None = None
        for name, task in list(self._tasks.items()):
            if not task.done() or only not in (None, name):
                continue
            del self._tasks[name]
            if task.cancelled():
                continue
            if (error := task.exception()) is not None:
                failure = error
                continue
            entries.extend(task.result())
        if failure is not None and not entries:
            raise failure
        return entries

    async def finish(self) -> list[Entry]:
        """On drain: let the reads still waiting end (within one block interval) and return
        what they delivered, so it is worked on rather than left pending."""
        if self._tasks:
            await asyncio.wait(self._tasks.values())
        with contextlib.suppress(Exception):
            return self.collect()
        return []

    def abandon(self) -> None:
        """On abort: entries a cancelled read had delivered stay pending and are reclaimed."""
        for task in self._tasks.values():
            task.cancel()
        self._tasks.clear()
