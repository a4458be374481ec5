"""Connecting to Redis and creating the consumer group, the same way on every side.

A Redis Cluster is reached through redis-py's cluster client (``EMBEDFLEET_REDIS_CLUSTER=true``
or a ``redis+cluster://`` / ``rediss+cluster://`` URL); it follows MOVED/ASK redirections and
refreshes its slot map after a failover, and everything above it talks to it as to one server.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast
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

if TYPE_CHECKING:
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
CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}


def split_cluster_url(url: str, cluster: bool = False) -> tuple[str, bool]:
    """``redis+cluster://host:port`` → (``redis://host:port``, True): the URL redis-py reads, and
    whether it names a cluster (by its scheme or by ``cluster``)."""
    scheme, separator, rest = url.partition("://")
    plain = CLUSTER_SCHEMES.get(scheme.lower())
    if plain is None:
        return url, cluster
    return f"{plain}{separator}{rest}", True


def is_cluster(client: object) -> bool:
    return isinstance(client, (AsyncRedisCluster, RedisCluster))


def connect_settings(settings: Settings, **kwargs: Any) -> aioredis.Redis:
    """The asyncio client the settings name: one server, or a cluster."""
    return connect(settings.effective_redis_url, cluster=settings.redis_cluster, **kwargs)


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
        # Blocking reads (XREADGROUP BLOCK, BLPOP for query replies) wait longer than redis-py's
        # default read timeout; dead connections are found by keepalive and health checks.
        "socket_timeout": None,
        "socket_connect_timeout": 10,
    }
    options.update(kwargs)
    if cluster:
        return AsyncRedisCluster.from_url(url, **options)  # type: ignore[return-value]
    return aioredis.Redis.from_url(url, **options)


# An XRANGE (or XREVRANGE) reply as a client of `connect` gets it: ids and fields stay bytes.
StreamEntries = list[tuple[bytes, dict[bytes, bytes]]]


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
    """``connect_client`` for the server (or cluster) the settings name."""
    return connect_client(settings.effective_redis_url, cluster=settings.redis_cluster, **kwargs)


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
    await ensure_group(client, keys, keys.query_lane.query)
    await ensure_group(client, keys, keys.query_lane.interactive)
