"""A Redis URL's cluster scheme: ``redis+cluster://`` and ``rediss+cluster://`` name a Redis
Cluster; redis-py reads the plain scheme. Settings and the connection helpers both read it."""

from __future__ import annotations

CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}


def split_cluster_url(url: str, cluster: bool = False) -> tuple[str, bool]:
    """``redis+cluster://host:port`` → (``redis://host:port``, True): the URL redis-py reads, and
    whether it names a cluster (by its scheme or by ``cluster``)."""
    scheme, separator, rest = url.partition("://")
    plain = CLUSTER_SCHEMES.get(scheme.lower())
    if plain is None:
        return url, cluster
    return f"{plain}{separator}{rest}", True
