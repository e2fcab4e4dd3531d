"""Paged KV cache: one pool of fixed-size blocks, a block table per sequence.

Keys and values live in `[layers, blocks + 1, block_size, kv_heads, head_dim]`; a sequence's
token at position p sits in block `table[p // block_size]` at offset `p % block_size`. The
tables of all live sequences are rows of one device tensor (`tables`), so attention kernels
and CUDA graphs find any sequence's keys from its row index alone, and a step copies nothing
but its rows' indices and lengths. Block accounting (allocation, prefix sharing by the block
hash, LRU eviction of cached blocks) is cluster.engine.scheduling.block_pool.

The last block is scratch: unallocated table entries and padding rows point at it, so the
writes of padded positions (CUDA graph rows, rows shorter than their step's width) land
there and never in another sequence's blocks. No real query reads a position past its own
tokens, so nothing reads the scratch block.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cluster.engine.scheduling.block_pool import BlockPool, BlockTable


@dataclass
class KVHandle:
    """What one sequence (or a drafter's copy of one) holds in a cache."""
    row: int
    table: BlockTable = field(default_factory=BlockTable)


class KVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, kv_heads: int, head_dim: int,
                 dtype: torch.dtype, device, max_rows: int, max_tokens: int, seed: int = 0,
                 prefix_caching: bool = True):
        """max_rows: sequences held at once; max_tokens: positions a row can address (its
        table's width in tokens, spare positions for padded writes included)."""
        shape = (num_layers, num_blocks + 1, block_size, kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.block_size, self.scratch_block = block_size, num_blocks
        self.pool = BlockPool(num_blocks, block_size, seed, prefix_caching)
        self.max_blocks = -(-max_tokens // block_size)
        self.max_tokens = self.max_blocks * block_size
        self.max_rows = max_rows
        self.tables = torch.full((max_rows + 1, self.max_blocks), num_blocks, dtype=torch.int32, device=device)
        self.scratch_row = max_rows
        self.free_rows = list(range(max_rows - 1, -1, -1))
        # (row, column) -> block, not yet on the device; the latest change of an entry wins
        self._updates: dict[tuple[int, int], int] = {}
        # fp8 caches: [layers, 3 (q, k, v)] fp32 scales on the host (cluster.engine.worker.fp8): 0-d
        # host tensors act as numbers in device arithmetic, and kernels take them as constants
        self.scales: torch.Tensor | None = None
        self.handles: list[KVHandle] = []  # a dense cache's rows (KVCache.dense)
        # slot copies (src, dst) not yet sent: a tensor-parallel rank 0 sets a list and sends
        # them to its followers before the next pass (cluster.engine.distributed.ranks); None: not kept
        self.moved: list[tuple[int, int]] | None = None

    @classmethod
    def dense(cls, num_layers: int, num_rows: int, max_tokens: int, kv_heads: int, head_dim: int,
              dtype: torch.dtype, device, block_size: int = 16) -> "KVCache":
        """Rows 0 .. num_rows-1, each holding blocks for `max_tokens` positions from the start:
        for callers that address fixed sequences (training, checks) rather than schedule them."""
        per_row = -(-max_tokens // block_size)
        kv = cls(num_layers, num_rows * per_row, block_size, kv_heads, head_dim, dtype, device, num_rows, max_tokens,
                 prefix_caching=False)
        kv.handles = [kv.open() for _ in range(num_rows)]
        for h in kv.handles:
            kv.grow(h, max_tokens)
        kv.sync()
        return kv

    @property
    def rows_used(self) -> int:
        return self.max_rows - len(self.free_rows)

    def held(self) -> tuple[int, int]:
        """(rows, blocks) held by live sequences: (0, 0) once every sequence has ended."""
        return self.rows_used, self.pool.num_used

    # ---- sequences -----------------------------------------------------------------------
    def open(self) -> KVHandle | None:
        """A row for a new sequence (no blocks yet); None when every row is taken."""
        return KVHandle(self.free_rows.pop()) if self.free_rows else None

    def match_prefix(self, h: KVHandle, tokens: list[int]) -> int:
        """Share the cached blocks that start `tokens`; returns the tokens they hold."""
        n = self.pool.match_prefix(h.table, tokens)
        self._set(h, 0)
        return n

    # grow, shrink and commit run for every row of every step and mostly have nothing to
    # do: each first checks that in place (the same test the pool makes) before calling it

    def blocks_needed(self, h: KVHandle, num_tokens: int) -> int:
        need = -(-min(num_tokens, self.max_tokens) // self.block_size) - len(h.table.blocks)
        return need if need > 0 else 0

    def grow(self, h: KVHandle, num_tokens: int) -> None:
        """Blocks for the first `num_tokens` positions (OutOfBlocks if the pool lacks them)."""
        start = len(h.table.blocks)
        if start * self.block_size >= min(num_tokens, self.max_tokens):
            return
        self.pool.grow(h.table, min(num_tokens, self.max_tokens))
        self._set(h, start)

    def shrink(self, h: KVHandle, num_tokens: int) -> None:
        """Give back blocks past the first `num_tokens` positions."""
        t = h.table
        before = len(t.blocks)
        if before <= len(t.hashes) or before * self.block_size < num_tokens + self.block_size:
            return  # nothing past what num_tokens need (or the cached prefix) to give back
        self.pool.shrink(t, num_tokens)
        self._reset(h.row, len(t.blocks), before)

    def commit(self, h: KVHandle, tokens: list[int], num_final: int) -> None:
        if num_final // self.block_size > len(h.table.hashes):  # a block became full and final
            self.pool.commit(h.table, tokens, num_final)

    def close(self, h: KVHandle) -> None:
        """Release the sequence's blocks (cached ones stay reusable) and its row."""
        n = len(h.table.blocks)
        self.pool.release(h.table)
        self._reset(h.row, 0, n)
        assert h.row not in self.free_rows, f"row {h.row} closed twice"
        self.free_rows.append(h.row)

    # ---- device side ---------------------------------------------------------------------
    def sync(self) -> None:
        """Apply the table changes since the last step to the device tensor (one copy)."""
        if self._updates:
            self.apply_updates(self.take_updates())

    def take_updates(self) -> torch.Tensor:
        """The table changes since the last step as host int64 [3, U] (row, column, block),
        forgotten here: a tensor-parallel rank 0 sends them to its followers' mirrors."""
        if not self._updates:
            return torch.zeros((3, 0), dtype=torch.int64)
        (r, c), b = zip(*self._updates), list(self._updates.values())
        self._updates.clear()
        return torch.tensor([r, c, b], dtype=torch.int64)

    def apply_updates(self, host: torch.Tensor) -> None:
        if self.tables.is_cuda:  # from pinned memory: a pageable copy would wait for the GPU
            host = host.pin_memory()
        idx = host.to(self.tables.device, non_blocking=True)
        self.tables[idx[0], idx[1]] = idx[2].to(torch.int32)

    def slots(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Flat cache index (block * block_size + offset) of each position [B, T] of each row [B]."""
        return slot_index(self.tables, rows, positions, self.block_size)

    def copy_slots(self, src: list[int], dst: list[int]) -> None:
        """Copy the K/V at flat slots src to slots dst in every layer (a tree's accepted path
        moving up behind its root)."""
        dev = self.k.device
        s, d = torch.tensor(src, device=dev), torch.tensor(dst, device=dev)
        for cache in (self.k, self.v):
            flat = cache.view(cache.shape[0], -1, *cache.shape[3:])
            flat[:, d] = flat[:, s]  # the gather is materialised before the write
        if self.moved is not None:
            self.moved += zip(src, dst)

    def host_slots(self, h: KVHandle, positions: list[int]) -> list[int]:
        bs = self.block_size
        return [h.table.blocks[p // bs] * bs + p % bs for p in positions]

    def _set(self, h: KVHandle, start: int) -> None:
        self._updates.update({(h.row, i): b for i, b in enumerate(h.table.blocks[start:], start)})

    def _reset(self, row: int, start: int, end: int) -> None:
        self._updates.update({(row, i): self.scratch_block for i in range(start, end)})


def slot_index(tables: torch.Tensor, rows: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """Through block tables [R, max_blocks]: the flat cache index of positions [B, T] of rows [B]
    (positions past a table's width clamp to its last entry; no caller goes there)."""
    col = (positions // block_size).clamp(max=tables.shape[1] - 1)
    return tables[rows[:, None], col].long() * block_size + positions % block_size


def block_bytes(num_layers: int, block_size: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
    """Bytes of one block's keys and values over all layers."""
    return 2 * num_layers * block_size * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
