"""Early-exit self-drafting: the target's first layers and its own head propose drafts.

No second model and no second KV cache: the drafter runs the target's first `layers` layers
on the target's own slots. For those layers a draft token at a position gets exactly the
keys and values the verify pass will write for the same token there, so the drafter's
writes are either rewritten identically or, past a rejection, rolled back with the rest.
Acceptance depends on how much the skipped layers change the prediction: it is measured,
never assumed.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from cluster.engine.drafter import TOPK, Drafter, DraftOutput, DraftRequest, one_hot
from cluster.engine.sampling import target_probs


class EarlyExitDrafter(Drafter):
    name = "early-exit"

    def __init__(self, engine, layers: int):
        self.engine, self.layers = engine, layers

    def propose(self, requests: list[DraftRequest]) -> DraftOutput:
        t0 = time.perf_counter()
        seqs = [self.engine.seqs[r.seq_id] for r in requests]
        slots = [s.slot for s in seqs]
        lens = [s.num_cached for s in seqs]  # == len(tokens) - 1: the last token is not cached yet
        feed = [[s.token_ids[-1]] for s in seqs]
        drafts = [[] for _ in requests]
        q_ids, q_probs = [[] for _ in requests], [[] for _ in requests]
        k = max(r.k for r in requests)
        for step in range(k):
            logits = self.engine.runner.forward(slots, lens, feed, last_only=True, num_layers=self.layers)
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
            greedy = top_i[:, 0].tolist()
            for b, r in enumerate(requests):
                if step >= r.k:
                    continue
                if r.params.greedy:
                    tok = greedy[b]
                    q_ids[b].append([tok])
                    q_probs[b].append([1.0])
                else:
                    j = int(torch.multinomial(top_p[b].cpu(), 1, generator=seqs[b].generator))
                    tok = int(top_i[b, j])
                    q_ids[b].append(top_i[b].tolist())
                    q_probs[b].append(top_p[b].tolist())
                drafts[b].append(tok)
            lens = [n + 1 for n in lens]
            feed = [[d[-1]] if d else [0] for d in drafts]
        ids = [np.asarray(x, np.int32).reshape(len(d), -1) if d else one_hot([])[0] for x, d in zip(q_ids, drafts)]
        ps = [np.asarray(x, np.float32).reshape(len(d), -1) if d else one_hot([])[1] for x, d in zip(q_probs, drafts)]
        return DraftOutput(drafts, ids, ps, time.perf_counter() - t0)
