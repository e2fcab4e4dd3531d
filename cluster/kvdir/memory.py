"""In-process KV directory: for one-process runs and tests.

Directories made for the same (cluster, model) share one state, as two Redis clients of one
namespace would; across processes (separate Ray Serve replicas) nothing is shared, so a
multi-process cluster needs the Redis backend.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from cluster.kvdir.base import KVDirectory


@dataclass
class _State:
    blocks: dict[str, set[int]] = field(default_factory=dict)
    # Deadline on the monotonic clock, set by the publisher's own TTL like Redis PEXPIRE.
    deadline: dict[str, float] = field(default_factory=dict)


_STATES: dict[tuple[str, str], _State] = {}


class MemoryDirectory(KVDirectory):
    def __init__(
        self, cluster: str, model: str, ttl_s: float, clock: Callable[[], float] = time.monotonic
    ):
        self.ttl_s = ttl_s
        self._clock = clock
        self._s = _STATES.setdefault((cluster, model), _State())

    @property
    def available(self) -> bool:
        return True

    def _expire(self) -> None:
        now = self._clock()
        for rid in [r for r, d in self._s.deadline.items() if d <= now]:
            del self._s.deadline[rid]
            self._s.blocks.pop(rid, None)

    async def publish(
        self, replica_id: str, stored: list[int], evicted: list[int], *, replace: bool = False
    ) -> bool:
        self._expire()
        blocks = self._s.blocks.setdefault(replica_id, set())
        if replace:
            blocks.clear()
        blocks.update(stored)
        blocks.difference_update(evicted)
        self._s.deadline[replica_id] = self._clock() + self.ttl_s
        return True

    async def heartbeat(self, replica_id: str) -> bool:
        self._expire()
        self._s.deadline[replica_id] = self._clock() + self.ttl_s
        return bool(self._s.blocks.get(replica_id))

    async def remove_replica(self, replica_id: str) -> None:
        self._s.blocks.pop(replica_id, None)
        self._s.deadline.pop(replica_id, None)

    async def overlap(self, hashes: list[int]) -> dict[str, int]:
        self._expire()
        out: dict[str, int] = {}
        for rid, blocks in self._s.blocks.items():
            n = 0
            for h in hashes:
                if h not in blocks:
                    break
                n += 1
            if n:
                out[rid] = n
        return out

    async def close(self) -> None:
        pass
