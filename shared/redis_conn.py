"""Connecting to Redis and creating the consumer group, the same way on every side.

A Redis Cluster is reached through redis-py's cluster client (``EMBEDFLEET_REDIS_CLUSTER=true``
or a ``redis+cluster://`` / ``rediss+cluster://`` URL); it follows MOVED/ASK redirections and
refreshes its slot map after a failover, and everything above it talks to it as to one server.

Every call is bounded in time. A connection built from the settings has a finite read timeout
(``socket_timeout_s``): the longest blocking time its commands ask for plus
EMBEDFLEET_REDIS_SOCKET_TIMEOUT_S, so a hung server (its sockets open, nothing answering) fails
a call as a transient ``TimeoutError`` instead of holding it for ever; blocking calls on the
client side wait at most EMBEDFLEET_BLOCK_MS per call and loop. A caller with a deadline of its
own bounds its calls by it as well (``redis_deadline``, ``RedisRetry.call(deadline=)``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any, cast
from urllib.parse import urlsplit, urlunsplit

import redis
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster as AsyncRedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.cluster import RedisCluster
from redis.exceptions import (
    AskError,
    ClusterError,
    ReadOnlyError,
    RedisClusterException,
    ResponseError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from embedfleet.shared.keys import Keys
from embedfleet.shared.redis_url import split_cluster_url
from embedfleet.shared.settings import Settings

# What a restarting or unreachable server, or a cluster in the middle of a failover or a slot
# migration, looks like to redis-py: wait and try again, never give the work up. (ClusterError
# covers CLUSTERDOWN and MASTERDOWN; AskError covers MOVED; a demoted master answers READONLY;
# RedisClusterException is raised while no node serves a slot.)
TRANSIENT_FAULTS: tuple[type[BaseException], ...] = (
    RedisConnectionError,
    RedisTimeoutError,
    OSError,
    ClusterError,
    TryAgainError,
    AskError,
    ReadOnlyError,
    RedisClusterException,
)


def is_cluster(client: object) -> bool:
    return isinstance(client, (AsyncRedisCluster, RedisCluster))


def longest_block_s(settings: Settings) -> float:
    """The longest a command of a fleet connection blocks by its own asking: a worker's
    XREADGROUP BLOCK, a client's BLPOP (each call waits at most EMBEDFLEET_BLOCK_MS), a
    producer's WAIT for its replicas."""
    return max(settings.block_ms, settings.min_replicas_timeout_ms) / 1000


def socket_timeout_s(settings: Settings) -> float:
    """The read timeout of every connection built from ``settings``: its longest blocking
    command plus EMBEDFLEET_REDIS_SOCKET_TIMEOUT_S. A reply later than that is a hung server."""
    return longest_block_s(settings) + settings.redis_socket_timeout_s


def connect_settings(settings: Settings, **kwargs: Any) -> aioredis.Redis:
    """The asyncio client the settings name: one server, or a cluster, with the settings' read
    timeout (``socket_timeout_s``)."""
    options = {"socket_timeout": socket_timeout_s(settings)} | kwargs
    return connect(settings.effective_redis_url, cluster=settings.redis_cluster, **options)


def connect(url: str, *, cluster: bool = False, **kwargs: Any) -> aioredis.Redis:
    """An asyncio client for ``redis://`` or ``rediss://`` (TLS) URLs, with ACL user/password.

    Responses stay as bytes: payloads are binary msgpack, and decoding is the protocol's job.
    hiredis is picked up automatically by redis-py when installed. With ``cluster`` (or a
    ``+cluster`` scheme) the client is redis-py's ``RedisCluster``, typed as a ``Redis`` here
    because it answers the same commands.
    """
    url, cluster = split_cluster_url(url, cluster)
    # redis-py keyword arguments of many types, passed through to from_url
    options: dict[str, Any] = {
        "decode_responses": False,
        "health_check_interval": 30,
        "socket_keepalive": True,
        # No read timeout for a bare URL (tests, scripts issue blocking reads of any length);
        # every fleet connection comes from the settings (connect_settings,
        # connect_client_settings), which bound it by the longest block they issue.
        "socket_timeout": None,
        "socket_connect_timeout": 10,
    }
    options.update(kwargs)
    if cluster:
        return AsyncRedisCluster.from_url(url, **options)  # type: ignore[return-value]
    return aioredis.Redis.from_url(url, **options)


# An XRANGE (or XREVRANGE) reply as a client of `connect` gets it: ids and fields stay bytes.
StreamEntries = list[tuple[bytes, dict[bytes, bytes]]]


def as_str(value: bytes | str) -> str:
    """A key, field or member as text: redis-py types replies as bytes or str whichever way
    the client decodes; a client of :func:`connect` gets bytes."""
    return value.decode() if isinstance(value, bytes) else value


def stream_entries(reply: object) -> StreamEntries:
    """``reply`` typed as what a client of :func:`connect` receives. redis-py types XRANGE's
    reply for any client (str or bytes, each entry's fields possibly None, the whole None);
    one made with ``decode_responses=False`` gets bytes, and Redis answers an empty range with
    an empty list."""
    return cast("StreamEntries", reply)


def connect_client(url: str, *, cluster: bool = False, **kwargs: Any) -> aioredis.Redis:
    """``connect`` for the client side (producer, CLI verbs), whose retries are all
    ``shared/retry.py``'s: redis-py's own (10 quiet tries in redis-py 8, pipelines included)
    are turned off, so an outage is seen, announced and bounded in one place. The cluster
    client keeps its own: they are how it follows MOVED/ASK and finds a promoted master."""
    url, cluster = split_cluster_url(url, cluster)
    if cluster:
        return connect(url, cluster=True, **kwargs)
    return connect(url, retry=Retry(NoBackoff(), 0), **kwargs)


def connect_client_settings(settings: Settings, **kwargs: Any) -> aioredis.Redis:
    """``connect_client`` for the server (or cluster) the settings name, with the settings'
    read timeout (``socket_timeout_s``)."""
    options = {"socket_timeout": socket_timeout_s(settings)} | kwargs
    return connect_client(settings.effective_redis_url, cluster=settings.redis_cluster, **options)


@contextlib.asynccontextmanager
async def redis_deadline(seconds: float, doing: str) -> AsyncIterator[None]:
    """Bound the Redis calls inside to ``seconds``: past it they are cancelled (redis-py drops
    the connection of a cancelled command) and redis-py's ``TimeoutError`` is raised, a
    transient fault that names what was being done (the gateway answers it 503 with
    Retry-After). Another ``TimeoutError`` raised inside passes through unchanged."""
    bound = asyncio.timeout(seconds)
    try:
        async with bound:
            yield
    except TimeoutError:
        if not bound.expired():
            raise
        raise RedisTimeoutError(
            f"Redis did not answer within {seconds:g}s while trying to {doing}"
        ) from None


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


def connect_sync(url: str, *, timeout_s: float = 5.0, cluster: bool = False) -> redis.Redis:
    """A blocking client for the model thread's short writes (query replies).

    No blocking commands go through it, so a read timeout is safe: a dead server fails the
    write after ``timeout_s`` instead of holding the model thread.
    """
    url, cluster = split_cluster_url(url, cluster)
    factory = RedisCluster.from_url if cluster else redis.Redis.from_url
    return factory(  # type: ignore[return-value]
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
    """Every input stream gets the group: each partition's ingest stream, the query stream and
    the interactive stream."""
    for partition in keys.partitions_keys:
        await ensure_group(client, keys, partition.ingest)
    await ensure_group(client, keys, keys.priority_streams.query)
    await ensure_group(client, keys, keys.priority_streams.interactive)
