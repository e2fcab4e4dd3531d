"""EAGLE-3 drafting in the engine: lossless (greedy token for token, sampled in distribution),
rollback and lost state cost nothing but drafts; the trained demo head accepts."""

from __future__ import annotations

import pytest
import torch
from scipy.stats import chisquare

from cluster.engine.config import EngineConfig
from cluster.engine.drafters.base import DraftRequest
from cluster.engine.drafters.eagle3 import Eagle3Drafter
from cluster.engine.drafters.model import ModelDrafter
from cluster.engine.engine import Engine
from cluster.engine.sampling import SamplingParams
from cluster.engine.scheduling.sequence import SpecParams
from cluster.engine.worker.loader import load_model
from tests.engine.eagle3_factory import random_head

PROMPTS = ["def f(x):\n    return f(x)\n\ndef f(", "abcabcabcabcabc", "z", "the quick brown fox " * 6]
GREEDY = SamplingParams(max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(random_models, tokenizer):
    target = load_model(random_models["llama"], torch.float32, "cpu")
    draft = load_model(random_models["llama_draft"], torch.float32, "cpu")
    head = random_head(target, 100)
    cfg = EngineConfig(max_num_seqs=8, max_model_len=256, block_size=4, max_batch_tokens=128, gamma_max=12)
    drafters = {"eagle3": Eagle3Drafter(head, 8, 300), "eagle3-tree": Eagle3Drafter(head, 8, 300, tree_width=3),
                "model": ModelDrafter(draft, 8, 256)}
    return Engine(target, tokenizer, cfg, drafters, "eagle3")


@pytest.fixture(scope="module")
def baseline(engine):
    return engine.generate(PROMPTS, GREEDY, SpecParams("off"))


def _clean(engine):
    assert engine.kv.held() == (0, 0) and not engine.seqs
    for d in engine.drafters.values():
        assert not getattr(d, "state", {}), "drafter state left behind"


@pytest.mark.parametrize("drafter", ["eagle3", "eagle3-tree"])
@pytest.mark.parametrize("gamma", [1, 3, 8])
def test_greedy_is_token_identical(engine, baseline, drafter, gamma):
    out = engine.generate(PROMPTS, GREEDY, SpecParams("fixed", gamma), drafter)
    assert [r["token_ids"] for r in out] == [r["token_ids"] for r in baseline]
    assert all(r["spec"]["drafted"] > 0 for r in out)
    _clean(engine)


def test_tree_rows_are_trees(engine):
    d = engine.drafters["eagle3-tree"]
    sid = engine.add_request(PROMPTS[0], GREEDY, SpecParams("fixed", 6), "eagle3-tree")
    engine.step()  # prefill: the aux states of the prompt are now the sequence's
    seq = engine.seqs[sid]
    start, aux = seq.aux
    out = d.propose([DraftRequest(sid, seq.token_ids, 6, GREEDY, aux=aux, aux_start=start)])
    parents = out.parents[0]
    assert len(out.tokens[0]) == 6 and parents[0] == -1 and any(p >= 0 for p in parents)
    assert all(p < i for i, p in enumerate(parents))
    engine.abort(sid)
    _clean(engine)


def test_mixed_batch_with_other_drafters_and_sampled_rows(engine, baseline):
    ids = [engine.add_request(p, GREEDY, SpecParams("fixed", g), d)
           for p, g, d in zip(PROMPTS, [3, 0, 6, 2], ["eagle3", "eagle3", "eagle3-tree", "model"])]
    noise = [engine.add_request("xyz" * 5, SamplingParams(max_tokens=30, temperature=1.0, seed=s, ignore_eos=True),
                                SpecParams("fixed", 4), "eagle3") for s in range(3)]
    got = {i: [] for i in ids + noise}
    while engine.has_work:
        for o in engine.step():
            got[o.seq_id] += o.token_ids
    assert [got[i] for i in ids] == [r["token_ids"] for r in baseline]
    assert all(len(got[i]) == 30 for i in noise)
    _clean(engine)


def test_lost_draft_state_costs_drafts_not_tokens(engine):
    """The drafter forgets a sequence mid-run (a restarted replica): it starts again from the
    next aux states it gets, on a shorter window, and the output is unchanged. (A prompt no
    earlier test ran: a prefix-cache hit would start its window past the cached blocks too.)"""
    d = engine.drafters["eagle3"]
    prompt = "lost state " * 9
    sid = engine.add_request(prompt, GREEDY, SpecParams("fixed", 4), "eagle3")
    out, steps, bases = [], 0, []
    while engine.has_work:
        for o in engine.step():
            out += o.token_ids
        steps += 1
        if steps == 4:
            d.release([sid])
        if sid in d.state:
            bases.append(d.state[sid].base)
    assert out == engine.generate([prompt], GREEDY, SpecParams("off"))[0]["token_ids"]
    assert bases[0] == 0 and max(bases) > 0  # the second life started past the prompt
    _clean(engine)


def test_sampled_drafts_come_from_the_reported_q(engine):
    """Each first draft of many fresh sequences (one state, different seeds) is a draw from
    the q the drafter returns with it."""
    d = engine.drafters["eagle3"]
    sid = engine.add_request(PROMPTS[0], GREEDY, SpecParams("fixed", 2), "eagle3")
    engine.step()
    seq = engine.seqs[sid]
    start, aux = seq.aux
    params = SamplingParams(temperature=1.5, top_k=5)
    counts, q = {}, None
    for i in range(3000):
        params.seed = i
        out = d.propose([DraftRequest(f"q{i}", seq.token_ids, 1, params, aux=aux, aux_start=start)])
        d.release([f"q{i}"])
        q = (out.q_ids[0][0], out.q_probs[0][0])
        counts[out.tokens[0][0]] = counts.get(out.tokens[0][0], 0) + 1
    ids, probs = q
    support = probs > 0
    assert support.sum() == 5 and set(counts) <= set(ids[support].tolist())
    observed = torch.tensor([counts.get(int(t), 0) for t in ids[support]], dtype=torch.float64)
    q = torch.tensor(probs[support], dtype=torch.float64)
    assert chisquare(observed, q / q.sum() * 3000).pvalue > 1e-4
    engine.abort(sid)
    _clean(engine)


@pytest.mark.parametrize("seeded", [True, False])
def test_sampled_speculation_keeps_the_target_distribution(engine, seeded):
    """The first token a verify step emits (a draft accepted, or the resample) follows the
    target's distribution given the token before it, as plain sampling would: seeded rows
    drawing from their own generators, unseeded ones together from the device's
    (sampling.fill_draws)."""
    params = SamplingParams(max_tokens=3, temperature=1.0, top_k=3, ignore_eos=True)  # a verify step of 1 draft
    n, prompt = 600, "abcabc"
    torch.manual_seed(0)  # unseeded rows draw from the default generator: the same draws every run
    out = []
    for i in range(0, n, 50):  # within the admission queue
        seeds = [i + j if seeded else None for j in range(50)]
        out += engine.generate([prompt] * 50, [SamplingParams(**{**vars(params), "seed": s}) for s in seeds],
                               SpecParams("fixed", 3), "eagle3")
    assert sum(r["spec"]["drafted"] for r in out) > 0
    firsts = {}
    for r in out:
        firsts.setdefault(r["token_ids"][0], []).append(r["token_ids"][1])
    ids = engine.tokenizer.encode(prompt)
    from cluster.engine.sampling import target_probs

    for first, seconds in firsts.items():
        if len(seconds) < 100:
            continue
        with torch.inference_mode():
            logits = engine.model.logits(_last_hidden(engine, ids + [first]))
        p = target_probs(logits[None], [params])[0].double()
        support = p > 0
        counts = torch.bincount(torch.tensor(seconds), minlength=len(p)).double()
        assert counts[~support].sum() == 0
        expected = p[support] / p[support].sum() * len(seconds)
        assert chisquare(counts[support], expected).pvalue > 1e-4
    _clean(engine)


def _last_hidden(engine, ids):
    from cluster.engine.scheduling.kv_cache import KVCache
    from cluster.engine.worker.runner import Runner

    s = engine.model.shape
    kv = KVCache.dense(s.layers, 1, len(ids) + 1, s.kv_heads, s.head_dim, torch.float32, "cpu")
    return Runner(engine.model, kv, "sdpa").forward([0], [0], [ids], last_only=True, hidden=True)[1][0]


# ---- the demo target with its trained head ------------------------------------------------------

@pytest.fixture(scope="module")
def demo(demo_pair):
    from cluster.config import parse_config
    from cluster.serve.build import build_engine

    e = build_engine(parse_config({"models": {"drafter": "eagle3"}, "engine": {"max_num_seqs": 8, "max_model_len": 768}}))
    assert "eagle3" in e.drafters and e.default_drafter == "eagle3"
    return e


def test_demo_head_is_lossless_and_accepts(demo):
    from cluster.bench.workloads import code_prompts

    prompts = code_prompts(3, chars=300, seed=3)
    base = demo.generate(prompts, SamplingParams(max_tokens=48), SpecParams("off"))
    out = demo.generate(prompts, SamplingParams(max_tokens=48), SpecParams("fixed", 4), "eagle3")
    assert [r["token_ids"] for r in out] == [r["token_ids"] for r in base]
    steps = sum(r["spec"]["verify_steps"] for r in out)
    mean_len = (sum(r["spec"]["accepted"] for r in out) + steps) / steps
    assert mean_len > 1.8, f"mean accepted length {mean_len:.2f}"
    sampled = demo.generate(prompts, SamplingParams(max_tokens=48, temperature=0.7, seed=1), SpecParams("fixed", 4),
                            "eagle3")
    assert sum(r["spec"]["accepted"] for r in sampled) > 0.1 * sum(r["spec"]["drafted"] for r in sampled)


def test_cli_local_eagle3(demo_pair):
    import json
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "cluster.cli", "generate", "def parse_args(argv):\n", "--local", "--json",
           "--max-tokens", "24", "--speculation", "4", "--drafter", "eagle3"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert len(out["token_ids"]) == 24 and out["spec"]["accepted"] > 0


def test_lag_counts_what_the_head_has_not_run_over(engine):
    """Drafter.lag (the goodput controller's price of switching speculation on): a row the head
    never drafted for lags by all its tokens, one it drafts each step by at most a step's new ones."""
    d = engine.drafters["eagle3"]
    seq = engine.seqs[engine.add_request("lag of the head " * 4, GREEDY, SpecParams("fixed", 4), "eagle3")]
    while seq.stats.drafted == 0 or seq.num_output < 6:
        engine.step()
    assert d.lag([(seq.seq_id, seq.token_ids)]) <= 5
    assert d.lag([("never-drafted", seq.token_ids)]) == len(seq.token_ids)
    while engine.has_work:
        engine.step()
    _clean(engine)
