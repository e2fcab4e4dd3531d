"""Prompt chunks of unequal widths run as segments of similar widths (Runner._forward_ragged):
the same logits, hidden and aux states as the padded pass, and the same tokens end to end."""

from __future__ import annotations

import pytest
import torch

from cluster.engine.config import EngineConfig
from cluster.engine.engine import Engine
from cluster.engine.sampling import SamplingParams
from cluster.engine.scheduling.kv_cache import KVCache
from cluster.engine.scheduling.sequence import SpecParams
from cluster.engine.worker import runner as runner_mod
from cluster.engine.worker.loader import load_model
from cluster.engine.worker.runner import Runner, ragged


def test_which_passes_are_ragged():
    assert ragged([512, 128, 128])            # padded 1536 for 768 real tokens
    assert not ragged([512, 512, 480])        # little padding
    assert not ragged([300, 20])              # too few tokens for an eager pass to pay
    assert not ragged([5, 3, 1] * 200)        # verify rows (a graph's widths)


@pytest.mark.parametrize("aux", [False, True])
def test_segments_give_the_padded_passes_outputs(random_models, monkeypatch, aux):
    model = load_model(random_models["llama"], torch.float32, "cpu")
    model.aux_layers = (0, 1) if aux else ()
    s = model.shape
    g = torch.Generator().manual_seed(0)
    tokens = [torch.randint(0, s.vocab_size, (n,), generator=g).tolist() for n in (40, 300, 9, 200)]
    lens = [0, 5, 17, 0]

    def run(threshold):
        monkeypatch.setattr(runner_mod, "RAGGED", threshold)
        kv = KVCache.dense(s.layers, 4, 512, s.kv_heads, s.head_dim, torch.float32, "cpu")
        r = Runner(model, kv, "sdpa")
        for b, n in enumerate(lens):  # a cached prefix first, the same in both runs
            if n:
                r.forward([b], [0], [list(range(1, n + 1))], last_only=True)
        return r.forward([0, 1, 2, 3], lens, tokens, last_only=True, hidden=True, aux=aux)

    monkeypatch.setattr(runner_mod, "RAGGED_TOKENS", 64)
    assert ragged([len(t) for t in tokens])
    seg, pad = run(1.25), run(float("inf"))
    for a, b in zip(seg, pad):
        if a is None:
            assert b is None
            continue
        if a.dim() == 3:  # aux at every position: the real ones agree, padding is not read
            for row, t in enumerate(tokens):
                torch.testing.assert_close(a[row, : len(t)], b[row, : len(t)], atol=1e-4, rtol=1e-4)
        else:
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert len(seg) == len(pad) == (3 if aux else 2)
    assert not aux or seg[2] is not None


def test_engine_tokens_equal_with_and_without_segments(random_models, tokenizer, monkeypatch):
    target = load_model(random_models["llama"], torch.float32, "cpu")
    prompts = ["x " * 150, "def f(n):", "y " * 70, "class A:\n    pass"]
    out, calls = [], []
    seg = Runner._forward_ragged
    monkeypatch.setattr(Runner, "_forward_ragged", lambda self, *a: calls.append(1) or seg(self, *a))
    for threshold in (1.25, float("inf")):
        monkeypatch.setattr(runner_mod, "RAGGED", threshold)
        monkeypatch.setattr(runner_mod, "RAGGED_TOKENS", 64)
        cfg = EngineConfig(max_num_seqs=4, max_model_len=512, max_batch_tokens=512, prefill_chunk=256)
        e = Engine(target, tokenizer, cfg)
        res = e.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True), SpecParams("off"))
        out.append([r["token_ids"] for r in res])
        assert e.kv.held() == (0, 0)
        if threshold == 1.25:
            assert calls  # the prompts' first step ran as segments
    assert out[0] == out[1]
