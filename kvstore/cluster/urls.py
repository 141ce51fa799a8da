"""Which targets name a Redis index (redis://, rediss://, redis+cluster://): known without importing redis, so a
single-node client never needs the ``cluster`` extra."""

from __future__ import annotations

CLUSTER_SCHEMES = ("redis+cluster", "rediss+cluster")
SCHEMES = ("redis", "rediss", *CLUSTER_SCHEMES)


def is_redis_url(target: str) -> bool:
    return target.split("://", 1)[0].lower() in SCHEMES if "://" in target else False
