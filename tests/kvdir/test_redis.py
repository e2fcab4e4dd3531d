"""KV directory against a real local Redis-protocol server; the semantic tests also run on the
memory backend, so both backends are held to one contract."""

from __future__ import annotations

import asyncio
import os
import time

import pytest

from cluster.engine.scheduling.hashing import block_hashes, model_seed
from cluster.kvdir import BlockPublisher, make_directory
from cluster.kvdir.embedded import free_port, start_local_server

H = block_hashes(list(range(16 * 8)), 16, model_seed("test-model"))  # 8 chained hashes
FAST = dict(retry_s=0.1)  # recovery probes in tests should not wait a second


@pytest.fixture(params=["memory", "redis"])
def make(request, ns):
    url = "memory://" if request.param == "memory" else request.getfixturevalue("redis_url")
    opts = FAST if request.param == "redis" else {}

    def make_dir(model="m", ttl_s=5.0, cluster=ns):
        return make_directory(url, cluster, model, ttl_s, **opts)

    return make_dir


async def eventually(cond, timeout_s: float = 5.0, step_s: float = 0.02):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await cond():
            return True
        await asyncio.sleep(step_s)
    return False


def test_leading_overlap_stops_at_gap(make):
    async def main():
        d = make()
        await d.publish("full", H, [])
        await d.publish("gap", H[:3] + H[4:], [])  # holds block 3's successors, not block 3
        await d.publish("no_head", H[1:], [])  # everything but the first block
        got = await d.overlap(H)
        assert got == {"full": 8, "gap": 3}
        assert (await d.overlap(H[:2]))["gap"] == 2
        assert await d.overlap([]) == {}
        await d.close()

    asyncio.run(main())


@pytest.mark.parametrize("gap", [1, 63, 64, 65, 128, 299])
def test_long_prompt_gap_across_chunks(make, gap):
    long = block_hashes(list(range(16 * 300)), 16, model_seed("long"))

    async def main():
        d = make()
        await d.publish("gap", long[:gap] + long[gap + 1 :], [])
        await d.publish("full", long, [])
        assert await d.overlap(long) == {"gap": gap, "full": 300}
        await d.close()

    asyncio.run(main())


def test_eviction_shortens_overlap(make):
    async def main():
        d = make()
        await d.publish("r", H, [])
        await d.publish("r", [], H[5:6])
        assert await d.overlap(H) == {"r": 5}
        await d.publish("r", [], H[:1])
        assert await d.overlap(H) == {}
        await d.close()

    asyncio.run(main())


def test_dead_replica_expires_live_one_stays(make):
    async def main():
        d = make(ttl_s=2.0)  # a 1.5 s stall of this loop on a loaded host still heartbeats in time
        await d.publish("dead", H, [])
        await d.publish("live", H[:4], [])
        for _ in range(6):  # "live" heartbeats every 0.5 s; "dead" goes silent past its TTL
            await asyncio.sleep(0.5)
            assert await d.heartbeat("live")
        assert await d.overlap(H) == {"live": 4}
        assert not await d.heartbeat("dead")  # its entries are gone: the caller must resync
        await d.close()

    asyncio.run(main())


def test_remove_replica_is_immediate(make):
    async def main():
        d = make()
        await d.publish("a", H, [])
        await d.publish("b", H[:2], [])
        await d.remove_replica("a")
        assert await d.overlap(H) == {"b": 2}
        await d.close()

    asyncio.run(main())


def test_replace_drops_stale_entries(make):
    async def main():
        d = make()
        await d.publish("r", H, [])
        await d.publish("r", H[:2], [], replace=True)
        assert await d.overlap(H) == {"r": 2}
        await d.close()

    asyncio.run(main())


def test_namespaces_are_isolated(make, ns):
    async def main():
        a, b, c = make("model-a"), make("model-b"), make("model-a", cluster=ns + "-other")
        await a.publish("r", H, [])
        assert await a.overlap(H) == {"r": 8}
        assert await b.overlap(H) == {}
        assert await c.overlap(H) == {}
        for d in (a, b, c):
            await d.close()

    asyncio.run(main())


def test_publisher_batches_and_nets_events(make):
    async def main():
        pub_dir, router = make(), make()
        pub = BlockPublisher(pub_dir, "v0", ttl_s=5.0, flush_s=0.05)
        pub.start()
        assert await eventually(lambda: _ready(pub))  # the initial replace went out
        sent = pub.batches_sent
        for h in H:  # many hot-path calls inside one flush window...
            pub.stored([h])
        pub.evicted(H[6:7])  # ...and a store then evict of the same block nets to evicted
        assert await eventually(lambda: _eq(router, H, {"v0": 6}))
        assert pub.batches_sent - sent == 1  # ...go out as one batch
        await pub.stop()
        assert await router.overlap(H) == {}
        await pub_dir.close()
        await router.close()

    asyncio.run(main())


async def _ready(pub):
    return pub.batches_sent >= 1


async def _eq(d, hashes, want):
    return await d.overlap(hashes) == want


def test_redis_outage_then_recovery(ns):
    """Kill the server mid-run: no exception, {} and available=False; restart it on the same
    port: the directory recovers by itself and the publisher re-sends its snapshot."""

    async def main(url, port):
        held: set[int] = set(H[:4])
        pub_dir = make_directory(url, ns, "m", 5.0, **FAST)
        router = make_directory(url, ns, "m", 5.0, **FAST)
        pub = BlockPublisher(pub_dir, "v0", ttl_s=5.0, snapshot=lambda: held, flush_s=0.02)
        pub.start()
        assert await eventually(lambda: _eq(router, H, {"v0": 4}))

        stop(hard=True)
        t0 = time.monotonic()
        assert await router.overlap(H) == {}
        assert await router.overlap(H) == {}
        assert time.monotonic() - t0 < 0.5  # a dead Redis must not stall a router
        assert not router.available
        held.update(H[4:6])  # the cache keeps changing during the outage
        pub.stored(H[4:6])
        assert await pub_dir.publish("x", H, []) is False
        await pub.flush()  # dropped, no exception
        assert not pub_dir.available

        restart(port)
        assert await eventually(lambda: _eq(router, H, {"v0": 6}))  # snapshot re-sent
        assert router.available and pub_dir.available
        await pub.stop()
        await pub_dir.close()
        await router.close()

    servers = []

    def restart(port):
        servers.append(start_local_server(port=port)[1])

    port = free_port()
    url, stop = start_local_server(port=port)
    try:
        asyncio.run(main(url, port))
    finally:
        stop()
        for s in servers:
            s()


def test_lost_state_is_detected_by_heartbeat(redis_url, ns):
    """Redis restarted between two ticks (or evicted our keys): no op failed, but the next
    heartbeat finds the set gone and the publisher re-sends its snapshot."""
    import redis

    async def main():
        pub_dir, router = (make_directory(redis_url, ns, "m", 0.6, **FAST) for _ in range(2))
        pub = BlockPublisher(pub_dir, "v0", ttl_s=0.6, snapshot=lambda: H[:3], flush_s=0.02)
        pub.start()
        assert await eventually(lambda: _eq(router, H, {"v0": 3}))
        redis.from_url(redis_url).delete(f"sc:{{{ns}:m}}:blocks:v0")
        assert await router.overlap(H) == {}
        assert await eventually(lambda: _eq(router, H, {"v0": 3}), timeout_s=2.0)
        await pub.stop()
        await pub_dir.close()
        await router.close()

    asyncio.run(main())


def test_password_auth(ns):
    url, stop = start_local_server(password="s3cret pass")
    try:

        async def main():
            good = make_directory(url, ns, "m", 5.0)
            await good.publish("r", H, [])
            assert await good.overlap(H) == {"r": 8} and good.available
            bad = make_directory(url.replace("s3cret%20pass", "wrong"), ns, "m", 5.0)
            assert await bad.overlap(H) == {} and not bad.available  # logged, not raised
            assert await bad.publish("r", H, []) is False
            no_pw = url.replace(":s3cret%20pass@", "")
            os.environ["REDIS_PASSWORD"] = "s3cret pass"
            try:
                from_env = make_directory(no_pw, ns, "m", 5.0)
            finally:
                del os.environ["REDIS_PASSWORD"]
            assert await from_env.overlap(H) == {"r": 8}
            for d in (good, bad, from_env):
                await d.close()

        asyncio.run(main())
    finally:
        stop()


def test_hung_server_is_bounded():
    """A server that accepts but never answers costs one op timeout, then answers at once."""
    import socket

    with socket.socket() as hung:
        hung.bind(("127.0.0.1", 0))
        hung.listen(8)  # the kernel completes connects; nobody ever reads or replies
        url = f"redis://127.0.0.1:{hung.getsockname()[1]}/0"

        async def main():
            d = make_directory(url, "c", "m", 5.0, op_timeout_s=0.2)
            t0 = time.monotonic()
            assert await d.overlap(H) == {}
            assert await d.overlap(H) == {}
            assert await d.publish("r", H, []) is False
            assert time.monotonic() - t0 < 0.5
            assert not d.available
            await d.close()

        asyncio.run(main())
