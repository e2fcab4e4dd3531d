"""Draft trees from an EAGLE-3 head, grown as EAGLE-2 grows them.

From the head's output at the last target-fed position, each depth expands the `width` best
nodes of the frontier (by the product of the head's probabilities along the path) into their
`width` most likely children; after the last depth the `gamma` best nodes over all depths are
the tree. A child's score never exceeds its parent's, so the best nodes, ties going to the
shallower, always include every chosen node's parent: the tree is ancestor-closed, and it is
returned parents first (cluster.engine.worker.tree's order).

The head runs one pass per depth over every node grown so far (the tree mask lets each see its
ancestors only, cluster.engine.worker.attention.sdpa_mask): the nodes' keys sit past the target-fed
ones, where the next catch-up overwrites them, and a tree is a few dozen nodes of one layer.
"""

from __future__ import annotations

import torch


def draft_tree(drafter, reqs, states, width: int, max_depth: int = 8) -> list[tuple[list[int], list[int]]]:
    """Per row, (tokens, parents): a tree of r.k nodes (target ids), parents first."""
    head = drafter.head
    B = len(reqs)
    depth_cap = min(max_depth, max(r.k for r in reqs))
    keep = {r.seq_id for r in reqs}
    # nodes per row: (token, parent index or -1, depth, score); head outputs by node (-1: the root)
    nodes: list[list[tuple[int, int, int, float]]] = [[] for _ in range(B)]
    frontier = [[-1] for _ in range(B)]
    outs = [{-1: st.out} for st in states]
    for depth in range(1, depth_cap + 1):
        logits = head.logits(torch.stack([outs[b][i] for b in range(B) for i in frontier[b]]))
        logp = torch.log_softmax(logits, -1)
        top_lp, top_i = logp.topk(width, -1)
        top_t = head.target_ids(top_i).tolist()
        top_lp = top_lp.tolist()
        at, grown = 0, [[] for _ in range(B)]
        for b in range(B):
            for parent in frontier[b]:
                base = nodes[b][parent][3] if parent >= 0 else 0.0
                for j in range(width):
                    grown[b].append((top_t[at][j], parent, depth, base + top_lp[at][j]))
                at += 1
        for b in range(B):  # the frontier's best `width` children become nodes to expand
            best = sorted(grown[b], key=lambda n: -n[3])[:width]
            start = len(nodes[b])
            nodes[b].extend(best)
            frontier[b] = list(range(start, start + len(best)))
        if depth == depth_cap:
            break
        _expand(drafter, states, nodes, outs, keep)
    return [_select(nodes[b], r.k) for b, r in enumerate(reqs)]


def _expand(drafter, states, nodes, outs, keep) -> None:
    """One head pass over every node so far: the head's outputs at the frontier's nodes."""
    head, dev = drafter.head, drafter.device
    T = max(len(n) for n in nodes)
    for st in states:
        drafter._room(st, st.n - st.base + T, keep)
    ids = torch.zeros((len(nodes), T), dtype=torch.int64)
    x = torch.zeros((len(nodes), T, head.cfg.hidden), dtype=drafter.dtype, device=dev)
    depth = torch.zeros((len(nodes), T), dtype=torch.int64)
    mask = torch.eye(T, dtype=torch.bool).repeat(len(nodes), 1, 1)  # padding sees itself only
    for b, ns in enumerate(nodes):
        for i, (tok, parent, d, _) in enumerate(ns):
            ids[b, i] = tok
            x[b, i] = outs[b][parent]
            depth[b, i] = d - 1
            if parent >= 0:
                mask[b, i] |= mask[b, parent]
    out = drafter._pass(states, [st.n - st.base for st in states], ids.to(dev), x, [len(n) for n in nodes],
                        tree=mask.to(dev), depth=depth.to(dev))
    for b in range(len(nodes)):
        outs[b].update({i: out[b, i] for i in range(len(nodes[b]))})


def _select(ns: list[tuple[int, int, int, float]], k: int) -> tuple[list[int], list[int]]:
    """The k best nodes (ancestor-closed), parents first, with parents re-indexed."""
    order = sorted(range(len(ns)), key=lambda i: (-ns[i][3], ns[i][2], i))[:k]
    order.sort(key=lambda i: (ns[i][2], i))
    index = {i: j for j, i in enumerate(order)}
    return [ns[i][0] for i in order], [index[ns[i][1]] if ns[i][1] >= 0 else -1 for i in order]
