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


def test_a_failing_decode_stream_hands_over_to_the_window(demo_pair):
    """tokenizers' DecodeStream raises where a decoder rewrites text it already gave; the
    detokenizer then goes on with its own window from the last text it had: the same text."""
    tok = AutoTokenizer.from_pretrained(demo_pair[0])
    rng = random.Random(1)

    class Failing:
        def __init__(self, stream, after):
            self.stream, self.after = stream, after

        def step(self, backend, token):
            self.after -= 1
            if self.after < 0:
                raise Exception("Invalid prefix encountered")
            return self.stream.step(backend, token)

    for _ in range(50):
        ids = [rng.randrange(tok.vocab_size) for _ in range(rng.randrange(2, 60))]
        d, out = Detokenizer(tok, []), ""
        assert d.stream is not None
        d.stream = Failing(d.stream, rng.randrange(len(ids)))
        for i, t in enumerate(ids):
            d.add(t)
            out += d.delta(final=i == len(ids) - 1)
        assert d.stream is None and out == tok.decode(ids, skip_special_tokens=True)
