"""Tree verification: many candidate continuations checked in one target pass.

A draft tree travels flattened, every node after its parent: `parents[i]` is node i's parent
among the drafts, -1 for the root (the sequence's last token, not yet cached). The verify row
is [root, node 0, node 1, ...]: node i sits at feed index i + 1 and slot position
cache_len + i + 1, but its rotary position is cache_len + depth, and it attends to the cached
prefix and its own ancestors only (`AttnContext.tree_mask`, for backends with `supports_tree`).

Acceptance walks down from the root. At each node it draws a token from the target's
distribution there (greedy: the argmax), from the request's generator and exactly as plain
decoding draws it; if a child holds that token the walk moves on to it, otherwise the token
ends the step. Each emitted token is thus a draw from the target given the tokens before it,
whatever the tree held: lossless for greedy and sampled requests alike, and a seeded request
gets the tokens plain decoding gives it. (This is recursive rejection sampling over siblings
with one-hot proposals: a candidate is accepted with probability p(candidate).)

The accepted nodes' K/V are then copied from their flat positions to consecutive positions
after the root; everything past the accepted path is dropped by the length, as in a chain.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from cluster.engine.sampling import target_probs


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


def walk(parents: list[int], tokens: list[int], draw) -> tuple[list[int], int]:
    """Accepted nodes (draft indices, root to leaf) and the token that follows them.
    `draw(feed_index)` is the target's token at that feed position."""
    children: dict[tuple[int, int], int] = {}
    for i, (p, t) in enumerate(zip(parents, tokens)):
        children.setdefault((p, t), i)  # siblings should be distinct; a duplicate can never win
    path, node = [], -1
    while True:
        token = draw(node + 1)
        nxt = children.get((node, token))
        if nxt is None:
            return path, token
        path.append(nxt)
        node = nxt


def accept_tree(parents: list[int], tokens: list[int], logits: torch.Tensor, params, generator) -> tuple[list[int], int]:
    """logits [n+1, V] at [root] + nodes -> (accepted path, next token). Draws one Exp(1)
    vector per visited node, as `Engine._sample` does per plain decoding step."""
    if params.greedy:
        best = logits.argmax(-1).tolist()
        return walk(parents, tokens, best.__getitem__)
    probs = target_probs(logits, [params], logits.shape[0])
    vocab = probs.shape[-1]

    def draw(i: int) -> int:
        noise = torch.empty(vocab).exponential_(generator=generator).clamp_(min=1e-20).to(probs.device)
        return int((probs[i] / noise).argmax())  # exponential race: a draw from probs[i]

    return walk(parents, tokens, draw)


def keep_path(kv, slot: int, cache_len: int, path: list[int]) -> None:
    """Move the accepted nodes' K/V from feed index i + 1 to consecutive positions."""
    if path == list(range(len(path))):  # already in place (a chain, or the first branch)
        return
    dev = kv.k.device
    src = torch.tensor([cache_len + 1 + i for i in path], device=dev)
    dst = torch.arange(cache_len + 1, cache_len + 1 + len(path), device=dev)
    kv.k[:, slot, dst] = kv.k[:, slot, src]  # the gather is materialised before the write
    kv.v[:, slot, dst] = kv.v[:, slot, src]


def verify_tree(engine, seqs, logits: torch.Tensor, drafts) -> tuple[list[list[int]], list[int]]:
    """Accept a mixed batch: chain rows through the engine's rejection sampler, tree rows by
    the walk. Returns each row's new tokens and the feed index of its last accepted token."""
    from cluster.engine.drafter import DraftOutput

    trees = drafts.parents
    chain = [b for b in range(len(seqs)) if trees[b] is None]
    out: list[list[int]] = [[] for _ in seqs]
    ends = [0] * len(seqs)
    if chain:
        sub = DraftOutput([drafts.tokens[b] for b in chain], [drafts.q_ids[b] for b in chain],
                          [drafts.q_probs[b] for b in chain])
        for b, toks in zip(chain, engine._sample([seqs[b] for b in chain], logits[chain], sub)):
            out[b], ends[b] = toks, len(toks) - 1
    for b, s in enumerate(seqs):
        if trees[b] is None:
            continue
        nodes = drafts.tokens[b]
        path, token = accept_tree(trees[b], nodes, logits[b, : len(nodes) + 1], s.params, s.generator)
        keep_path(engine.kv, s.slot, s.num_cached, path)
        out[b] = [nodes[i] for i in path] + [token]
        ends[b] = path[-1] + 1 if path else 0
    return out, ends
