"""Acceptance: which drafts stand and which token follows, for chains and trees, greedy and
sampled, behind one call.

A chain row is [last token, d_1 .. d_g]: Leviathan et al. rejection sampling over the
target's probabilities at those g+1 positions (`sampling.rejection_sample`). A greedy batch
takes a shortcut with the same result: a one-hot target accepts drafts while they equal its
argmax and adds the argmax at the first miss, with no vocabulary-sized tensors.

A tree row (see cluster.engine.worker.tree for its layout) is walked from the root: at each node
the target's token there is drawn exactly as plain decoding draws it (the argmax, or an
exponential race with the request's generator); if a child holds that token the walk moves
on, otherwise the token ends the step. Each emitted token is thus a draw from the target
given the tokens before it, whatever the tree held. (It is recursive rejection sampling over
siblings with one-hot proposals: a candidate is accepted with probability p(candidate).)

Randomness comes only from each seeded request's own generator, so a seed reproduces its
output; unseeded rows draw together from the device's default generator (sampling.fill_draws).
The engine makes it on its device: a sampled row's Exp(1) vector over the vocabulary (128k
values at Llama-3 size) is drawn there, where a CPU generator drew it on the host and copied
it over, row by row, every step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from cluster.engine.drafters.base import DraftOutput, accept_uniforms
from cluster.engine.sampling import SamplingParams, device_values, draw, fill_draws, rejection_sample, target_probs


@dataclass
class Accepted:
    tokens: list[list[int]]   # per row: the accepted drafts, then the one token that follows
    paths: list[list[int]]    # per row: indices of the accepted drafts among the row's drafts

    def last_fed(self, b: int) -> int:
        """Feed index (0 = the row's last token) of row b's last accepted position."""
        return self.paths[b][-1] + 1 if self.paths[b] else 0


def accept(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator],
           drafts: DraftOutput, starts: list[int] | None = None) -> Accepted:
    """logits [B, T, V] fp32 at each row's fed positions ([last token] + drafts) -> Accepted.
    `starts`: each row's first draft's position (its acceptance tests' uniforms are keyed by
    position, accept_uniforms; default 0)."""
    trees = drafts.parents or [None] * len(params)
    chain = [b for b, t in enumerate(trees) if t is None]
    tokens: list[list[int]] = [[] for _ in params]
    paths: list[list[int]] = [[] for _ in params]
    if chain:
        sub = [drafts.tokens[b] for b in chain]
        none = [None] * len(params)  # rows with no drafts carry no proposals
        q = ([(drafts.q_ids or none)[b] for b in chain], [(drafts.q_probs or none)[b] for b in chain])
        rows = logits if len(chain) == len(params) else logits[chain]
        at = [(starts or [0] * len(params))[b] for b in chain]
        for b, toks in zip(chain, _accept_chains(rows, [params[b] for b in chain], [generators[b] for b in chain],
                                                 sub, *q, at)):
            tokens[b], paths[b] = toks, list(range(len(toks) - 1))
    for b, parents in enumerate(trees):
        if parents is not None:
            nodes = drafts.tokens[b]
            path, token = accept_tree(parents, nodes, logits[b, : len(nodes) + 1], params[b], generators[b])
            tokens[b], paths[b] = [nodes[i] for i in path] + [token], path
    return Accepted(tokens, paths)


def _accept_chains(logits, params, generators, drafts, q_ids, q_probs, starts) -> list[list[int]]:
    B, vocab = len(params), logits.shape[-1]
    G = max((len(t) for t in drafts), default=0)
    dev = logits.device
    if not G:  # plain rows: the draw a step run ahead makes too (cluster.engine.worker.pipeline)
        return [[t] for t in draw(logits[:, 0], params, generators).tolist()]
    if all(p.greedy for p in params):
        best = logits[:, : G + 1].argmax(-1)
        # drafts stand while they equal the argmax: one comparison over the batch, not a loop a row
        padded = device_values([list(t) + [-1] * (G - len(t)) for t in drafts], torch.int64, dev)
        num_acc = (best[:, :G] == padded).int().cumprod(-1).sum(-1).tolist()
        return [row[: n + 1] for row, n in zip(best.tolist(), num_acc)]
    p = target_probs(logits[:, : G + 1].reshape(-1, vocab), params, G + 1).view(B, G + 1, vocab)
    # every row's proposals in one array each: one copy to the device and one scatter into q,
    # not two copies and a scatter a row. No copy here waits for the GPU (device_values): the
    # host queues all of acceptance behind the verify pass, and only reading the tokens waits
    width = max((q_ids[b].shape[1] for b, t in enumerate(drafts) if t), default=1)
    ids = np.zeros((B, G, width), np.int64)
    probs = np.zeros((B, G, width), np.float32)
    draft_ids = np.full((B, G), -1, np.int64)
    for b, t in enumerate(drafts):
        if t:
            n, k = len(t), q_ids[b].shape[1]
            draft_ids[b, :n], ids[b, :n, :k], probs[b, :n, :k] = t, q_ids[b][:n], q_probs[b][:n]
    q = torch.zeros((B, G, vocab), device=dev).scatter_add_(
        -1, device_values(ids, torch.int64, dev), device_values(probs, torch.float32, dev))
    # greedy rows are one-hot and need no randomness: accept iff p(d) > 0, i.e. d is the argmax.
    # The tests' uniforms are keyed by position: a row's stream holds one vector a step.
    uniform = accept_uniforms(params, device_values(starts, torch.int64, dev)[:, None] + torch.arange(G, device=dev))
    noise = fill_draws(torch.ones((B, vocab), device=dev), params, generators, "exponential").clamp_(min=1e-20)
    num_draft = device_values([len(t) for t in drafts], torch.int64, dev)
    out, num_acc = rejection_sample(device_values(draft_ids, torch.int64, dev), num_draft, q, p, uniform, noise)
    return [row[: n + 1] for row, n in zip(out.tolist(), num_acc.tolist())]


def walk(parents: list[int], tokens: list[int], token_at) -> tuple[list[int], int]:
    """Accepted nodes (draft indices, root to leaf) and the token that follows them.
    `token_at(feed_index)` is the target's token at that feed position."""
    children: dict[tuple[int, int], int] = {}
    for i, (p, t) in enumerate(zip(parents, tokens)):
        children.setdefault((p, t), i)  # siblings should be distinct; a duplicate can never win
    path, node = [], -1
    while True:
        token = token_at(node + 1)
        nxt = children.get((node, token))
        if nxt is None:
            return path, token
        path.append(nxt)
        node = nxt


def accept_tree(parents: list[int], tokens: list[int], logits: torch.Tensor, params: SamplingParams,
                generator: torch.Generator | None) -> tuple[list[int], int]:
    """logits [n+1, V] at [root] + nodes -> (accepted path, next token). Draws one Exp(1)
    vector per visited node, as a plain decoding step does."""
    if params.greedy:
        best = logits.argmax(-1).tolist()
        return walk(parents, tokens, best.__getitem__)
    probs = target_probs(logits, [params], logits.shape[0])
    vocab = probs.shape[-1]

    def race(i: int) -> int:
        noise = torch.empty(vocab, device=probs.device).exponential_(generator=generator).clamp_(min=1e-20)
        return int((probs[i] / noise).argmax())  # exponential race: a draw from probs[i]

    return walk(parents, tokens, race)
