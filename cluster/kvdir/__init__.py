"""KV block directory: which verifier replica holds which prefix blocks (routing advice)."""

from __future__ import annotations

import os

from cluster.kvdir.base import BlockPublisher, KVDirectory
from cluster.kvdir.memory import MemoryDirectory

__all__ = ["BlockPublisher", "KVDirectory", "MemoryDirectory", "make_directory"]


def make_directory(
    url: str | None, cluster: str, model: str, ttl_s: float, **redis_options
) -> KVDirectory:
    """None or "memory://" -> in-process; "redis://" / "rediss://" -> Redis.

    `redis_options` go to RedisDirectory (timeouts, ssl_cert_reqs, ssl_ca_certs, password).
    A password in the URL wins; else REDIS_PASSWORD from the environment is used, so the
    secret can stay out of config files.
    """
    if url is None or url == "memory://":
        return MemoryDirectory(cluster, model, ttl_s)
    if url.startswith(("redis://", "rediss://")):
        # Imported here so memory-only processes never load redis.
        from cluster.kvdir.redis_backend import RedisDirectory

        if os.environ.get("REDIS_PASSWORD"):
            redis_options.setdefault("password", os.environ["REDIS_PASSWORD"])
        return RedisDirectory(url, cluster, model, ttl_s, **redis_options)
    raise ValueError(f"unsupported kv directory url {url!r} (memory://, redis://, rediss://)")
