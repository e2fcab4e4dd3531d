"""Chunked prefill mixed with verify rows in one pass (EngineConfig.mixed_prefill): the
segmented forward equals separate passes, and an engine mixing gives the tokens of one that
does not, with its blocks all back at the end."""

import pytest
import torch

from cluster.engine.config import EngineConfig
from cluster.engine.drafters.eagle3 import Eagle3Drafter
from cluster.engine.drafters.model import ModelDrafter
from cluster.engine.drafters.ngram import NgramDrafter
from cluster.engine.engine import Engine
from cluster.engine.sampling import SamplingParams
from cluster.engine.scheduling.kv_cache import KVCache
from cluster.engine.scheduling.sequence import SpecParams
from cluster.engine.worker.loader import load_model
from cluster.engine.worker.runner import Runner
from tests.engine.eagle3_factory import random_head


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


def test_warm_up_of_a_mixed_pass_touches_only_the_scratch_slot(random_models):
    model = load_model(random_models["llama"], torch.float32, "cpu")
    runner = _runner(model)
    runner.forward([0, 1], [0, 0], [list(range(9)), list(range(20, 25))], last_only=True)
    cached = runner.kv.k[:, : runner.kv.scratch_block].clone()
    runner.warm_up(mixed=True)
    assert torch.equal(cached, runner.kv.k[:, : runner.kv.scratch_block])
    assert runner.kv.k[:, -1].abs().sum() > 0  # it did run


PROMPTS = ["def f(x):\n    return f(x)\n\ndef f(", "abcabcabcabcabc", "z", "the quick brown fox " * 6]
LATE = ["a late prompt, long enough to take a few chunks " * 3, "0123456789" * 9, "xyzzy " * 20]


def _engine(random_models, tokenizer, mixed: bool, **over):
    target = load_model(random_models["llama"], torch.float32, "cpu")
    draft = load_model(random_models["llama_draft"], torch.float32, "cpu")
    kw = dict(max_num_seqs=8, max_model_len=256, block_size=4, max_batch_tokens=64, prefill_chunk=16,
              mixed_prefill=mixed)
    kw.update(over)
    return Engine(target, tokenizer, EngineConfig(**kw), {"ngram": NgramDrafter(), "model": ModelDrafter(draft, 8, 256)},
                  "model")


@pytest.fixture(scope="module")
def engines(random_models, tokenizer):
    return {m: _engine(random_models, tokenizer, m) for m in (False, True)}


def _clean(engine):
    assert engine.kv.held() == (0, 0) and not engine.seqs and not engine.has_work
    for d in engine.drafters.values():
        assert not getattr(d, "state", {}), "drafter state left behind"


def _staggered(engine, params, spec, drafter):
    """PROMPTS decode while LATE arrive one by one, a few steps apart: their prefill chunks
    meet verify rows. Returns each request's tokens, in order."""
    ids = [engine.add_request(p, params, spec, drafter) for p in PROMPTS]
    got, late, steps = {i: [] for i in ids}, list(LATE), 0
    while engine.has_work or late:
        if late and steps % 3 == 2:
            sid = engine.add_request(late.pop(0), params, spec, drafter)
            ids.append(sid)
            got[sid] = []
        for o in engine.step():
            got[o.seq_id] += o.token_ids
        steps += 1
    return [got[i] for i in ids]


@pytest.mark.parametrize("spec,drafter", [(SpecParams("off"), None), (SpecParams("fixed", 3), "model"),
                                          (SpecParams("fixed", 4), "ngram")], ids=["plain", "model", "ngram"])
def test_greedy_tokens_are_the_same_mixed_or_not(engines, spec, drafter):
    greedy = SamplingParams(max_tokens=40, ignore_eos=True)
    outs = {}
    for m, e in engines.items():
        before = e.totals["mixed_steps"]
        outs[m] = _staggered(e, greedy, spec, drafter)
        mixed_steps = e.totals["mixed_steps"] - before
        assert (mixed_steps > 0) == m, mixed_steps
        _clean(e)
    assert outs[True] == outs[False]
    assert all(len(t) == 40 for t in outs[True])
    assert engines[True].stats()["mixed_steps"] > 0


@pytest.mark.parametrize("spec", [SpecParams("off"), SpecParams("fixed", 3)], ids=["plain", "model"])
def test_seeded_sampling_is_the_same_mixed_or_not(engines, spec):
    sp = SamplingParams(max_tokens=30, temperature=0.9, top_p=0.95, seed=11, ignore_eos=True)
    outs = {m: _staggered(e, sp, spec, "model") for m, e in engines.items()}
    assert outs[True] == outs[False]
    assert len({tuple(t) for t in outs[True]}) > 1  # the rows are not all one stream
    for e in engines.values():
        _clean(e)


def test_the_controller_never_observes_a_mixed_step(engines):
    """A mixed step's time includes its chunks': the goodput controller would take it for what
    verifying at that gamma costs. Metrics (on_verify) still see it, its prefill tokens marked."""
    e = engines[True]

    class Controller:
        seen: list = []

        def gamma(self, batch, inflight):
            return 2

        def observe(self, obs):
            self.seen.append(obs)

    ctrl, hooked = Controller(), []
    e.controller, e.on_verify = ctrl, hooked.append
    try:
        _staggered(e, SamplingParams(max_tokens=16, ignore_eos=True), SpecParams("auto"), "model")
    finally:
        e.controller, e.on_verify = None, None
    mixed = [o for o in hooked if o.prefill_tokens]
    assert mixed and all(o.verify_tokens > o.prefill_tokens and o.drafted > 0 for o in mixed)
    assert ctrl.seen and not any(o.prefill_tokens for o in ctrl.seen)
    assert len(ctrl.seen) == len(hooked) - len(mixed)
    _clean(e)


def test_abort_mid_prefill_in_a_mixed_step_gives_every_block_back(engines):
    e = engines[True]
    greedy = SamplingParams(max_tokens=30, ignore_eos=True)
    ids = [e.add_request(p, greedy, SpecParams("fixed", 2), "model") for p in PROMPTS[:2]]
    while not all(e.seqs[i].prefilled for i in ids):
        e.step()
    late = e.add_request("a prompt no step has cached yet " * 4, greedy, SpecParams("fixed", 2), "model")
    before = e.totals["mixed_steps"]
    e.step()
    seq = e.seqs[late]
    assert e.totals["mixed_steps"] == before + 1 and 0 < seq.num_cached < len(seq.prompt_ids)
    e.abort(late)
    while e.has_work:
        e.step()
    _clean(e)


@pytest.mark.parametrize("drafter", ["eagle3", "eagle3-tree"])
def test_eagle3_reads_the_aux_states_of_mixed_passes(random_models, tokenizer, drafter):
    """EAGLE-3 drafts from the aux states a mixed pass keeps (its chunks' and its verify rows'
    accepted positions), and draft trees verify in the verify segment: the same tokens, and
    the same draft at every (sequence, length), as without mixing."""
    outs, drafts = {}, {}
    for m in (False, True):
        target = load_model(random_models["llama"], torch.float32, "cpu")
        head = random_head(target, 100)
        cfg = EngineConfig(max_num_seqs=8, max_model_len=256, block_size=4, max_batch_tokens=64, prefill_chunk=16,
                           gamma_max=8, mixed_prefill=m)
        d = Eagle3Drafter(head, 8, 300, tree_width=3 if drafter == "eagle3-tree" else 0)
        seen, propose, launch = {}, d.propose, d.launch

        def record(reqs, out, seen=seen):
            seen.update({(r.seq_id, len(r.token_ids)): (out.tokens[i], out.parents and out.parents[i])
                         for i, r in enumerate(reqs)})
            return out

        def launching(reqs, launch=launch):  # drafts left on the device: recorded when read
            pending = launch(reqs)
            if pending is not None:
                finish = pending.finish
                pending.finish = lambda: record(reqs, finish())
            return pending

        d.propose, d.launch = (lambda reqs, propose=propose: record(reqs, propose(reqs))), launching
        e = Engine(target, tokenizer, cfg, {drafter: d}, drafter)
        outs[m] = _staggered(e, SamplingParams(max_tokens=24, ignore_eos=True), SpecParams("fixed", 4), drafter)
        drafts[m] = seen
        assert (e.totals["mixed_steps"] > 0) == m and e.totals["drafted"] > 0
        _clean(e)
    assert outs[True] == outs[False]
    assert drafts[True] == drafts[False]
    if drafter == "eagle3-tree":
        assert any(p and max(p) >= 0 for _, p in drafts[True].values())
