"""Chunked prefill mixed with verify rows in one pass (EngineConfig.mixed_prefill): the
segmented forward equals separate passes, and an engine mixing gives the tokens of one that
does not, with its blocks all back at the end."""

import pytest
import torch

from cluster.engine.config import EngineConfig
from cluster.engine.drafters.model import ModelDrafter
from cluster.engine.drafters.ngram import NgramDrafter
from cluster.engine.engine import Engine
from cluster.engine.kv_cache import KVCache
from cluster.engine.loader import load_model
from cluster.engine.runner import Runner
from cluster.engine.sampling import SamplingParams
from cluster.engine.sequence import SpecParams


def _runner(model):
    s = model.shape
    kv = KVCache.dense(s.layers, 5, 128, s.kv_heads, s.head_dim, torch.float32, "cpu", block_size=4)
    return Runner(model, kv, "sdpa")


@pytest.mark.parametrize("tree", [False, True])
def test_segmented_pass_equals_separate_passes(random_models, tree):
    """Verify rows of 5 and 3 tokens (padded to 5; one a draft tree) beside prefill chunks of
    20 and 7 tokens (padded to 20): the same logits, hidden and aux states, and the same K/V
    written, as the two segments run as passes of their own."""
    model = load_model(random_models["llama"], torch.float32, "cpu")
    model.aux_layers = (0, 1)
    g = torch.Generator().manual_seed(3)
    tok = lambda n: torch.randint(0, 255, (n,), generator=g).tolist()  # noqa: E731
    mixed, alone = _runner(model), _runner(model)
    ctx_a, ctx_b, ctx_c = tok(11), tok(6), tok(9)
    for r in (mixed, alone):  # cached prefixes: two decoding rows, one half-prefilled prompt
        r.forward([0, 1, 2], [0, 0, 0], [ctx_a, ctx_b + [0] * 5, ctx_c + [0] * 2], last_only=True)
    verify = ([0, 1], [11, 6], [tok(5), tok(3)])
    prefill = ([2, 3], [9, 0], [tok(20), tok(7)])
    trees = [[-1, 0, -1, 2], None] if tree else None
    (vl, vh, va), (pl, ph, pa) = mixed.forward_mixed(verify, prefill, trees)
    el, eh, ea = alone.forward(*verify, last_only=False, trees=trees, hidden=True, aux=True)
    pl2, ph2, pa2 = alone.forward(*prefill, last_only=True, hidden=True, aux=True)
    tol = dict(rtol=0, atol=1e-4)
    lens = [5, 3]
    for b, n in enumerate(lens):  # padded positions are not outputs
        assert torch.allclose(vl[b, :n], el[b, :n], **tol)
        assert torch.allclose(vh[b, :n], eh[b, :n], **tol)
        assert torch.allclose(va[b, :n], ea[b, :n], **tol)
    assert torch.allclose(pl, pl2, **tol) and torch.allclose(ph, ph2, **tol)
    for b, n in enumerate([20, 7]):
        assert torch.allclose(pa[b, :n], pa2[b, :n], **tol)
    for row, end in [(0, 16), (1, 9), (2, 29), (3, 7)]:  # the K/V both wrote, row by row
        for a, b in ((mixed.kv.k, alone.kv.k), (mixed.kv.v, alone.kv.v)):
            sa = mixed.kv.host_slots(mixed.kv.handles[row], list(range(end)))
            sb = alone.kv.host_slots(alone.kv.handles[row], list(range(end)))
            fa, fb = a.view(a.shape[0], -1, *a.shape[3:]), b.view(b.shape[0], -1, *b.shape[3:])
            assert torch.allclose(fa[:, sa], fb[:, sb], **tol)
    assert not torch.equal(pl[0], pl[1])  # the check can fail: rows differ
