"""Early-exit self-drafting: the target's first layers and its own head propose drafts.

No second model and no second KV cache: the drafter runs the target's first `layers` layers
on the target's own cache (each request carries its table row and cached length,
`reads_target_kv`; the drafter is given the target's runner, never the engine, so it runs in
the verifier's process). For those layers a draft token at a position gets exactly the
keys and values the verify pass will write for the same token there, so the drafter's
writes are either rewritten identically or, past a rejection, rolled back with the rest.
Acceptance depends on how much the skipped layers change the prediction: it is measured,
never assumed.
"""

from __future__ import annotations

import time

import torch

from cluster.engine.drafters.base import (TOPK, Drafter, DraftOutput, DraftRequest, draft_keys, draft_uniforms, empty_rows,
                                          one_hot, pick)
from cluster.engine.sampling import target_probs


class EarlyExitDrafter(Drafter):
    name = "early-exit"
    reads_target_kv = True

    def __init__(self, target_runner, layers: int):
        self.runner, self.layers = target_runner, layers

    def propose(self, requests: list[DraftRequest]) -> DraftOutput:
        t0 = time.perf_counter()
        live = [r for r in requests if r.k > 0 and r.target_kv is not None]
        if len(live) < len(requests):  # a sequence not in the target's cache drafts nothing
            out = self.propose(live) if live else DraftOutput([], [], [])
            by_id = {r.seq_id: j for j, r in enumerate(live)}
            rows = [by_id.get(r.seq_id) for r in requests]
            toks = [out.tokens[j] if j is not None else [] for j in rows]
            ids = [out.q_ids[j] if j is not None else one_hot([])[0] for j in rows]
            ps = [out.q_probs[j] if j is not None else one_hot([])[1] for j in rows]
            return DraftOutput(toks, ids, ps, time.perf_counter() - t0)
        rows = [r.target_kv[0] for r in requests]
        lens = [r.target_kv[1] for r in requests]  # == len(tokens) - 1: the last token is not cached yet
        feed = [[r.token_ids[-1]] for r in requests]
        drafts = [[] for _ in requests]
        q_ids, q_probs = [[] for _ in requests], [[] for _ in requests]
        k = max(r.k for r in requests)
        keys = at = greedy = None  # made on the first sampled step
        for step in range(k):
            logits = self.runner.forward(rows, lens, feed, last_only=True, num_layers=self.layers)
            if all(r.params.greedy for r in requests):  # argmax only: no softmax over the vocabulary
                for b, tok in enumerate(logits.argmax(-1).tolist()):
                    if step < requests[b].k:
                        drafts[b].append(tok)
                        q_ids[b].append([tok])
                        q_probs[b].append([1.0])
                lens = [n + 1 for n in lens]
                feed = [[d[-1]] for d in drafts]
                continue
            probs = target_probs(logits, [r.params for r in requests])
            top_p, top_i = probs.topk(min(TOPK, probs.shape[-1]), dim=-1)
            top_p = top_p / top_p.sum(-1, keepdim=True)
            if keys is None:
                keys = torch.tensor(draft_keys(requests), device=top_p.device)
                at = torch.tensor([len(r.token_ids) for r in requests], device=top_p.device)
                greedy = torch.tensor([r.params.greedy for r in requests], device=top_p.device)
            j = pick(top_p, draft_uniforms(keys, at + step)).masked_fill(greedy, 0)
            tok_h, ids_h, ps_h = (t.tolist() for t in (top_i.gather(-1, j[:, None])[:, 0], top_i, top_p))
            for b, r in enumerate(requests):
                if step >= r.k:
                    continue
                if r.params.greedy:
                    q_ids[b].append([tok_h[b]])
                    q_probs[b].append([1.0])
                else:
                    q_ids[b].append(ids_h[b])
                    q_probs[b].append(ps_h[b])
                drafts[b].append(tok_h[b])
            lens = [n + 1 for n in lens]
            feed = [[d[-1]] if d else [0] for d in drafts]
        return DraftOutput(drafts, *empty_rows(drafts, q_ids, q_probs), time.perf_counter() - t0)
