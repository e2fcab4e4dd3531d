"""The paged KV cache's block accounting: one pool of fixed-size blocks per cache.

A sequence holds a block table (block ids in position order). Full blocks are named by the
chained block hash (cluster.engine.scheduling.hashing) once their tokens are final, and shared by every
sequence whose prompt starts with the same tokens: a prefix hit takes a reference on the
block, it never copies KV. A block whose last reference goes stays cached (its hash still
maps to it) on the free list until it is allocated again; allocation takes the least recently
freed block first, so the pool evicts in LRU order. Every hit is checked token by token, so a
hash collision can never serve wrong KV.

`on_change(stored, evicted)` tells the KV directory which hashes became resident and which
left, so what routers read is what the pool really holds.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from cluster.engine.scheduling.hashing import block_hashes


class OutOfBlocks(RuntimeError):
    """The pool cannot hold what was asked; the scheduler preempts and retries."""


@dataclass
class PoolStats:
    queries: int = 0        # prompt blocks looked up
    hits: int = 0           # prompt blocks found cached
    stored: int = 0         # blocks that became cached (hashed)
    evicted: int = 0        # cached blocks reused for other tokens

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


@dataclass
class BlockTable:
    """One sequence's blocks, and the hashes of its leading full blocks that are cached."""
    blocks: list[int] = field(default_factory=list)
    hashes: list[int] = field(default_factory=list)


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, seed: int = 0, prefix_caching: bool = True):
        self.num_blocks, self.block_size, self.seed = num_blocks, block_size, seed
        self.prefix_caching = prefix_caching
        self.refs = [0] * num_blocks
        # free blocks, least recently freed first; a cached one keeps its hash until reused
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))
        self.cached: dict[int, int] = {}             # hash -> block
        self.block_hash: dict[int, int] = {}         # block -> hash
        self.block_tokens: dict[int, tuple[int, ...]] = {}  # block -> its tokens (hit check)
        self.stats = PoolStats()
        self._cached_free = 0
        self.on_change: Callable[[list[int], list[int]], None] | None = None
        self.lock = threading.Lock()  # the directory publisher reads `hashes()` from its thread

    # ---- figures ---------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        """Blocks held by live sequences."""
        return self.num_blocks - len(self.free)

    @property
    def num_cached_free(self) -> int:
        """Free blocks that still hold a reusable prefix (counted as they change: stats are
        read every second, while steps run, and the free list is the whole pool)."""
        return self._cached_free

    def hashes(self) -> list[int]:
        """Every cached block's hash, held or free (thread-safe)."""
        with self.lock:
            return list(self.cached)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- a sequence's life ---------------------------------------------------------------
    def match_prefix(self, table: BlockTable, tokens: list[int]) -> int:
        """Take references on the cached blocks that start `tokens` (at most all but the
        last token's block, so a sequence always computes at least one token and never
        writes into a shared block). Returns the tokens covered."""
        assert not table.blocks, "a prefix is matched into an empty table"
        if not self.prefix_caching:
            return 0
        bs = self.block_size
        usable = (len(tokens) - 1) // bs
        hashes = block_hashes(tokens[: usable * bs], bs, self.seed)
        self.stats.queries += len(tokens) // bs if usable else 0  # the prompt's full blocks
        for i, h in enumerate(hashes):
            b = self.cached.get(h)
            if b is None or self.block_tokens.get(b) != tuple(tokens[i * bs:(i + 1) * bs]):
                break
            self._ref(b)
            table.blocks.append(b)
            table.hashes.append(h)
        self.stats.hits += len(table.blocks)
        return len(table.blocks) * bs

    def can_grow(self, table: BlockTable, num_tokens: int) -> int:
        """Blocks the table lacks to hold `num_tokens` tokens."""
        return max(0, self.blocks_for(num_tokens) - len(table.blocks))

    def grow(self, table: BlockTable, num_tokens: int) -> list[int]:
        """Allocate blocks so the table holds `num_tokens` tokens; returns the new blocks.
        Raises OutOfBlocks (allocating nothing) when the pool has too few."""
        need = self.can_grow(table, num_tokens)
        if need > len(self.free):
            raise OutOfBlocks(f"{need} blocks needed, {len(self.free)} free")
        new = [self._take() for _ in range(need)]
        table.blocks += new
        return new

    def shrink(self, table: BlockTable, num_tokens: int) -> None:
        """Give back blocks past what `num_tokens` tokens need (rejected drafts' room)."""
        keep = self.blocks_for(num_tokens)
        while len(table.blocks) > max(keep, len(table.hashes)):
            self._unref(table.blocks.pop())

    def commit(self, table: BlockTable, tokens: list[int], num_final: int) -> None:
        """Name and cache the table's full blocks within the first `num_final` tokens
        (their KV is computed and their tokens accepted: they never change again)."""
        if not self.prefix_caching:
            return
        bs = self.block_size
        full = min(num_final // bs, len(table.blocks))
        if full <= len(table.hashes):
            return
        prev = table.hashes[-1] if table.hashes else self.seed
        stored = []
        for i in range(len(table.hashes), full):
            block_tokens = tuple(tokens[i * bs:(i + 1) * bs])
            h = block_hashes(block_tokens, bs, prev)[0]
            prev = h
            table.hashes.append(h)
            b = table.blocks[i]
            if h in self.cached:  # another sequence cached the same tokens first: keep its block
                continue
            with self.lock:
                self.cached[h] = b
            self.block_hash[b], self.block_tokens[b] = h, block_tokens
            stored.append(h)
        self.stats.stored += len(stored)
        if stored and self.on_change:
            self.on_change(stored, [])

    def release(self, table: BlockTable) -> None:
        """The sequence is done or preempted: drop its references, tail first, so a chain's
        deepest blocks are evicted before the prefix others are most likely to share."""
        while table.blocks:
            self._unref(table.blocks.pop())
        table.hashes.clear()

    # ---- blocks --------------------------------------------------------------------------
    def _ref(self, b: int) -> None:
        if self.refs[b] == 0:
            del self.free[b]
            self._cached_free -= b in self.block_hash
        self.refs[b] += 1

    def _unref(self, b: int) -> None:
        self.refs[b] -= 1
        assert self.refs[b] >= 0, f"block {b} released twice"
        if self.refs[b] == 0:
            self.free[b] = None  # most recently freed: evicted last
            self._cached_free += b in self.block_hash

    def _take(self) -> int:
        b, _ = self.free.popitem(last=False)
        self.refs[b] = 1
        h = self.block_hash.pop(b, None)
        if h is not None:  # a cached block goes to new tokens: its prefix leaves the pool
            self._cached_free -= 1
            self.block_tokens.pop(b, None)
            with self.lock:
                if self.cached.get(h) == b:
                    del self.cached[h]
            self.stats.evicted += 1
            if self.on_change:
                self.on_change([], [h])
        return b
