"""Speculative steps launched ahead (cluster.engine.spec.ahead) give the tokens of steps that
wait for the host, greedy and seeded sampled, through finishes by EOS, stop strings and length,
aborts, late arrivals, mixed gammas and preemption, and give every block back.

The engine under test runs the real GraphRunner, ModelDrafter and SpecPipeline with the CPU
stand-in for CUDA graphs (cluster.engine.worker.capture.eager_on_cpu); its reference is the
same engine with `spec_ahead` off, whose speculative steps each wait for the host.
"""

import pytest
import torch

from cluster.engine.config import EngineConfig
from cluster.engine.engine import Engine
from cluster.engine.sampling import SamplingParams
from cluster.engine.scheduling.sequence import SpecParams
from cluster.engine.worker.capture import eager_on_cpu
from cluster.engine.worker.loader import load_model
from tests.engine.test_pipeline import preempted_after, run


def make_engine(demo_pair, ahead: bool, kv_blocks: int | None = None) -> Engine:
    """The demo pair (its drafter agrees with its target often: acceptance is what a launch
    ahead builds on) in float32, CUDA graphs by the CPU stand-in."""
    from cluster.engine.scheduling.kv_cache import block_bytes

    target, draft = demo_pair
    gb = None
    if kv_blocks is not None:
        s = load_model(target, torch.float32, "cpu").shape
        gb = kv_blocks * block_bytes(s.layers, 4, s.kv_heads, s.head_dim, torch.float32) / 2**30
    cfg = EngineConfig(max_num_seqs=8, max_model_len=96, block_size=4, max_batch_tokens=64, prefill_chunk=16,
                       gamma_max=4, spec_ahead=ahead, kv_cache_gb=gb, dtype="float32")
    with eager_on_cpu():
        e = Engine.from_pretrained(target, draft, "model", cfg)
    assert (e.spec_ahead is not None) == ahead and e.runner.graphs is not None
    return e


@pytest.fixture(scope="module")
def engines(demo_pair):
    return make_engine(demo_pair, False), make_engine(demo_pair, True)


def _greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True, **kw)


def _settled(e: Engine) -> None:
    assert e.kv.held() == (0, 0) and not e.seqs and not e.has_work
    assert e.kv.pool.num_used == 0


def test_steps_launched_ahead_give_the_tokens_of_waiting_steps(engines):
    """Rows ending by length (one at max_model_len), by a stop string and by an abort, one
    arriving mid-run, rows of different gammas in one batch: every token is the same, most
    steps used a launch ahead, and the blocks all come back."""
    g3, g2 = SpecParams("fixed", 3), SpecParams("fixed", 2)
    script = {
        0: [("add", "def f(x):\n    return", _greedy(40), g3), ("add", "abcabc", _greedy(7), g3),
            ("add", "hello there", _greedy(30, stop=["\x86"]), g3), ("add", "zzz", _greedy(200), g2)],
        6: [("add", "the quick brown fox", _greedy(12), g3)],  # arrives mid-run
        11: [("abort", 0)],
        14: [("add", "x = [1, 2", _greedy(9), SpecParams("off"))]}  # plain beside speculative rows
    p = engines[1].spec_ahead
    hits, fresh = p.hits, p.fresh
    want, got = (run(e, script) for e in engines)
    assert got == want and all(got.values())
    assert len(got[3]) == 96 - len(engines[0].tokenizer.encode("zzz"))  # ran into max_model_len
    assert p.hits - hits > 10 and p.hits - hits > 2 * (p.fresh - fresh)
    assert p.deferred_rows > 0 and p.dropped_rows > 0
    for e in engines:
        _settled(e)


def test_eos_mid_launch_ends_the_row_without_an_extra_token(engines):
    """A row whose accepted tokens hold EOS had its next step launched: nothing after EOS
    reaches the client and the row ends where waiting steps end it."""
    spec = SpecParams("fixed", 3)
    prompt = "def f(x):\n    return"
    free = engines[0].generate([prompt], _greedy(30), spec)[0]["token_ids"]
    eos = free[9]
    saved = [e.eos for e in engines]
    try:
        for e in engines:
            e.eos = eos
        want, got = (e.generate([prompt], SamplingParams(max_tokens=30), spec)[0]["token_ids"] for e in engines)
    finally:
        for e, x in zip(engines, saved):
            e.eos = x
    assert got == want == free[: free.index(eos) + 1]
    for e in engines:
        _settled(e)


def _sampled(n: int, seed: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.8, seed=seed, ignore_eos=True, **kw)


def test_seeded_sampled_rows_run_ahead_with_their_seeds_tokens(engines):
    """Seeded sampled rows (temperature, top-p, top-k) beside a greedy one run ahead,
    rejection sampling on the device, and give the waiting engine's tokens through a finish by
    length, a stop string, an abort and a late arrival (each dropped launch sets its rows'
    generators back); a row asking for logprobs steps the waiting way."""
    g3 = SpecParams("fixed", 3)
    script = {
        0: [("add", "def f(x):\n    return", _sampled(40, 1), g3), ("add", "abcabc", _sampled(9, 2, top_p=0.9), g3),
            ("add", "hello there", _sampled(30, 3, top_k=20, stop=["e"]), g3), ("add", "zzz", _greedy(30), g3)],
        6: [("add", "the quick brown fox", _sampled(20, 4), g3)],  # arrives mid-run
        11: [("abort", 3)]}
    p = engines[1].spec_ahead
    hits, dropped = p.hits, p.dropped_rows
    want, got = (run(e, script) for e in engines)
    assert got == want and all(got.values())
    assert p.hits - hits > 10 and p.dropped_rows - dropped >= 3
    fresh = p.fresh
    lp = engines[1].generate(["ab"], _greedy(6, logprobs=1), g3)[0]
    assert p.fresh == fresh and len(lp["token_ids"]) == 6 and len(lp["logprobs"]) == 6
    for e in engines:
        _settled(e)


def test_preempted_rows_drop_their_launch_and_recompute(demo_pair):
    """A pool too small for the batch preempts rows a launch covered: their launched rows are
    dropped, they are recomputed later, and no token differs from a roomy engine's."""
    prompts = ["def f(x):\n    return", "abcabc", "hello there", "zzz", "the quick brown fox", "x = [1, 2"]
    params = [_greedy(40) if i % 2 else _sampled(40, i) for i in range(len(prompts))]  # seeded rows set back
    spec = SpecParams("fixed", 3)
    roomy = make_engine(demo_pair, False).generate(prompts, params, spec)
    tight = make_engine(demo_pair, True, kv_blocks=36)
    out = tight.generate(prompts, params, spec)
    assert [r["token_ids"] for r in out] == [r["token_ids"] for r in roomy]
    assert tight.scheduler.preemptions > 0 and tight.spec_ahead.hits > 0 and tight.spec_ahead.dropped_rows > 0
    _settled(tight)


def test_the_drafter_holds_what_it_was_fed(engines):
    """After steps launched ahead the drafter's KV state names a prefix of the sequence's
    tokens (what it caught up), so a step the usual way resumes from there."""
    e = engines[1]
    sid = e.add_request("def f(x):\n    return", _greedy(30), SpecParams("fixed", 3))
    seq = e.seqs[sid]
    for _ in range(8):
        e.step()
    held = e.drafters["model"].tokens_held(sid)
    assert e.spec_ahead.ahead is not None and held == seq.token_ids[: len(held)] and len(held) >= len(seq.token_ids) - 4
    e.spec_ahead.interrupt([seq])  # as a step of another kind does
    while e.has_work:
        e.step()
    _settled(e)


def test_a_rows_gamma_caps_what_it_accepts_in_a_wider_step(engines):
    """A row of gamma 0 in a batch of gamma 3 is fed the step's width but takes one token a
    step, and a row of gamma 1 at most two: a gamma bounds acceptance as it does waiting."""
    e = engines[1]
    specs = {e.add_request("def f(x):\n    return", _greedy(24), SpecParams("fixed", 3)): 4,
             e.add_request("def g(y):\n    return", _greedy(24), SpecParams("off")): 1,
             e.add_request("x = [1, 2", _greedy(24), SpecParams("fixed", 1)): 2}
    hits, most = e.spec_ahead.hits, {sid: 0 for sid in specs}
    while e.has_work:
        for o in e.step():
            if o.seq_id in most and o.num_prompt and len(o.token_ids) and not o.finished:
                most[o.seq_id] = max(most[o.seq_id], len(o.token_ids))
    assert e.spec_ahead.hits - hits > 5
    assert all(most[sid] <= cap for sid, cap in specs.items())
    assert most[next(iter(specs))] > 2  # the gamma-3 row did take more than two at once
    _settled(e)


@pytest.mark.parametrize("gamma", [1, 2, 4])
def test_the_drafter_state_after_a_drained_launch_drafts_as_a_fresh_drafter(engines, gamma):
    """A row arriving mid-run makes the next step run the launched rows without a launch
    after them: the drafter then holds the tokens it was fed and no more, so drafting from
    its state gives what a drafter with no state drafts."""
    from cluster.engine.drafters.base import DraftRequest
    from cluster.engine.drafters.model import ModelDrafter

    e = engines[1]
    sid = e.add_request("def f(x):\n    return", _greedy(40), SpecParams("fixed", gamma))
    for _ in range(6):
        e.step()
    deferred = e.spec_ahead.deferred_rows
    late = e.add_request("abcabc", _greedy(4), SpecParams("fixed", gamma))
    while e.spec_ahead.deferred_rows == deferred:
        e.step()
    assert e.spec_ahead.ahead is None  # drained: nothing launched after the step the late row waited
    d, seq = e.drafters["model"], e.seqs[sid]
    fresh = ModelDrafter(d.runner.model, 4, 128)
    req = DraftRequest(sid, list(seq.token_ids), 4, seq.params)
    assert d.propose([req]).tokens == fresh.propose([req]).tokens
    e.abort(sid)
    e.abort(late)
    _settled(e)


def test_a_failing_drafter_costs_launches_not_tokens(engines, monkeypatch):
    """The drafter raising in a launch ahead, then in every call: the steps run without a
    launch, then without drafts (the planner's fallback), and every token is still the
    waiting engine's."""
    e = engines[1]
    spec, prompt = SpecParams("fixed", 3), "def f(x):\n    return"
    want = engines[0].generate([prompt], _greedy(30), spec)[0]["token_ids"]
    d = e.drafters["model"]
    failures = e.spec_ahead.draft_failures

    def broken(*args, **kw):
        raise RuntimeError("drafter lost")

    monkeypatch.setattr(d, "launch_ahead", broken)
    assert e.generate([prompt], _greedy(30), spec)[0]["token_ids"] == want
    assert e.spec_ahead.draft_failures > failures
    monkeypatch.setattr(d, "launch", broken)
    monkeypatch.setattr(d, "propose_async", broken)
    assert e.generate([prompt], _greedy(30), spec)[0]["token_ids"] == want
    _settled(e)


def test_a_launch_whose_rows_all_left_sets_their_seeds_back(engines):
    """A seeded row preempted while its next step was launched (its only row): the next step
    starts afresh, and the dropped launch's draws are given back, so the row's tokens are the
    waiting engine's without the preemption."""
    prompt, params, spec = "def f(x):\n    return", _sampled(30, 5), SpecParams("fixed", 3)
    want = engines[0].generate([prompt], params, spec)[0]["token_ids"]
    e = engines[1]
    assert preempted_after(e, 5, prompt, params, spec, lambda: e.spec_ahead.ahead) == want
    _settled(e)


def test_a_step_launched_ahead_reports_its_drafting_apart(engines, monkeypatch):
    """A step launched ahead has no host-side split of its time: its drafting and its verify
    pass are read from the stream's timers (here the stand-in's, on a clock the test moves, so
    nothing depends on how fast the machine is), not from the host, whose wall time for such a
    step can be a launch already done or two passes' worth. Drafting that took an hour on the
    stream's clock reports an hour and a verify pass that took none reports none, and the other
    way round, however long the host side took."""
    from cluster.engine.worker import capture

    clock = [0.0]
    monkeypatch.setattr(capture._Clock, "record", lambda self: setattr(self, "t", clock[0]))
    e = engines[1]
    d, p = e.drafters["model"], e.spec_ahead
    launch_ahead, launch_rows = d.launch_ahead, p.graphs.launch_rows

    def slow(call):  # work that takes an hour on the stream's clock
        def run(*args, **kw):
            clock[0] += 3600.0
            return call(*args, **kw)
        return run

    seen = []
    monkeypatch.setattr(e, "on_verify", seen.append)
    prompt, spec = "def f(x):\n    return", SpecParams("fixed", 3)
    for slowed in ("draft", "verify"):
        monkeypatch.setattr(d, "launch_ahead", slow(launch_ahead) if slowed == "draft" else launch_ahead)
        monkeypatch.setattr(p.graphs, "launch_rows", slow(launch_rows) if slowed == "verify" else launch_rows)
        seen.clear()
        hits, totals = p.hits, dict(e.totals)
        e.generate([prompt], _greedy(30), spec)
        assert p.hits - hits >= 3
        ahead = [o for o in seen if (o.draft_s, o.verify_s) in ((3600.0, 0.0), (0.0, 3600.0))]
        assert len(ahead) >= p.hits - hits
        assert all((o.draft_s == 3600.0) == (slowed == "draft") for o in ahead)
        grown = {k: e.totals[k] - totals[k] for k in ("draft_s", "verify_s")}
        # the totals already held other tests' seconds: the difference is exact only to rounding
        assert grown["draft_s" if slowed == "draft" else "verify_s"] >= 3600.0 * len(ahead) * (1 - 1e-12)
    _settled(e)


def test_a_probes_last_step_launches_no_step_after_it(engines):
    """Where the controller says the step it chose is the last speculative one before plain
    decoding (a probe up's last: `ends_speculation`), no step is launched after it, which plain
    decoding would drop: every auto step runs afresh, with the tokens of steps that wait. A row
    of fixed gamma beside them keeps the launches going: the controller does not govern it."""
    from cluster.policy import SpeculationPolicyConfig, make_controller

    ref, e = engines
    p, prompts = e.spec_ahead, ["def f(x):\n    return", "x = [1, 2"]
    want = [r["token_ids"] for r in ref.generate(prompts, _greedy(30), SpecParams("fixed", 3))]
    ctrl = make_controller(SpeculationPolicyConfig(mode="fixed", gamma=3))
    ctrl.ends_speculation = True  # every step a probe's last (the goodput controller says so per step)
    e.controller = ctrl
    try:
        hits, fresh = p.hits, p.fresh
        assert [r["token_ids"] for r in e.generate(prompts, _greedy(30), SpecParams("auto"))] == want
        assert p.hits == hits and p.fresh - fresh >= 5  # nothing launched ahead, nothing dropped
        sids = [e.add_request(prompts[0], _greedy(30), SpecParams("auto")),
                e.add_request(prompts[1], _greedy(30), SpecParams("fixed", 3))]
        got = {sid: [] for sid in sids}
        hits = p.hits
        while e.has_work:
            for o in e.step():
                got[o.seq_id] += o.token_ids
        assert [got[sid] for sid in sids] == want and p.hits - hits >= 3
        # a row that drafts nothing (speculation off) does not keep them going
        sids = [e.add_request(prompts[0], _greedy(30), SpecParams("auto")),
                e.add_request(prompts[1], _greedy(30), SpecParams("off"))]
        got, hits = {sid: [] for sid in sids}, p.hits
        while e.has_work:
            for o in e.step():
                got[o.seq_id] += o.token_ids
        assert [got[sid] for sid in sids] == want and p.hits == hits
    finally:
        e.controller = None
    _settled(e)
