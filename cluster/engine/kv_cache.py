"""KV cache: per-sequence slots, plus a prefix cache of whole prompt blocks.

A slot is one sequence's contiguous KV (`capacity` positions). Rolling back rejected draft
tokens is O(1): the sequence's cached length simply moves back, and later writes overwrite.

The prefix cache keeps copies of full prompt blocks in a pool, named by the chained block
hash (cluster.engine.hashing). A hit is copied into the new sequence's slot. Every hit is
checked token by token, so a hash collision or stale directory entry can never serve wrong KV.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from cluster.engine.hashing import block_hashes


@dataclass
class PrefixStats:
    queries: int = 0        # prompt blocks looked up
    hits: int = 0           # prompt blocks served from the pool
    stored: int = 0
    evicted: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class KVCache:
    def __init__(self, num_layers: int, num_slots: int, capacity: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device, block_size: int = 16, prefix_blocks: int = 0, seed: int = 0):
        # one extra physical slot: scratch space for padding rows of captured CUDA graphs
        shape = (num_layers, num_slots + 1, capacity, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.capacity = capacity
        self.num_slots = num_slots
        # fp8 caches: [layers, 3 (q, k, v), num_slots + 1, kv_heads] fp32 scales (cluster.engine.fp8)
        self.scales: torch.Tensor | None = None
        self.free_slots = list(range(num_slots - 1, -1, -1))
        self.block_size = block_size
        self.seed = seed
        self.prefix = PrefixPool(self, prefix_blocks) if prefix_blocks else None

    @property
    def slots_used(self) -> int:
        return self.num_slots - len(self.free_slots)

    def allocate(self) -> int | None:
        return self.free_slots.pop() if self.free_slots else None

    def free(self, slot: int) -> None:
        assert slot not in self.free_slots, f"double free of slot {slot}"
        self.free_slots.append(slot)

    def hashes(self, tokens: list[int]) -> list[int]:
        return block_hashes(tokens, self.block_size, self.seed)


@dataclass
class _Block:
    index: int
    tokens: tuple[int, ...]


class PrefixPool:
    """LRU pool of full prompt blocks; `on_change(stored, evicted)` feeds the KV directory."""

    def __init__(self, cache: KVCache, num_blocks: int):
        c = cache
        shape = (c.k.shape[0], num_blocks, c.block_size, c.k.shape[3], c.k.shape[4])
        self.k = torch.zeros(shape, dtype=c.k.dtype, device=c.k.device)
        self.v = torch.zeros(shape, dtype=c.v.dtype, device=c.v.device)
        self.cache = cache
        self.free = list(range(num_blocks))
        self.blocks: OrderedDict[int, _Block] = OrderedDict()  # hash -> block, LRU order
        self.stats = PrefixStats()
        self.on_change: Callable[[list[int], list[int]], None] | None = None
        self.lock = threading.Lock()

    def hashes(self) -> list[int]:
        """All cached block hashes; safe to call from another thread (the KV directory publisher)."""
        with self.lock:
            return list(self.blocks)

    def _touch(self, hashes: list[int]) -> None:
        """Mark a chain used, deepest first, so LRU evicts a chain from its tail: a prompt's
        first blocks (shared most widely, and needed before any later block can hit) go last."""
        with self.lock:
            for h in reversed(hashes):
                self.blocks.move_to_end(h)

    def load(self, tokens: list[int], slot: int) -> int:
        """Copy the longest cached prefix of `tokens` into `slot`; returns tokens loaded."""
        bs = self.cache.block_size
        hashes = self.cache.hashes(tokens)
        self.stats.queries += len(hashes)
        hit, hit_hashes = [], []
        for i, h in enumerate(hashes):
            b = self.blocks.get(h)
            if b is None or b.tokens != tuple(tokens[i * bs:(i + 1) * bs]):
                break
            hit.append(b.index)
            hit_hashes.append(h)
        self._touch(hit_hashes)
        if hit:
            idx = torch.tensor(hit, device=self.k.device)
            n = len(hit) * bs
            L, _, _, H, D = self.k.shape
            self.cache.k[:, slot, :n] = self.k[:, idx].reshape(L, n, H, D)
            self.cache.v[:, slot, :n] = self.v[:, idx].reshape(L, n, H, D)
        self.stats.hits += len(hit)
        return len(hit) * bs

    def store(self, tokens: list[int], slot: int) -> None:
        """Copy the full prompt blocks of a prefilled slot into the pool (LRU eviction)."""
        bs = self.cache.block_size
        stored, evicted = [], []
        hashes = self.cache.hashes(tokens)
        self._touch([h for h in hashes if h in self.blocks])  # this prompt's blocks evict last
        for i, h in enumerate(hashes):
            if h in self.blocks:
                continue
            if not self.free:
                if not self.blocks:
                    break
                with self.lock:
                    old, blk = self.blocks.popitem(last=False)
                self.free.append(blk.index)
                if old in stored:  # pool smaller than this prompt: it evicts its own blocks
                    stored.remove(old)
                else:
                    evicted.append(old)
            index = self.free.pop()
            self.k[:, index] = self.cache.k[:, slot, i * bs:(i + 1) * bs]
            self.v[:, index] = self.cache.v[:, slot, i * bs:(i + 1) * bs]
            with self.lock:
                self.blocks[h] = _Block(index, tuple(tokens[i * bs:(i + 1) * bs]))
            stored.append(h)
        self._touch([h for h in hashes if h in self.blocks])
        self.stats.stored += len(stored)
        self.stats.evicted += len(evicted)
        if self.on_change and (stored or evicted):
            self.on_change(stored, evicted)
