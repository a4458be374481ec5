"""Capped exponential backoff for riding out Redis restarts and dropped connections."""

from __future__ import annotations

import asyncio
import random

from embedfleet.shared.redis_conn import TRANSIENT_FAULTS
from structlog.typing import FilteringBoundLogger

# What a restarting or unreachable server (or a cluster failing over) looks like to redis-py.
REDIS_FAULTS: tuple[type[BaseException], ...] = TRANSIENT_FAULTS


class Backoff:
    def __init__(self, log: FilteringBoundLogger, base: float = 0.1, cap: float = 5.0) -> None:
        self.log, self.base, self.cap, self.attempt = log, base, cap, 0

    def reset(self) -> None:
        self.attempt = 0

    async def wait(self, doing: str, error: BaseException) -> None:
        # Full jitter, so a fleet that lost its server does not reconnect in lockstep.
        delay = random.uniform(0, min(self.cap, self.base * 2**self.attempt))
        self.attempt += 1
        self.log.warning(
            "redis unavailable, retrying",
            doing=doing,
            error=str(error) or type(error).__name__,
            attempt=self.attempt,
            retry_in_s=round(delay, 2),
        )
        await asyncio.sleep(delay)
