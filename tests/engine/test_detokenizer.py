"""The windowed incremental detokenizer streams exactly the text of a full decode."""

from __future__ import annotations

import random

from transformers import AutoTokenizer

from cluster.engine.stopping import Detokenizer


def test_streamed_deltas_equal_full_decode(demo_pair):
    tok = AutoTokenizer.from_pretrained(demo_pair[0])
    rng = random.Random(0)
    for _ in range(100):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(1, 60))]
        d, out = Detokenizer(tok, []), ""
        for i, t in enumerate(ids):
            d.add(t)
            out += d.delta(final=i == len(ids) - 1)
        assert out == tok.decode(ids, skip_special_tokens=True)
