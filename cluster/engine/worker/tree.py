"""Tree verification: many candidate continuations checked in one target pass.

A draft tree travels flattened, every node after its parent: `parents[i]` is node i's parent
among the drafts, -1 for the root (the sequence's last token, not yet cached). The verify row
is [root, node 0, node 1, ...]: node i sits at feed index i + 1 and slot position
cache_len + i + 1, but its rotary position is cache_len + depth, and it attends to the cached
prefix and its own ancestors only (`AttnContext.tree_mask`, for backends with `supports_tree`).

Acceptance walks down from the root (cluster.engine.spec.acceptance). The accepted nodes' K/V are
then copied from their flat positions to consecutive positions after the root; everything
past the accepted path is dropped by the length, as in a chain.
"""

from __future__ import annotations

from functools import lru_cache

import torch


@lru_cache(maxsize=64)
def _layout(parents: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """depth [n+1] and visibility [n+1, n+1] of [root] + nodes (one tree shape, cached)."""
    n = len(parents)
    depth = torch.zeros(n + 1, dtype=torch.int64)
    sees = torch.eye(n + 1, dtype=torch.bool)
    for i, p in enumerate(parents, start=1):
        if not -1 <= p < i - 1:
            raise ValueError(f"tree node {i - 1} has parent {p}: parents must come first")
        depth[i] = depth[p + 1] + 1
        sees[i] |= sees[p + 1]
    return depth, sees


def tree_layout(trees: list[list[int] | None], width: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Depths [B, T] and tree mask [B, T, T] for a verify step; a None row is a chain
    (causal), and so is every row's padding past its tree (its outputs are dropped)."""
    B = len(trees)
    depth = torch.arange(width).repeat(B, 1)
    mask = torch.ones(width, width, dtype=torch.bool).tril().repeat(B, 1, 1)
    for b, parents in enumerate(trees):
        if parents:
            d, sees = _layout(tuple(parents))
            n = len(parents) + 1
            depth[b, :n] = d
            mask[b, :n, :n] = sees
    return depth.to(device), mask.to(device)


def keep_path(kv, handle, cache_len: int, path: list[int]) -> None:
    """Move the accepted nodes' K/V from feed index i + 1 to consecutive positions."""
    if path == list(range(len(path))):  # already in place (a chain, or the first branch)
        return
    kv.copy_slots(kv.host_slots(handle, [cache_len + 1 + i for i in path]),
                  kv.host_slots(handle, list(range(cache_len + 1, cache_len + 1 + len(path)))))
