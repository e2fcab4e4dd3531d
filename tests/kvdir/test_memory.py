"""Memory backend on a fake clock, and BlockPublisher's batching and resync logic driven by
explicit flush() calls (no background task, so every step is deterministic)."""

from __future__ import annotations

import asyncio

import pytest

from cluster.engine.scheduling.hashing import block_hashes, model_seed
from cluster.kvdir import BlockPublisher, MemoryDirectory, make_directory

H = block_hashes(list(range(16 * 8)), 16, model_seed("test-model"))


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class FlakyDirectory(MemoryDirectory):
    """A memory directory that can be switched off, as a Redis outage looks to a publisher."""

    down = False

    async def publish(self, *a, **kw):
        return False if self.down else await super().publish(*a, **kw)

    async def heartbeat(self, replica_id):
        return False if self.down else await super().heartbeat(replica_id)


def test_make_directory_dispatch(ns):
    assert isinstance(make_directory(None, ns, "m", 1.0), MemoryDirectory)
    assert isinstance(make_directory("memory://", ns, "m", 1.0), MemoryDirectory)
    assert type(make_directory("redis://127.0.0.1:1/0", ns, "m", 1.0)).__name__ == "RedisDirectory"
    tls = make_directory("rediss://127.0.0.1:1/0", ns, "m", 1.0, ssl_cert_reqs="none",
                         ssl_ca_certs="/etc/ssl/certs/ca-certificates.crt")
    assert tls.available  # nothing is contacted until first use
    with pytest.raises(ValueError):
        make_directory("http://x", ns, "m", 1.0)


def test_ttl_on_fake_clock(ns):
    async def main():
        clock = Clock()
        d = MemoryDirectory(ns, "m", ttl_s=1.0, clock=clock)
        await d.publish("dead", H, [])
        await d.publish("live", H[:2], [])
        clock.t = 0.9
        assert await d.heartbeat("live")
        clock.t = 1.5  # past "dead"'s deadline, within "live"'s refreshed one
        assert await d.overlap(H) == {"live": 2}
        assert not await d.heartbeat("dead")  # expired entries are gone: caller must resync

    asyncio.run(main())


def test_directories_of_one_namespace_share_state(ns):
    async def main():
        a, b = make_directory(None, ns, "m", 5.0), make_directory("memory://", ns, "m", 5.0)
        await a.publish("r", H, [])
        assert await b.overlap(H) == {"r": 8}
        assert await make_directory(None, ns, "other", 5.0).overlap(H) == {}

    asyncio.run(main())


def test_publisher_first_flush_replaces_previous_incarnation(ns):
    async def main():
        d = MemoryDirectory(ns, "m", 5.0)
        await d.publish("v0", H, [])  # left over from a crashed process with the same id
        pub = BlockPublisher(d, "v0", ttl_s=5.0, snapshot=lambda: H[:2])
        await pub.flush()
        assert await d.overlap(H) == {"v0": 2}

    asyncio.run(main())


def test_publisher_nets_events_into_one_batch(ns):
    async def main():
        d = MemoryDirectory(ns, "m", 5.0)
        pub = BlockPublisher(d, "v0", ttl_s=5.0)
        await pub.flush()  # initial replace
        pub.stored(H[:4])
        pub.evicted(H[2:3])
        pub.stored(H[4:5])
        pub.evicted(H[4:5])  # stored then evicted in one window: sent as evicted
        await pub.flush()
        assert pub.batches_sent == 2
        assert await d.overlap(H) == {"v0": 2}
        await pub.flush()  # nothing pending and no heartbeat due: no batch
        assert pub.batches_sent == 2

    asyncio.run(main())


def test_publisher_resyncs_snapshot_after_outage(ns):
    async def main():
        d = FlakyDirectory(ns, "m", 5.0)
        held = set(H[:2])
        pub = BlockPublisher(d, "v0", ttl_s=5.0, snapshot=lambda: held)
        await pub.flush()
        d.down = True
        held.update(H[2:5])
        pub.stored(H[2:5])
        await pub.flush()  # dropped
        assert pub._resync
        d.down = False
        pub._retry_at = 0.0  # skip the back-off wait instead of sleeping
        await pub.flush()
        assert await d.overlap(H) == {"v0": 5}

    asyncio.run(main())


def test_publisher_heartbeats_when_idle_and_stop_removes(ns):
    async def main():
        # TTLs long enough that a stalled loop on a loaded host does not miss a heartbeat's window
        d = MemoryDirectory(ns, "m", ttl_s=1.5)
        pub = BlockPublisher(d, "v0", ttl_s=1.5, snapshot=lambda: H[:3], flush_s=0.02)
        pub.start()
        await asyncio.sleep(3.0)  # two TTLs with no events: heartbeats alone keep it alive
        assert await d.overlap(H) == {"v0": 3}
        await pub.stop()
        assert await d.overlap(H) == {}

    asyncio.run(main())
