"""Engine loop: lossless speculation, stops, prefix cache, bad input, nothing leaked."""

import time

import pytest
import torch

from cluster.engine.config import EngineConfig
from cluster.engine.drafters.model import ModelDrafter
from cluster.engine.drafters.ngram import NgramDrafter
from cluster.engine.engine import Engine
from cluster.engine.sampling import InvalidRequest, SamplingParams
from cluster.engine.scheduling.sequence import SpecParams
from cluster.engine.worker.loader import load_model
from tests.factories import step_observation

PROMPTS = ["def f(x):\n    return f(x)\n\ndef f(", "abcabcabcabcabc", "z", "the quick brown fox " * 6]


@pytest.fixture(scope="module")
def engine(random_models, tokenizer):
    target = load_model(random_models["llama"], torch.float32, "cpu")
    draft = load_model(random_models["llama_draft"], torch.float32, "cpu")
    cfg = EngineConfig(max_num_seqs=8, max_model_len=256, block_size=4, max_batch_tokens=64)
    return Engine(target, tokenizer, cfg, {"ngram": NgramDrafter(), "model": ModelDrafter(draft, 8, 256)}, "model")


def _clean(engine):
    assert engine.kv.held() == (0, 0) and not engine.seqs and not engine.has_work
    for d in engine.drafters.values():
        assert not getattr(d, "state", {}), "drafter state left behind"


@pytest.fixture(scope="module")
def baseline(engine):
    return engine.generate(PROMPTS, SamplingParams(max_tokens=48, ignore_eos=True), SpecParams("off"))


@pytest.mark.parametrize("drafter", ["ngram", "model"])
@pytest.mark.parametrize("gamma", [1, 2, 4, 8])
def test_greedy_speculation_is_token_identical(engine, baseline, drafter, gamma):
    out = engine.generate(PROMPTS, SamplingParams(max_tokens=48, ignore_eos=True), SpecParams("fixed", gamma), drafter)
    for a, b in zip(baseline, out):
        assert b["token_ids"] == a["token_ids"]
        assert b["spec"]["drafted"] > 0 or drafter == "ngram"
    _clean(engine)


def test_mixed_batch_greedy_rows_stay_identical(engine, baseline):
    """Greedy rows share a batch with sampled rows, other gammas and other drafters."""
    greedy = SamplingParams(max_tokens=48, ignore_eos=True)
    ids = [engine.add_request(p, greedy, SpecParams("fixed", g), d)
           for p, g, d in zip(PROMPTS, [3, 0, 8, 5], ["model", "ngram", "ngram", "model"])]
    noise = [engine.add_request("xyz" * 5, SamplingParams(max_tokens=40, temperature=1.0, seed=s), SpecParams("fixed", 4))
             for s in range(3)]
    got = {i: [] for i in ids + noise}
    while engine.has_work:
        for o in engine.step():
            got[o.seq_id] += o.token_ids
    for i, base in zip(ids, baseline):
        assert got[i] == base["token_ids"]
    _clean(engine)


def test_seeded_sampling_is_reproducible(engine):
    sp = SamplingParams(max_tokens=30, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)
    a = engine.generate(["hello"], sp, SpecParams("fixed", 3))
    b = engine.generate(["hello"], sp, SpecParams("fixed", 3))
    assert a[0]["token_ids"] == b[0]["token_ids"]


def test_step_period_covers_drafting_verifying_and_the_callers_gap(engine):
    """StepObservation.step_s (what the goodput controller's corrections compare) runs from
    the previous verify step's end: the caller's work between steps counts; a prefill step
    between, or a caller idle longer than the step itself, restarts it."""
    obs = []
    engine.on_verify = obs.append
    try:
        engine.generate(["abcabcabcabc"], SamplingParams(max_tokens=12, ignore_eos=True), SpecParams("fixed", 2), "model")
        assert len(obs) >= 3 and all(o.step_s >= o.verify_s + o.draft_s > 0 for o in obs)
        last, engine._last_end = engine._last_end, 10.0
        o = step_observation()
        engine._observe(o, 10.001, 10.011)  # 1 ms of the caller's work, then a 10 ms step
        assert o.step_s == pytest.approx(0.011) and engine._last_end == 10.0  # step() moves it
        engine._observe(o, 10.05, 10.06)  # idle 50 ms before a 10 ms step: not a step's cost
        assert o.step_s == pytest.approx(0.01)
    finally:
        engine.on_verify, engine._last_end = None, last


def test_stats_and_timing_reported(engine):
    r = engine.generate(["abcabcabcabc"], SamplingParams(max_tokens=32, ignore_eos=True), SpecParams("fixed", 4), "model")[0]
    spec, timing = r["spec"], r["timing"]
    assert spec["drafted"] >= spec["accepted"] >= 0 and spec["drafted"] > 0
    assert spec["acceptance_rate"] == pytest.approx(spec["accepted"] / spec["drafted"])
    assert len(spec["per_position"]) == 4 and all(0 <= x <= 1 for x in spec["per_position"])
    assert 1 <= spec["mean_accepted_len"] <= 5
    assert 0 < timing["ttft_ms"] <= timing["total_ms"]
    assert len(r["token_ids"]) == 32 and r["finish_reason"] == "length"


def test_stop_string_cuts_text(engine, baseline):
    full = baseline[1]["text"]
    stop = full[10:13]
    r = engine.generate([PROMPTS[1]], SamplingParams(max_tokens=48, stop=[stop], ignore_eos=True), SpecParams("fixed", 4))[0]
    assert r["finish_reason"] == "stop"
    assert r["text"] == full[: full.index(stop)]
    _clean(engine)


def test_prefix_cache_hits_and_keeps_output(engine):
    sp = SamplingParams(max_tokens=16, ignore_eos=True)
    prompt = "shared system prompt, long enough to fill blocks. " * 2
    first = engine.generate([prompt + "A"], sp, SpecParams("off"))[0]
    hits = engine.kv.pool.stats.hits
    again = engine.generate([prompt + "A"], sp, SpecParams("off"))[0]
    assert engine.kv.pool.stats.hits > hits
    assert again["token_ids"] == first["token_ids"]


def test_prefix_blocks_are_shared_not_copied(engine):
    """Two live sequences with one prompt prefix hold the same blocks (one reference each)."""
    prompt = "a prompt shared by two requests that spans blocks: " * 2
    engine.generate([prompt + "x"], SamplingParams(max_tokens=2), SpecParams("off"))
    a = engine.add_request(prompt + "y", SamplingParams(max_tokens=8, ignore_eos=True), SpecParams("off"))
    b = engine.add_request(prompt + "z", SamplingParams(max_tokens=8, ignore_eos=True), SpecParams("off"))
    engine.step()
    ta, tb = engine.seqs[a].kv.table, engine.seqs[b].kv.table
    shared = len(engine.tokenizer.encode(prompt)) // engine.cfg.block_size
    assert shared >= 2 and ta.blocks[:shared] == tb.blocks[:shared]
    assert all(engine.kv.pool.refs[blk] == 2 for blk in ta.blocks[:shared])
    assert set(ta.blocks[shared:]).isdisjoint(tb.blocks[shared:])
    engine.abort(a)
    engine.abort(b)
    _clean(engine)


@pytest.mark.parametrize("kwargs,spec,drafter,match", [
    (dict(prompt=""), None, None, "empty"),
    (dict(prompt="x" * 300), None, None, "limit"),
    (dict(max_tokens=0), None, None, "max_tokens"),
    (dict(temperature=-1.0), None, None, "temperature"),
    (dict(top_p=0.0), None, None, "top_p"),
    (dict(top_p=1.5), None, None, "top_p"),
    (dict(top_k=-2), None, None, "top_k"),
    (dict(), SpecParams("sideways"), None, "speculation mode"),
    (dict(), SpecParams("fixed", 99), None, "gamma"),
    (dict(), None, "eagle", "unknown drafter"),
])
def test_bad_input_is_refused_and_leaks_nothing(engine, kwargs, spec, drafter, match):
    kwargs = dict(kwargs)
    prompt = kwargs.pop("prompt", "ok")
    with pytest.raises(InvalidRequest, match=match):
        engine.add_request(prompt, SamplingParams(**kwargs), spec, drafter)
    _clean(engine)


def test_abort_frees_everything(engine):
    sid = engine.add_request("abcabc", SamplingParams(max_tokens=100, ignore_eos=True), SpecParams("fixed", 4), "model")
    engine.step()
    engine.step()
    assert engine.kv.rows_used == 1
    engine.abort(sid)
    _clean(engine)


def test_unknown_default_drafter_is_refused(random_models):
    with pytest.raises(ValueError, match="unknown drafter"):
        Engine.from_pretrained(random_models["llama"], None, drafter="model")


def test_cached_blocks_evict_chain_tails_first_and_tell_the_directory(random_models, tokenizer):
    """Under pressure a prompt's first blocks stay: a later block is useless without them.
    Cached blocks are published when they fill and withdrawn when they are reused."""
    target = load_model(random_models["llama"], torch.float32, "cpu")
    e = Engine(target, tokenizer, EngineConfig(max_num_seqs=1, max_model_len=96, block_size=4, max_batch_tokens=64,
                                               prefill_chunk=16))
    events = []
    e.kv.pool.on_change = lambda stored, evicted: events.append((stored, evicted))
    sp = SamplingParams(max_tokens=1)
    e.generate([list(range(3, 98))], sp, SpecParams("off"))  # 95 tokens: 23 full blocks and a partial one
    chain = e.kv.pool.hashes()
    assert len(chain) == 23 and [h for s, _ in events for h in s] == chain
    untouched = e.kv.pool.num_blocks - 24
    # a prompt that needs every never-used block, the partial one and two of the chain's
    e.generate([[7] * (4 * (untouched + 3) - 2)], sp, SpecParams("off"))
    evicted = [h for _, ev in events for h in ev]
    assert evicted == [chain[-1], chain[-2]]
    assert set(chain[:-2]) <= set(e.kv.pool.hashes())
    assert e.kv.held() == (0, 0)


class ThreadedDrafter(NgramDrafter):
    """An n-gram drafter answering from another thread, as a remote drafter does."""
    look_ahead = "gated"

    def __init__(self):
        super().__init__()
        from concurrent.futures import ThreadPoolExecutor
        self.pool = ThreadPoolExecutor(1)
        self.calls = 0

    def propose_async(self, requests):
        self.calls += 1
        return self.pool.submit(self.propose, requests)


def test_drafting_ahead_is_lossless_and_hits(random_models, tokenizer, baseline):
    target = load_model(random_models["llama"], torch.float32, "cpu")
    cfg = EngineConfig(max_num_seqs=8, max_model_len=256, block_size=4, max_batch_tokens=64)
    remote = ThreadedDrafter()
    e = Engine(target, tokenizer, cfg, {"ngram": remote}, "ngram")
    out = e.generate(PROMPTS, SamplingParams(max_tokens=48, ignore_eos=True), SpecParams("fixed", 3))
    assert [r["token_ids"] for r in out] == [r["token_ids"] for r in baseline]
    assert e.planner.counts["ahead_hits"] > 0, e.planner.counts


class MissingDrafter(ThreadedDrafter):
    """Guesses ahead always wrong (a bonus token no target picks); fresh calls draft n-grams.
    `ahead_s`: how long a guessed call takes, against a verify pass of well under a second."""

    def __init__(self, ahead_s: float):
        super().__init__()
        self.ahead_s, self.ahead_calls, self.drafting_calls = ahead_s, 0, 0

    def propose(self, requests):
        if requests and requests[0].confirmed is not None:  # a look-ahead call
            self.ahead_calls += 1
            time.sleep(self.ahead_s)
            out = super().propose(requests)
            out.tokens = [[-1] + t[1:] for t in out.tokens]
            return out
        out = super().propose(requests)
        self.drafting_calls += any(out.tokens)  # a step with drafts: the engine may guess after it
        return out


def test_gated_look_ahead_turns_off_when_misses_wait(random_models, tokenizer, baseline):
    target = load_model(random_models["llama"], torch.float32, "cpu")
    cfg = EngineConfig(max_num_seqs=8, max_model_len=256, block_size=4, max_batch_tokens=64)
    drafter = MissingDrafter(0.5)  # a guessed call outlasting the verify pass, and missing
    e = Engine(target, tokenizer, cfg, {"ngram": drafter}, "ngram")
    out = e.generate(PROMPTS[:1], SamplingParams(max_tokens=48, ignore_eos=True), SpecParams("fixed", 3))
    assert out[0]["token_ids"] == baseline[0]["token_ids"]
    assert e.planner.counts["ahead_hits"] == 0 and drafter.drafting_calls > 8
    assert drafter.ahead_calls <= 2, (drafter.ahead_calls, drafter.drafting_calls)


def test_gated_look_ahead_rule():
    """On at the H100's measured batch-1 figures (0.375 hits, a 3.1 ms fresh call, guessed
    replies back before the verify ends); off when a miss waits longer than hits save."""
    from cluster.engine.spec.drafting import DraftPlanner

    p = DraftPlanner({}, None)
    p.hit_rate["d"], p.fresh_s["d"], p.wasted_s["d"] = 0.375, 3.1e-3, 0.0
    assert p._pays("d")
    p.wasted_s["d"] = 2.0e-3
    assert not p._pays("d")
    assert DraftPlanner({}, None)._pays("new")  # unmeasured: try it


def test_model_drafter_drafting_ahead_is_lossless(random_models, tokenizer, baseline):
    """A model drafter that drafts the next step while this one verifies (on a GPU, on its
    own stream; here in turn): greedy output unchanged, some guesses used, none left over."""
    target = load_model(random_models["llama"], torch.float32, "cpu")
    draft = load_model(random_models["llama"], torch.float32, "cpu")  # the target itself: guesses hit
    cfg = EngineConfig(max_num_seqs=8, max_model_len=256, block_size=4, max_batch_tokens=64)
    drafter = ModelDrafter(draft, 8, 256, look_ahead="free")
    e = Engine(target, tokenizer, cfg, {"model": drafter}, "model")
    params, spec = SamplingParams(max_tokens=48, ignore_eos=True), SpecParams("fixed", 3)
    out = [e.generate([p], params, spec)[0] for p in PROMPTS]  # single streams: it looks ahead
    assert [r["token_ids"] for r in out] == [r["token_ids"] for r in baseline]
    hits = e.planner.counts["ahead_hits"]
    assert hits > 10, e.planner.counts
    assert not drafter.state and e.kv.held() == (0, 0)
    out = e.generate(PROMPTS, params, spec)  # several rows: it does not (measured slower on a GPU)
    assert [r["token_ids"] for r in out] == [r["token_ids"] for r in baseline]
    assert e.planner.counts["ahead_hits"] == hits


def test_early_exit_self_drafter_is_lossless(random_models, tokenizer, baseline):
    from cluster.engine.drafters.early_exit import EarlyExitDrafter

    target = load_model(random_models["llama"], torch.float32, "cpu")
    e = Engine(target, tokenizer, EngineConfig(max_num_seqs=8, max_model_len=256, block_size=4, max_batch_tokens=64))
    e.drafters["early-exit"] = EarlyExitDrafter(e.runner, layers=1)
    for sp in (SamplingParams(max_tokens=48, ignore_eos=True),):
        out = e.generate(PROMPTS, sp, SpecParams("fixed", 4), "early-exit")
        assert [r["token_ids"] for r in out] == [r["token_ids"] for r in baseline]
        assert sum(r["spec"]["drafted"] for r in out) > 0
    sampled = e.generate(PROMPTS, SamplingParams(max_tokens=20, temperature=0.9, seed=3), SpecParams("fixed", 3),
                         "early-exit")
    assert all(len(r["token_ids"]) > 0 for r in sampled) and e.kv.held() == (0, 0)


def test_model_drafter_batched_catch_up_matches_one_row_at_a_time(random_models, tokenizer):
    """Rows with many new tokens (new sequences, a return from plain decoding) catch up in
    padded passes of similar lengths: the same drafts as each row alone, incl. a group split
    by slot capacity (a long cached row beside a long new one)."""
    from cluster.engine.drafters.base import DraftRequest

    draft = load_model(random_models["llama_draft"], torch.float32, "cpu")
    prompts = [tokenizer.encode(p) for p in PROMPTS] + [list(range(3, 200)), list(range(40, 70))]
    together, alone = ModelDrafter(draft, 8, 256), ModelDrafter(draft, 8, 256)
    ids = list(prompts)
    for extra in (0, 40):  # a first call (prefill), then 40 tokens more per row
        ids = [p + [(7 * i + j) % 250 for j in range(extra)] for i, p in enumerate(ids)]
        reqs = [DraftRequest(f"s{i}", p[:250], 4) for i, p in enumerate(ids)]
        if extra:  # a new 100-token row: padded beside the 197 cached tokens of s4 it would overrun the slot
            reqs.append(DraftRequest("new", list(range(100, 200)), 4))
        got = together.propose(reqs).tokens
        want = [alone.propose([r]).tokens[0] for r in reqs]
        assert got == want and all(len(t) == 4 for t in got)


def test_model_drafter_catch_up_past_a_chunk_goes_a_chunk_at_a_time(random_models, tokenizer, monkeypatch):
    """A catch-up longer than a chunk (a new prompt, a return from plain decoding) runs in
    chunk-wide passes (graph widths on a GPU): the same drafts as one pass over it all."""
    from cluster.engine.drafters import model as model_drafter
    from cluster.engine.drafters.base import DraftRequest

    draft = load_model(random_models["llama_draft"], torch.float32, "cpu")
    chunked, whole = ModelDrafter(draft, 4, 256), ModelDrafter(draft, 4, 256)
    passes = []
    forward = chunked.runner.forward
    monkeypatch.setattr(chunked.runner, "forward", lambda rows, lens, toks, **kw: passes.append(
        [len(t) for t in toks]) or forward(rows, lens, toks, **kw))
    reqs = [DraftRequest("a", list(range(3, 203)), 4), DraftRequest("b", list(range(50, 120)), 4)]
    want = whole.propose(reqs).tokens
    monkeypatch.setattr(model_drafter, "CHUNK", 32)
    assert chunked.propose(reqs).tokens == want
    assert passes[:3] == [[32, 32], [32, 32], [32]], passes  # a: 200 = 6 x 32 + 8; b: 70 = 2 x 32 + 6
    more = [DraftRequest(r.seq_id, r.token_ids + list(range(7, 107)), 4) for r in reqs]  # back from plain decoding
    assert chunked.propose(more).tokens == whole.propose(more).tokens


def test_runner_warm_up_touches_only_the_scratch_slot(random_models, tokenizer):
    """The start-up pass over every kernel variant (Runner.warm_up) writes KV of the scratch
    slot only: a drafter warmed up with sequences cached drafts exactly as one never warmed."""
    from cluster.engine.drafters.base import DraftRequest

    draft = load_model(random_models["llama_draft"], torch.float32, "cpu")
    warmed, cold = ModelDrafter(draft, 4, 128), ModelDrafter(draft, 4, 128)
    reqs = [DraftRequest(f"s{i}", tokenizer.encode(p), 4) for i, p in enumerate(PROMPTS[:2])]
    warmed.propose(reqs), cold.propose(reqs)
    cached = warmed.kv.k[:, : warmed.kv.scratch_block].clone()
    warmed.runner.warm_up()
    assert torch.equal(cached, warmed.kv.k[:, : warmed.kv.scratch_block])
    assert not torch.equal(warmed.kv.k[:, -1], torch.zeros_like(warmed.kv.k[:, -1]))  # it did run
    more = [DraftRequest(r.seq_id, r.token_ids + [5, 6, 7], 4) for r in reqs]
    assert warmed.propose(more).tokens == cold.propose(more).tokens


def test_model_drafter_greedy_chain_is_the_draft_models_own_greedy_text(random_models, tokenizer):
    """The greedy chain feeds each argmax back on the device (no host round trip per step):
    its drafts are the draft model's greedy continuation under transformers, also for
    rows asking for different numbers of tokens in one call, and again after a call that
    extends the rows (the drafter's cache then holds their earlier drafts)."""
    from transformers import AutoModelForCausalLM

    from cluster.engine.drafters.base import DraftRequest

    path = random_models["llama_draft"]
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    drafter = ModelDrafter(load_model(path, torch.float32, "cpu"), 8, 256)

    def greedy(ids, k):  # argmax after argmax (generate's processors would mask EOS, a legal draft)
        out = list(ids)
        with torch.no_grad():
            for _ in range(k):
                out.append(int(ref(torch.tensor([out])).logits[0, -1].argmax()))
        return out[len(ids):]

    ids = [tokenizer.encode(p) for p in PROMPTS]
    for ks in ([4, 1, 6, 3], [2, 5, 5, 1]):
        reqs = [DraftRequest(f"s{i}", p, k) for i, (p, k) in enumerate(zip(ids, ks))]
        got = drafter.propose(reqs)
        assert got.tokens == [greedy(p, k) for p, k in zip(ids, ks)]
        assert all(q.shape == (k, 1) and (p == 1.0).all() for q, p, k in zip(got.q_ids, got.q_probs, ks))
        ids = [p + t[:2] for p, t in zip(ids, got.tokens)]  # two drafts accepted, the rest rejected


@pytest.mark.parametrize("temperature,spec", [(0.0, SpecParams("off")), (0.0, SpecParams("fixed", 4)),
                                              (0.8, SpecParams("off")), (0.8, SpecParams("fixed", 4))])
def test_preemption_never_changes_a_token(engine, random_models, tokenizer, temperature, spec):
    """A pool too small for the batch preempts sequences and recomputes them later: greedy and
    seeded sampled outputs are what they are with room for everyone; nothing leaks."""
    from cluster.engine.scheduling.kv_cache import block_bytes

    prompts = PROMPTS * 3
    params = [SamplingParams(max_tokens=40, ignore_eos=True, temperature=temperature, seed=i) for i in range(len(prompts))]
    roomy = engine.generate(prompts, params, spec, "model")
    target = load_model(random_models["llama"], torch.float32, "cpu")
    draft = load_model(random_models["llama_draft"], torch.float32, "cpu")
    s = target.shape
    gb = 80 * block_bytes(s.layers, 4, s.kv_heads, s.head_dim, torch.float32) / 2**30  # one sequence of 256 and a few more
    cfg = EngineConfig(max_num_seqs=8, max_model_len=256, block_size=4, max_batch_tokens=64, prefill_chunk=16,
                       kv_cache_gb=gb)
    tight = Engine(target, tokenizer, cfg, {"model": ModelDrafter(draft, 8, 256)}, "model")
    out = tight.generate(prompts, params, spec, "model")
    assert tight.scheduler.preemptions > 0
    assert [r["token_ids"] for r in out] == [r["token_ids"] for r in roomy]
    _clean(tight)
    _clean(engine)
