"""The n-gram drafter proposes what followed the latest earlier occurrence of the longest
matching suffix (max_n down to min_n), exactly as a sliding-window search does."""

from __future__ import annotations

import random

import numpy as np
import pytest

from cluster.engine.drafters.base import DraftRequest
from cluster.engine.drafters.ngram import NgramDrafter


def reference(ids: list[int], k: int, max_n: int, min_n: int) -> list[int]:
    for n in range(max_n, min_n - 1, -1):
        if len(ids) <= n:
            continue
        starts = [i for i in range(len(ids) - n) if ids[i:i + n] == ids[-n:]]
        if starts:
            return ids[starts[-1] + n:starts[-1] + n + k]
    return []


@pytest.mark.parametrize("max_n,min_n", [(3, 1), (4, 2), (2, 2), (1, 1)])
def test_lookup_matches_a_plain_search(max_n, min_n):
    rng = random.Random(max_n * 10 + min_n)
    d = NgramDrafter(max_n, min_n)
    for _ in range(500):
        ids = [rng.randrange(rng.choice([2, 3, 5, 50])) for _ in range(rng.randrange(0, 40))]
        k = rng.randrange(1, 6)
        assert d._lookup(np.asarray(ids, np.int64), k) == reference(ids, k, max_n, min_n), ids


def test_propose_rows():
    out = NgramDrafter().propose([DraftRequest("a", [1, 2, 3, 9, 1, 2, 3], 3), DraftRequest("b", [5], 2),
                                  DraftRequest("c", [1, 2, 1], 0)])
    assert out.tokens == [[9, 1, 2], [], []]
    assert [q.shape for q in out.q_ids] == [(3, 1), (0, 1), (0, 1)]
