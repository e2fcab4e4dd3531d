"""A CUDA graph's input buffer holds each row's tokens (zero-padded), its table row (the
scratch row for padding rows) and its length, whatever the rows' widths."""

from __future__ import annotations

import random

import numpy as np

from cluster.engine.worker.graphs import fill_inputs


def test_fill_inputs_lays_out_ids_rows_and_lengths():
    rng = random.Random(0)
    for _ in range(200):
        width, bk = rng.randrange(1, 6), rng.choice([1, 2, 4, 8])
        b = rng.randrange(0, bk + 1)
        tokens = [[rng.randrange(1, 99) for _ in range(rng.randrange(0, width + 1))] for _ in range(b)]
        rows, lens = [rng.randrange(50) for _ in range(b)], [rng.randrange(500) for _ in range(b)]
        host = np.full(bk * width + 2 * bk, -7, np.int64)  # stale values from an earlier step
        fill_inputs(host, tokens, rows, lens, width, bk, scratch_row=99)
        ids = host[:bk * width].reshape(bk, width)
        for i in range(bk):
            t = tokens[i] if i < b else []
            assert ids[i].tolist() == t + [0] * (width - len(t))
        assert host[bk * width:bk * width + bk].tolist() == rows + [99] * (bk - b)
        assert host[bk * width + bk:].tolist() == lens + [0] * (bk - b)
