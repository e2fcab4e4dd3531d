"""Prompt lookup: model-free drafts from the sequence's own earlier tokens."""

from __future__ import annotations

import time

import numpy as np

from cluster.engine.drafters.base import Drafter, DraftOutput, DraftRequest, one_hot


class NgramDrafter(Drafter):
    """Find the latest earlier occurrence of the sequence's last n tokens (n from max_n down
    to min_n) and propose what followed it. Stateless, so it runs anywhere."""

    name = "ngram"

    def __init__(self, max_n: int = 3, min_n: int = 1):
        self.max_n, self.min_n = max_n, min_n

    def propose(self, requests: list[DraftRequest]) -> DraftOutput:
        t0 = time.perf_counter()
        toks = [self._lookup(np.asarray(r.token_ids, np.int64), r.k) if r.k > 0 else [] for r in requests]
        hot = [one_hot(t) for t in toks]
        return DraftOutput(toks, [h[0] for h in hot], [h[1] for h in hot], time.perf_counter() - t0)

    def _lookup(self, ids: np.ndarray, k: int) -> list[int]:
        for n in range(self.max_n, self.min_n - 1, -1):
            if len(ids) <= n:
                continue
            windows = np.lib.stride_tricks.sliding_window_view(ids[:-1], n)
            hits = np.flatnonzero((windows == ids[-n:]).all(axis=1))
            if len(hits):
                start = hits[-1] + n
                return ids[start:start + k].tolist()
        return []
