"""Riding out Redis outages on the client side: the worker's capped, jittered backoff, bounded.

A worker waits for Redis as long as it takes (it has nothing else to do). A client (the
``Producer``, the CLI verbs) has a caller: it waits for at most ``EMBEDFLEET_REDIS_RETRY_S``
(or the caller's own deadline, for a query), then raises ``RedisUnavailableError``, whose
message names the server and the setting. Every client path goes through one ``RedisRetry``
per client, so that an outage is announced once (``OutageListener.redis_down``) and its end
once (``redis_back``), however many operations were waiting on it.

Retrying is safe because every client operation is idempotent when sent again: reads are, the
enqueue script adds a chunk once per id within its job (``producer/enqueue.py``), and a query
re-sent after a reconnection is answered under the same request id.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from redis import exceptions as redis_errors

from embedfleet.shared.fault_kinds import (
    BackoffPolicy,
    classify,
    is_redis_out_of_memory,
    is_transient,
)
from embedfleet.shared.logging import get_logger

log = get_logger("embedfleet.client")
T = TypeVar("T")


class RedisUnavailableError(redis_errors.ConnectionError):
    """Redis stayed unreachable past the bound; the message names the server and the setting.

    A ``redis.exceptions.ConnectionError``, so code that caught redis-py's error still does.
    """


class OutageListener(Protocol):
    """Told once when a client finds Redis unreachable, and once when it answers again."""

    def redis_down(self, server: str, error: BaseException, give_up_after_s: float) -> None: ...

    def redis_back(self, server: str, down_s: float) -> None: ...


class LogOutages:
    """The library default: one warning when Redis goes away, one line when it is back."""

    def redis_down(self, server: str, error: BaseException, give_up_after_s: float) -> None:
        log.warning(
            "redis unavailable, retrying",
            server=server,
            error=describe(error),
            give_up_after_s=give_up_after_s,
            setting="EMBEDFLEET_REDIS_RETRY_S",
        )

    def redis_back(self, server: str, down_s: float) -> None:
        log.info("redis is back", server=server, down_s=round(down_s, 1))


def describe(error: BaseException) -> str:
    """The error in one line, with its type: what a person reads in the notice."""
    return classify(error).detail


@dataclass(eq=False)  # one per client, stateful: compared by identity
class RedisRetry:
    """One client's view of whether Redis is reachable, and its retry loop.

    ``server`` is what messages call the server (a URL without its password); ``listener`` is
    told when an outage starts and ends.
    """

    server: str
    give_up_after_s: float
    listener: OutageListener = field(default_factory=LogOutages)
    # The bound while this client has never reached the server (None: ``give_up_after_s``)
    first_contact_s: float | None = None
    _down_since: float | None = field(default=None, init=False, repr=False)
    _reached: bool = field(default=False, init=False, repr=False)

    @property
    def bound(self) -> tuple[float, str]:
        """How long a failing operation is retried now, and the setting that says so."""
        if not self._reached and self.first_contact_s is not None:
            return self.first_contact_s, "EMBEDFLEET_REDIS_CONNECT_S"
        return self.give_up_after_s, "EMBEDFLEET_REDIS_RETRY_S"

    @property
    def down(self) -> bool:
        return self._down_since is not None

    def attempts(self, doing: str, *, deadline: float | None = None) -> Attempts:
        """A retry loop written out by the caller (for work that must change between tries)."""
        return Attempts(self, doing, deadline)

    async def call(
        self,
        doing: str,
        operation: Callable[[], Awaitable[T]],
        *,
        deadline: float | None = None,
    ) -> T:
        """``await operation()`` until it succeeds, waiting out transient faults; raises
        anything else at once, and ``RedisUnavailableError`` once the bound (or ``deadline``,
        a ``time.monotonic()`` value) has passed; with a ``deadline``, a try still waiting on
        Redis there is cancelled. ``operation`` must be safe to repeat: a fault
        can come after the server applied the commands, before their reply was read."""
        tries = self.attempts(doing, deadline=deadline)
        while True:
            try:
                if deadline is None:
                    result = await operation()  # bounded by the connection's read timeout
                else:
                    # a hung server must not hold the caller past its deadline: the try is
                    # cancelled there (a TimeoutError, transient: ``failed`` then gives up)
                    async with asyncio.timeout(max(deadline - time.monotonic(), 0)):
                        result = await operation()
            except Exception as error:
                await tries.failed(error)
            else:
                tries.succeeded()
                return result

    def went_down(self, error: BaseException) -> None:
        if self._down_since is None:
            self._down_since = time.monotonic()
            self.listener.redis_down(self.server, error, self.bound[0])

    def came_back(self) -> None:
        self._reached = True
        if self._down_since is not None:
            down_s = time.monotonic() - self._down_since
            self._down_since = None
            self.listener.redis_back(self.server, down_s)


@dataclass
class Attempts:
    """The tries of one operation: ``failed(error)`` after each failure (it waits, or raises),
    ``succeeded()`` after the success."""

    retry: RedisRetry
    doing: str
    deadline: float | None
    # The workers' backoff (shared/fault_kinds.py): full jitter, doubling, capped.
    backoff: BackoffPolicy = field(default_factory=BackoffPolicy)
    first_failure: float | None = None

    async def failed(self, error: Exception) -> None:
        """Wait before the next try; re-raise ``error`` if waiting cannot fix it, and raise
        ``RedisUnavailableError`` once the time allowed has passed."""
        if isinstance(error, RedisUnavailableError) or not is_transient(error):
            raise error  # not transient, or an inner retry has already waited its bound
        now = time.monotonic()
        if self.first_failure is None:
            self.first_failure = now
        self.retry.went_down(error)
        bound, setting = self.retry.bound
        limit = self.first_failure + bound
        gave_up = f"gave up after {bound:g}s ({setting})"
        if self.deadline is not None and self.deadline < limit:
            limit, gave_up = self.deadline, "gave up at the caller's timeout"
        if now >= limit and is_redis_out_of_memory(error):
            raise RedisUnavailableError(
                f"Redis at {self.retry.server} refused writes for "
                f"{now - self.first_failure:.1f}s while trying to {self.doing}: it is at its "
                f"maxmemory ({describe(error)}); {gave_up}. Let the workers drain the backlog "
                "(embedfleet status), or raise the server's maxmemory."
            ) from error
        if now >= limit:
            raise RedisUnavailableError(
                f"Redis at {self.retry.server} unreachable for {now - self.first_failure:.1f}s "
                f"while trying to {self.doing} ({describe(error)}); {gave_up}. Check that the "
                "server is running and that EMBEDFLEET_REDIS_URL (or --redis-url) names it."
            ) from error
        await asyncio.sleep(min(self.backoff.next_delay(), limit - now))

    def succeeded(self) -> None:
        self.retry.came_back()
        self.backoff.reset()
        self.first_failure = None
