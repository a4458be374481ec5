"""Connecting to Redis and creating the consumer group, the same way on every side."""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

import redis
import redis.asyncio as aioredis
from embedfleet.shared.keys import Keys
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ResponseError


def connect(url: str, **kwargs: object) -> aioredis.Redis:
    """An asyncio client for ``redis://`` or ``rediss://`` (TLS) URLs, with ACL user/password.

    Responses stay as bytes: payloads are binary msgpack, and decoding is the protocol's job.
    hiredis is picked up automatically by redis-py when installed.
    """
    options: dict[str, object] = {
        "decode_responses": False,
        "health_check_interval": 30,
        "socket_keepalive": True,
        # Blocking reads (XREADGROUP BLOCK, BLPOP for query replies) wait longer than redis-py's
        # default read timeout; dead connections are found by keepalive and health checks.
        "socket_timeout": None,
        "socket_connect_timeout": 10,
    }
    options.update(kwargs)
    return aioredis.Redis.from_url(url, **options)


def connect_client(url: str, **kwargs: object) -> aioredis.Redis:
    """``connect`` for the client side (producer, CLI verbs), whose retries are all
    ``shared/retry.py``'s: redis-py's own (10 quiet tries in redis-py 8, pipelines included)
    are turned off, so an outage is seen, announced and bounded in one place."""
    return connect(url, retry=Retry(NoBackoff(), 0), **kwargs)


def redact_url(url: str) -> str:
    """The URL without its password, fit to print."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    if parts.port is not None:
        host = f"{host}:{parts.port}"
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}"))


def connect_sync(url: str, *, timeout_s: float = 5.0) -> redis.Redis:
    """A blocking client for the model thread's short writes (query replies).

    No blocking commands go through it, so a read timeout is safe: a dead server fails the
    write after ``timeout_s`` instead of holding the model thread.
    """
    return redis.Redis.from_url(
        url,
        decode_responses=False,
        socket_keepalive=True,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
    )


async def ensure_group(client: aioredis.Redis, keys: Keys, stream: str) -> bool:
    """Create the consumer group at id 0 (with the stream) if missing. True when we created it.

    Id ``0`` rather than ``$`` so entries added before the first worker started are still read.
    Safe to race: whichever side (producer or worker) comes first creates it, the others get
    BUSYGROUP and carry on.
    """
    try:
        await client.xgroup_create(stream, keys.group, id="0", mkstream=True)
    except ResponseError as error:
        if "BUSYGROUP" in str(error):
            return False
        raise
    return True


async def ensure_groups(client: aioredis.Redis, keys: Keys) -> None:
    """Both input streams get the group, so a worker can read them in one XREADGROUP."""
    await ensure_group(client, keys, keys.ingest)
    await ensure_group(client, keys, keys.query)
