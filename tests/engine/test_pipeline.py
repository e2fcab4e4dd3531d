"""Greedy decoding a step ahead (cluster.engine.worker.pipeline) gives the tokens of plain stepping,
through finishes by EOS, stop strings and length, aborts, late arrivals and mixed batches.

The pipelined engine runs the real GraphRunner and DecodePipeline with the CPU stand-in for
CUDA graphs (cluster.engine.worker.capture.eager_on_cpu): only the capture and replay calls are
eager, so the classes' signatures and bookkeeping are what the GPU runs.
"""

import pytest
import torch

from cluster.engine.config import EngineConfig
from cluster.engine.drafters.model import ModelDrafter
from cluster.engine.drafters.ngram import NgramDrafter
from cluster.engine.engine import Engine
from cluster.engine.sampling import SamplingParams
from cluster.engine.scheduling.sequence import SpecParams
from cluster.engine.worker.capture import eager_on_cpu
from cluster.engine.worker.loader import load_model


def make_engine(random_models, tokenizer, pipelined: bool) -> Engine:
    target = load_model(random_models["llama"], torch.float32, "cpu")
    draft = load_model(random_models["llama_draft"], torch.float32, "cpu")
    cfg = EngineConfig(max_num_seqs=8, max_model_len=96, block_size=4, max_batch_tokens=64)
    if not pipelined:
        return Engine(target, tokenizer, cfg, {"ngram": NgramDrafter(), "model": ModelDrafter(draft, 16, 96)}, "model")
    with eager_on_cpu():
        e = Engine(target, tokenizer, cfg, {"ngram": NgramDrafter(), "model": ModelDrafter(draft, 16, 96)}, "model")
    assert e.pipeline is not None and e.pipeline.graphs is e.runner.graphs
    return e


def tight_engine(random_models, tokenizer) -> Engine:
    """A pipelined engine whose pool (40 blocks of 4 tokens) is too small for six rows of 40
    new tokens: it preempts."""
    from cluster.engine.scheduling.kv_cache import block_bytes

    target = load_model(random_models["llama"], torch.float32, "cpu")
    s = target.shape
    gb = 40 * block_bytes(s.layers, 4, s.kv_heads, s.head_dim, torch.float32) / 2**30
    cfg = EngineConfig(max_num_seqs=8, max_model_len=96, block_size=4, max_batch_tokens=64, prefill_chunk=16,
                       kv_cache_gb=gb)
    with eager_on_cpu():
        return Engine(target, tokenizer, cfg, {}, None)


def run(engine: Engine, script) -> dict[str, list[int]]:
    """script: {step number: [("add", prompt, params, spec) | ("abort", index)]}; returns
    each request's tokens by index."""
    sids, out, step = [], {}, 0
    while True:
        for action in script.get(step, []):
            if action[0] == "add":
                sids.append(engine.add_request(action[1], action[2], action[3]))
            else:
                engine.abort(sids[action[1]])
        if not engine.has_work and step > max(script):
            break
        for o in engine.step() if engine.has_work else []:
            out.setdefault(o.seq_id, []).extend(o.token_ids)
        step += 1
    return {i: out.get(s, []) for i, s in enumerate(sids)}


@pytest.fixture(scope="module")
def engines(random_models, tokenizer):
    return make_engine(random_models, tokenizer, False), make_engine(random_models, tokenizer, True)


def test_pipelined_greedy_decoding_matches_plain_steps(engines):
    off, greedy = SpecParams("off"), SamplingParams(max_tokens=40, ignore_eos=True)
    script = {
        0: [("add", "def f(x):\n    return", greedy, off), ("add", "abcabc", SamplingParams(max_tokens=7), off)],
        3: [("add", "the quick brown fox", SamplingParams(max_tokens=30, stop=["o"]), off)],  # arrives mid-run
        9: [("abort", 0)],
        12: [("add", "zzz", SamplingParams(max_tokens=200, ignore_eos=True), off),  # runs into max_model_len
             ("add", "xyz", SamplingParams(max_tokens=12, temperature=0.8, seed=5), off),  # sampled: not pipelined
             ("add", "hello", greedy, SpecParams("fixed", 3))],  # speculative rows: not pipelined
    }
    plain, piped = (run(e, script) for e in engines)
    assert piped == plain
    assert all(piped.values()) and len(piped[3]) == 96 - 3  # the long one stopped at max_model_len
    assert engines[1].pipeline.hits > 20  # most plain steps used the launch ahead
    assert engines[1].pipeline.launched > engines[1].pipeline.hits  # some were dropped
    for e in engines:
        assert e.kv.held() == (0, 0) and not e.seqs and not e.has_work


def test_launch_ahead_is_dropped_when_rows_change(engines):
    e = engines[1]
    e.pipeline.interrupt()  # as after a speculative step
    a = e.add_request("one", SamplingParams(max_tokens=8, ignore_eos=True), SpecParams("off"))
    e.step()  # prefill
    e.step()  # the first plain step after an interruption launches nothing (a probe wastes no pass)
    assert e.pipeline.ahead is None
    e.step()  # the second launches the next one ahead
    assert e.pipeline.ahead is not None
    hits = e.pipeline.hits
    e.abort(a)
    b = e.add_request("two", SamplingParams(max_tokens=3, ignore_eos=True), SpecParams("off"))
    while e.has_work:
        e.step()
    assert e.pipeline.hits == hits + 1  # the second decode step of "two" only: "one"'s launch was dropped
    assert b not in e.seqs and e.kv.held() == (0, 0)


def _greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True, **kw)


# rows ending by length, by a stop string and by an abort, and one arriving mid-run (run's script)
FINISHES_AND_ARRIVALS = {
    0: [("add", "def f(x):\n    return", _greedy(40), SpecParams("off")), ("add", "abcabc", _greedy(6), SpecParams("off")),
        ("add", "hello there", _greedy(30, stop=["\x86"]), SpecParams("off")), ("add", "zzz", _greedy(30), SpecParams("off"))],
    9: [("add", "the quick brown fox", _greedy(12), SpecParams("off"))],
    14: [("abort", 3)]}
TIGHT_PROMPTS = ["def f(x):\n    return", "abcabc", "hello there", "zzz", "the quick brown fox", "x = [1, 2"]


def test_a_launch_ahead_outlives_finishes_and_arrivals(random_models, tokenizer):
    """Rows ending (by length, a stop string, an abort) drop only their own launched rows, and a
    row that arrives after a launch waits one step and joins the next: after the first two
    decode steps no step runs afresh, and every token is plain stepping's."""
    script = FINISHES_AND_ARRIVALS
    plain, piped = make_engine(random_models, tokenizer, False), make_engine(random_models, tokenizer, True)
    expected, got = run(plain, script), run(piped, script)
    assert got == expected and all(got.values())
    assert len(got[2]) < 30  # the stop string ended it
    p = piped.pipeline
    assert p.fresh == 2  # the first decode step (it launches nothing) and the second (nothing was launched)
    assert p.deferred_rows == 1  # the late arrival waited one step
    assert p.dropped_rows >= 2  # "abcabc" (length) and the aborted row at least
    assert p.hits > 20
    assert piped.kv.held() == (0, 0) and not piped.seqs


def test_a_launch_ahead_survives_preemption(random_models, tokenizer):
    """A pool too small for the batch preempts rows that a launch covered: their launched rows
    are dropped, they are recomputed later, and no token differs from roomy plain stepping."""
    prompts = TIGHT_PROMPTS
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    roomy = make_engine(random_models, tokenizer, False).generate(prompts, params, SpecParams("off"))
    tight = tight_engine(random_models, tokenizer)
    out = tight.generate(prompts, params, SpecParams("off"))
    assert tight.scheduler.preemptions > 0 and tight.pipeline.hits > 0 and tight.pipeline.dropped_rows > 0
    assert [r["token_ids"] for r in out] == [r["token_ids"] for r in roomy]
    assert tight.kv.held() == (0, 0) and not tight.seqs


def test_sampled_rows_run_ahead_with_their_seeds_tokens(engines):
    """Seeded sampled rows (temperature, top-p, top-k) run a step ahead and give plain stepping's
    tokens: through finishes, an abort, a late arrival, and a speculative row whose steps drop
    every launch (each dropped draw sets its row's generator back)."""
    off = SpecParams("off")
    sampled = lambda n, seed, **kw: SamplingParams(max_tokens=n, temperature=0.8, seed=seed, ignore_eos=True, **kw)  # noqa: E731
    script = {
        0: [("add", "def f(x):\n    return", sampled(40, 1), off),
            ("add", "abcabc", sampled(9, 2, top_p=0.9), off),
            ("add", "hello there", sampled(30, 3, top_k=20), off),
            ("add", "zzz", SamplingParams(max_tokens=30, ignore_eos=True), off)],  # greedy beside them
        6: [("add", "the quick brown fox", sampled(20, 4, stop=["o"]), off)],  # arrives mid-run
        11: [("abort", 3)],
        16: [("add", "x = [1, 2", SamplingParams(max_tokens=6, ignore_eos=True), SpecParams("fixed", 3))],
    }
    p = engines[1].pipeline
    hits, dropped = p.hits, p.dropped_rows  # the engines are the module's: count this run only
    plain, piped = (run(e, script) for e in engines)
    assert piped == plain and all(piped.values())
    # sampled rows ran ahead, and launches were dropped under them
    assert p.hits - hits > 10 and p.dropped_rows - dropped >= 3
    for e in engines:
        assert e.kv.held() == (0, 0) and not e.seqs


def test_sampled_rows_run_ahead_through_preemption(random_models, tokenizer):
    """Preempted sampled rows had draws launched for them: set back, their recomputed rows draw
    what roomy plain stepping drew."""
    prompts = ["def f(x):\n    return", "abcabc", "hello there", "zzz", "the quick brown fox", "x = [1, 2"]
    params = [SamplingParams(max_tokens=40, temperature=0.9, seed=i, ignore_eos=True) for i in range(len(prompts))]
    roomy = make_engine(random_models, tokenizer, False)
    expected = [roomy.generate([p], q, SpecParams("off"))[0]["token_ids"] for p, q in zip(prompts, params)]
    tight = tight_engine(random_models, tokenizer)
    ids = [tight.add_request(p, q, SpecParams("off")) for p, q in zip(prompts, params)]
    got: dict[str, list[int]] = {}
    while tight.has_work:
        for o in tight.step():
            got.setdefault(o.seq_id, []).extend(o.token_ids)
    assert tight.scheduler.preemptions > 0 and tight.pipeline.hits > 0 and tight.pipeline.dropped_rows > 0
    assert [got[i] for i in ids] == expected
    assert tight.kv.held() == (0, 0) and not tight.seqs


def test_eos_ends_rows_run_ahead_without_an_extra_token(engines):
    """A row that draws EOS had its next step launched already: that launched token never
    reaches the client, greedy or sampled, and the row ends with EOS where plain stepping's
    does. EOS here is a token the rows draw mid-way (the random model's own EOS is rare)."""
    off = SpecParams("off")
    greedy = SamplingParams(max_tokens=30)
    sampled = SamplingParams(max_tokens=30, temperature=0.8, seed=11)
    prompts = ["def f(x):\n    return", "hello there"]
    plain, piped = engines
    free = [plain.generate([p], SamplingParams(max_tokens=30, ignore_eos=True, temperature=q.temperature, seed=q.seed),
                           off)[0]["token_ids"] for p, q in zip(prompts, (greedy, sampled))]
    eos = free[1][6]  # the sampled row's seventh token; the greedy row may draw it too
    script = {0: [("add", prompts[0], greedy, off), ("add", prompts[1], sampled, off)]}
    saved = plain.eos, piped.eos
    try:
        plain.eos = piped.eos = eos
        launched = piped.pipeline.launched
        want, got = run(plain, script), run(piped, script)
    finally:
        plain.eos, piped.eos = saved
    assert got == want
    assert got[1] == free[1][: free[1].index(eos) + 1]  # ends with EOS, nothing after it
    assert piped.pipeline.launched > launched
    for e in engines:
        assert e.kv.held() == (0, 0) and not e.seqs


def test_a_row_preempted_between_steps_drops_its_launch(engines):
    """A row preempted while its next step was launched comes back at the same table row and
    length after recomputing: it must not take that launch, whose K/V write went with its old
    blocks; its tokens are plain stepping's without the preemption."""
    plain, piped = engines
    prompt, params = "def f(x):\n    return", SamplingParams(max_tokens=30, ignore_eos=True)
    want = plain.generate([prompt], params, SpecParams("off"))[0]["token_ids"]
    assert preempted_after(piped, 5, prompt, params, SpecParams("off"), lambda: piped.pipeline.ahead) == want
    assert piped.kv.held() == (0, 0) and not piped.seqs


def preempted_after(engine: Engine, steps: int, prompt: str, params: SamplingParams, spec: SpecParams, launched
                    ) -> list[int]:
    """The tokens of one request preempted after `steps` steps, between two steps, as a dry pool
    preempts (`launched()` must then show a launch ahead in flight)."""
    sid = engine.add_request(prompt, params, spec)
    got = []
    for _ in range(steps):
        got += [t for o in engine.step() for t in o.token_ids]
    assert launched() is not None
    engine.scheduler.preempt(engine.seqs[sid])
    while engine.has_work:
        got += [t for o in engine.step() for t in o.token_ids]
    return got
