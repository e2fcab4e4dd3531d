"""KV block directory interface, and the publisher a verifier replica runs.

The directory answers "which live verifier replica already holds the leading blocks of this
prompt?". It is advice for routing, never truth: a replica may have evicted a block since it
published, and a directory outage only costs cache hits. So no method raises to callers:
a backend that cannot reach its store reports `available = False` and answers empty.
"""

from __future__ import annotations

import abc
import asyncio
import logging
import threading
import time
from collections.abc import Callable, Iterable

log = logging.getLogger(__name__)


class KVDirectory(abc.ABC):
    """Which replica holds which chained block hashes (`cluster.engine.scheduling.hashing`)."""

    @abc.abstractmethod
    async def publish(
        self, replica_id: str, stored: list[int], evicted: list[int], *, replace: bool = False
    ) -> bool:
        """Apply a batch of cache changes and mark the replica alive.

        `stored` and `evicted` must be disjoint (BlockPublisher nets them). With `replace`,
        `stored` is the replica's whole block set (a resync) and older entries are dropped.
        Returns whether the batch was applied; False means it was dropped.
        """

    @abc.abstractmethod
    async def heartbeat(self, replica_id: str) -> bool:
        """Keep the replica's entries alive for another TTL.

        Returns True only if this was delivered AND the directory still holds blocks for the
        replica, so a publisher learns that its entries were lost (store restarted, or
        expired while it was cut off) and resends its snapshot.
        """

    @abc.abstractmethod
    async def remove_replica(self, replica_id: str) -> None:
        """Clean shutdown: drop the replica's entries now instead of after the TTL."""

    @abc.abstractmethod
    async def overlap(self, hashes: list[int]) -> dict[str, int]:
        """Live replica -> number of LEADING `hashes` it holds (a gap ends the count).

        Replicas with 0 may be omitted; {} when the directory is unavailable.
        """

    @abc.abstractmethod
    async def close(self) -> None: ...

    @property
    @abc.abstractmethod
    def available(self) -> bool:
        """False while the backing store is unreachable; callers route on load alone."""


class BlockPublisher:
    """Buffers a verifier's cache events and ships them to the directory off the hot path.

    `stored`/`evicted` are sync and only touch a dict, so the engine never waits on the
    network; they take a lock because the engine may run in a thread other than the loop's.
    A background task flushes every `flush_s` in one batch and heartbeats every ttl/3.

    `snapshot` returns every hash the replica holds now. When given, any dropped batch or
    lost directory state is repaired by re-sending the whole set once the directory is
    back; without it, events lost during an outage stay lost until they recur.
    """

    def __init__(
        self,
        directory: KVDirectory,
        replica_id: str,
        ttl_s: float,
        snapshot: Callable[[], Iterable[int]] | None = None,
        flush_s: float = 0.05,
    ):
        self.directory = directory
        self.replica_id = replica_id
        self.heartbeat_s = ttl_s / 3
        self.flush_s = flush_s
        self._snapshot = snapshot
        # hash -> True (stored) / False (evicted); last event wins, so a block stored then
        # evicted within one flush window is sent as evicted only.
        self._pending: dict[int, bool] = {}
        self._lock = threading.Lock()
        # Start with a replace: it clears whatever a previous incarnation left behind.
        self._resync = True
        self._last_sent = float("-inf")
        self._retry_at = float("-inf")
        self._task: asyncio.Task | None = None
        self.batches_sent = 0  # for tests and stats

    def stored(self, hashes: Iterable[int]) -> None:
        with self._lock:
            for h in hashes:
                self._pending[h] = True

    def evicted(self, hashes: Iterable[int]) -> None:
        with self._lock:
            for h in hashes:
                self._pending[h] = False

    def start(self) -> None:
        """Start the background flush task on the running event loop."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        """Stop flushing and remove this replica from the directory."""
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
            self._task = None
        await self.directory.remove_replica(self.replica_id)

    async def _run(self) -> None:
        while True:
            try:
                await self.flush()
            except Exception:  # a bug in snapshot() must not kill the heartbeat for good
                log.exception("kvdir publisher flush failed")
                # The swapped-out batch is gone: resend everything, without spinning.
                self._resync = self._resync or self._snapshot is not None
                self._retry_at = time.monotonic() + 1.0
            await asyncio.sleep(self.flush_s)

    async def flush(self) -> None:
        """One tick: resync, or send pending events, or heartbeat when one is due."""
        with self._lock:
            pending, self._pending = self._pending, {}
        now = time.monotonic()
        if now < self._retry_at:
            # The directory just failed us; a resync will cover these events, and calling
            # snapshot() every tick of an outage would waste the engine's time.
            return
        if self._resync:
            # Pending events were cleared before the snapshot is taken, so any event racing
            # with it lands in the next batch and is applied after the replace.
            if self._snapshot is not None:
                full = list(self._snapshot())
            else:  # nothing to resend; the replace just clears a previous incarnation
                full = [h for h, s in pending.items() if s]
            ok = await self.directory.publish(self.replica_id, full, [], replace=True)
        elif pending:
            stored = [h for h, s in pending.items() if s]
            evicted = [h for h, s in pending.items() if not s]
            ok = await self.directory.publish(self.replica_id, stored, evicted)
        elif now - self._last_sent >= self.heartbeat_s:
            ok = await self.directory.heartbeat(self.replica_id)
        else:
            return
        self._last_sent = now
        if ok:
            self._resync = False
            self.batches_sent += 1
        elif self._snapshot is not None:
            self._resync = True
            self._retry_at = now + min(self.heartbeat_s, 0.5)
