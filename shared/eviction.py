"""Redis's eviction policy, checked: the fleet needs ``maxmemory-policy noeviction``.

Under any other policy a Redis at its ``maxmemory`` deletes keys to make room, and the keys
with a TTL go first under the ``volatile-*`` policies many managed services default to: reply
lists (a caller waits for an answer that is gone) and job id records (a re-sent chunk is counted
twice). The ``allkeys-*`` policies can delete the backlog itself. With ``noeviction`` a full
Redis refuses writes instead; the fleet waits that out (a transient fault), so nothing is lost.

The worker and ``embedfleet serve`` check at start and warn (``warn_on_eviction_policy``);
``embedfleet status`` reports it. Managed services often
disable CONFIG: the policy is then read from ``INFO memory``, and when neither answers the check
says it could not be made, never that all is well.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any, cast

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from embedfleet.shared.fault_kinds import BackoffPolicy, classify, is_transient
from embedfleet.shared.logging import get_logger

log = get_logger("embedfleet.redis")

REQUIRED_POLICY = "noeviction"
FIX = f"maxmemory-policy {REQUIRED_POLICY}"


@dataclass(frozen=True)
class EvictionPolicy:
    """What Redis said its policy is, or why it could not be read."""

    policy: str | None  # None: it could not be read
    unknown_because: str | None = None

    @property
    def safe(self) -> bool | None:
        """True under noeviction, False under a policy that deletes keys, None when unknown."""
        return None if self.policy is None else self.policy == REQUIRED_POLICY

    @property
    def warning(self) -> str | None:
        """What to tell a person, or None when the policy is the one the fleet needs."""
        if self.policy is None:
            return (
                f"could not check Redis's maxmemory-policy ({self.unknown_because}); make sure "
                f"it is {REQUIRED_POLICY} (set {FIX}): another policy lets a full Redis delete "
                "reply lists, job id records or the backlog"
            )
        if self.policy != REQUIRED_POLICY:
            return (
                f"Redis's maxmemory-policy is {self.policy}: at its maxmemory it deletes keys "
                "(reply lists and job id records first under volatile-*, the backlog too under "
                f"allkeys-*); set {FIX} (redis.conf, CONFIG SET, or the managed service's "
                "parameter group)"
            )
        return None

    def as_json(self) -> dict[str, Any]:
        return {
            "policy": self.policy,
            "safe": self.safe,
            "required": REQUIRED_POLICY,
            "warning": self.warning,
        }


def _text(value: object) -> str | None:
    if isinstance(value, bytes):
        return value.decode("utf-8", "replace")
    return value if isinstance(value, str) and value else None


async def check_eviction_policy(client: aioredis.Redis) -> EvictionPolicy:
    """Read the policy (CONFIG GET, else INFO memory). A connection error is raised for the
    caller to ride out; a refused command (disabled, renamed, not in the ACL user's rights)
    gives an EvictionPolicy that says it could not be read. On a cluster one node answers."""
    refused: list[str] = []
    try:
        reply = await client.config_get("maxmemory-policy")
    except ResponseError as error:
        refused.append(f"CONFIG GET: {error}")
    else:
        # a client with decode_responses answers str keys, ours bytes ones
        values = cast("dict[object, object]", reply)
        policy = _text(values.get("maxmemory-policy") or values.get(b"maxmemory-policy"))
        if policy is not None:
            return EvictionPolicy(policy)
        refused.append("CONFIG GET returned no maxmemory-policy")
    try:
        memory = await client.info("memory")
    except ResponseError as error:
        refused.append(f"INFO memory: {error}")
    else:
        policy = _text(memory.get("maxmemory_policy"))
        if policy is not None:
            return EvictionPolicy(policy)
        refused.append("INFO memory has no maxmemory_policy")
    return EvictionPolicy(None, "; ".join(refused))


async def warn_on_eviction_policy(client: aioredis.Redis) -> EvictionPolicy:
    """Check Redis's maxmemory-policy once it answers and warn unless it is noeviction. A Redis
    not up yet is retried without a word: the process's own start reports that outage. Run it
    beside the start (a task), so that a person reads the warning early."""
    backoff = BackoffPolicy()
    while True:
        try:
            found = await check_eviction_policy(client)
            break
        except Exception as error:
            if not is_transient(error):  # the process's own start says what is wrong
                found = EvictionPolicy(None, classify(error).detail)
                break
            await asyncio.sleep(backoff.next_delay())
    if found.warning is not None:
        log.warning(
            "redis may evict the fleet's keys",
            policy=found.policy,
            fix=FIX,
            detail=found.warning,
        )
    else:
        log.info("redis eviction policy checked", policy=found.policy)
    return found
