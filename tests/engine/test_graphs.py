"""The CUDA-graph path on CPU: the real GraphRunner, DecodePipeline and EAGLE-3 HeadGraphs with
the eager stand-in for capture and replay (cluster.engine.worker.capture.eager_on_cpu) give the
tokens of eager passes, for plain decoding and every drafter.

Only the hardware call is replaced: buffers, bucket padding, table rows, lengths, the shared
logits and aux buffers, launch-ahead and graph keys are the classes' own, so a signature or
bookkeeping change that breaks the GPU path breaks these tests.
"""

from __future__ import annotations

import pytest
import torch

from cluster.engine.config import EngineConfig
from cluster.engine.drafters.eagle3 import Eagle3Drafter
from cluster.engine.drafters.base import DraftRequest
from cluster.engine.drafters.early_exit import EarlyExitDrafter
from cluster.engine.drafters.medusa import CHAIN, MedusaDrafter, MedusaHeads
from cluster.engine.drafters.model import ModelDrafter
from cluster.engine.drafters.ngram import NgramDrafter
from cluster.engine.engine import Engine
from cluster.engine.sampling import SamplingParams
from cluster.engine.scheduling.sequence import SpecParams
from cluster.engine.worker.capture import _EagerGraph, eager_on_cpu
from cluster.engine.worker.loader import load_model
from tests.engine.eagle3_factory import random_head

PROMPTS = ["def f(x):\n    return f(x)\n\ndef f(", "abcabcabcabcabc", "z", "the quick brown fox " * 6, "x = [1, 2, 3]\n"]
GREEDY = SamplingParams(max_tokens=40, ignore_eos=True)


def build(random_models, tokenizer, medusa: bool) -> Engine:
    target = load_model(random_models["llama"], torch.float32, "cpu")
    draft = load_model(random_models["llama_draft"], torch.float32, "cpu")
    head = random_head(target, 100)
    torch.manual_seed(0)
    heads = MedusaHeads(target.shape.hidden, 4)
    for p in heads.parameters():
        torch.nn.init.normal_(p, std=0.3)
    cfg = EngineConfig(max_num_seqs=8, max_model_len=256, block_size=4, max_batch_tokens=128, gamma_max=6,
                       prefill_chunk=32)
    drafters = {"ngram": NgramDrafter(), "model": ModelDrafter(draft, 16, 256),
                "eagle3": Eagle3Drafter(head, 16, 300), "eagle3-tree": Eagle3Drafter(head, 16, 300, tree_width=3)}
    e = Engine(target, tokenizer, cfg, drafters, "model")
    e.drafters["early-exit"] = EarlyExitDrafter(e.runner, 1)
    if medusa:  # a drafter that reads the target's hidden states: no step runs ahead in its engine
        # a chain: the GPU's attention kernel has no tree masks, so Medusa drafts chains there
        e.drafters["medusa"] = MedusaDrafter.for_target(heads, e.model, CHAIN[:4])
    return e


def pair(random_models, tokenizer, medusa: bool) -> tuple[Engine, Engine]:
    eager = build(random_models, tokenizer, medusa)
    with eager_on_cpu():
        graphs = build(random_models, tokenizer, medusa)
    assert eager.runner.graphs is None and graphs.runner.graphs is not None
    return eager, graphs


@pytest.fixture(scope="module")
def engines(random_models, tokenizer) -> tuple[Engine, Engine]:
    return pair(random_models, tokenizer, False)


@pytest.fixture(scope="module")
def medusa_engines(random_models, tokenizer) -> tuple[Engine, Engine]:
    return pair(random_models, tokenizer, True)


def replays(engine: Engine) -> int:
    runners = {id(r): r for r in [engine.runner] + [getattr(d, "runner", None) for d in engine.drafters.values()] if r}
    gs = [g.graph for r in runners.values() if r.graphs for g in r.graphs.graphs.values()]
    heads = [d.graphs for d in engine.drafters.values() if getattr(d, "graphs", None)]
    gs += [p.graph for h in heads for p in [*h.steps.values(), *h.catch_ups.values()]]
    assert all(isinstance(g, _EagerGraph) for g in gs)
    return sum(g.replays for g in gs)


def test_warm_up_captures_every_step_shape(engines):
    g = engines[1].runner.graphs
    widths = {w for (_, w, layers) in g.graphs if layers is None}
    assert set(range(1, 8)) <= widths  # every verify width up to gamma_max + 1
    assert {bk for (bk, _, _) in g.graphs} == {1, 2, 4, 8}  # buckets up to max_num_seqs
    assert g.prefill_widths and max(widths) == 32  # prefill widths up to the chunk


@pytest.mark.parametrize("drafter", [None, "model", "ngram", "medusa", "early-exit", "eagle3", "eagle3-tree"])
def test_graph_steps_give_the_eager_tokens(request, drafter):
    engines = request.getfixturevalue("medusa_engines" if drafter == "medusa" else "engines")
    eager, graphs = engines
    spec = SpecParams("off") if drafter is None else SpecParams("fixed", 3)
    before = replays(graphs)
    want = eager.generate(PROMPTS, GREEDY, spec, drafter)
    got = graphs.generate(PROMPTS, GREEDY, spec, drafter)
    assert [r["token_ids"] for r in got] == [r["token_ids"] for r in want]
    assert [r["spec"]["accepted"] for r in got] == [r["spec"]["accepted"] for r in want]
    assert replays(graphs) > before
    if drafter is not None:
        assert sum(r["spec"]["drafted"] for r in got) > 0
    for e in engines:
        assert e.kv.held() == (0, 0) and not e.seqs


def test_plain_greedy_runs_a_step_ahead(engines):
    p = engines[1].pipeline
    hits = p.hits
    engines[1].generate(PROMPTS[:2], GREEDY, SpecParams("off"))
    assert p.hits > hits + 30  # most of 2 x 40 steps were launched ahead and used


def test_model_drafter_and_eagle3_steps_replay_graphs(engines):
    graphs = engines[1]
    d = graphs.drafters["model"].runner.graphs
    assert any(w == 1 for (_, w, _) in d.graphs)  # draft steps
    assert any(w > 1 for (_, w, _) in d.graphs)  # catch-up passes
    head = graphs.drafters["eagle3"].graphs
    assert head.steps  # the head's one-token steps
    assert {w for (_, w) in head.catch_ups} == set(range(1, 10))  # catch-up widths up to a verify row
    before = sum(p.graph.replays for p in head.catch_ups.values())
    graphs.generate(PROMPTS[:2], GREEDY, SpecParams("fixed", 3), "eagle3")
    assert sum(p.graph.replays for p in head.catch_ups.values()) > before + 10  # after each verify step
    graphs.generate(PROMPTS[:1], GREEDY, SpecParams("fixed", 2), "early-exit")  # not left to another test
    assert any(layers == 1 for (_, _, layers) in graphs.runner.graphs.graphs)  # early exit's first layer


def test_a_greedy_chain_of_equal_lengths_is_one_graph_replay(engines):
    """The model drafter's chain after its catch-up: rows drafting as many tokens replay one
    chain graph (k - 1 steps in it) and draft what eager steps draft; rows of different
    lengths step one graph at a time, as before, with the same drafts."""
    eager, graphs = engines
    d_eager, d_graph = eager.drafters["model"], graphs.drafters["model"]

    def chains() -> dict:
        return {k: g.graph.replays for k, g in d_graph.runner.graphs.graphs.items() if k[1] < 0}

    # captured at warm-up: batches up to 16 rows, 2 to the engine's gamma_max + 1 drafts (a look-ahead's)
    captured = set(chains())
    assert captured == {(b, -k, None) for b in (1, 2, 4, 8, 16) for k in range(2, 8)}
    ids = [eager.tokenizer.encode(p) for p in PROMPTS[:3]]
    for n, ks in enumerate(([4, 4, 4], [2, 5, 3], [5, 5, 5])):
        reqs = [DraftRequest(f"chain-{n}-{i}", t, k, GREEDY) for i, (t, k) in enumerate(zip(ids, ks))]
        before = chains()
        want, got = d_eager.propose(reqs), d_graph.propose(reqs)
        assert got.tokens == want.tokens and [len(t) for t in got.tokens] == ks
        after = chains()
        replayed = {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}
        # one replay of the chain graph for 3 rows (bucket 4), keyed by its length negated
        assert replayed == ({(4, -ks[0], None): 1} if len(set(ks)) == 1 else {})
        for d in (d_eager, d_graph):
            d.release([r.seq_id for r in reqs])
    assert set(chains()) == captured  # nothing captured while drafting


def test_eagle3_catch_up_past_its_graph_rows_runs_eagerly(engines, monkeypatch):
    """Batches wider than CATCH_UP_ROWS catch up in an eager pass (no graph captured for them
    at start); draft steps still replay graphs; the tokens are the eager engine's."""
    from cluster.engine.drafters import eagle3_graphs

    eager, graphs = engines
    head = graphs.drafters["eagle3"].graphs
    monkeypatch.setattr(eagle3_graphs, "CATCH_UP_ROWS", 2)
    assert not head.fits(4, 3) and head.fits(2, 3) and head.fits(8)
    keys, steps = set(head.catch_ups), sum(p.graph.replays for p in head.steps.values())
    spec = SpecParams("fixed", 3)
    want = eager.generate(PROMPTS, GREEDY, spec, "eagle3")
    got = graphs.generate(PROMPTS, GREEDY, spec, "eagle3")
    assert [r["token_ids"] for r in got] == [r["token_ids"] for r in want]
    assert set(head.catch_ups) == keys  # nothing captured while serving
    assert sum(p.graph.replays for p in head.steps.values()) > steps
