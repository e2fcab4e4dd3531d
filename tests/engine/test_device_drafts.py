"""Drafts left on the device (Drafter.launch, DraftPlanner.launch): the verify pass reads a
draft model's or an EAGLE-3 head's chain where it was drafted, and the host reads drafts and verify results in
one wait. The tokens are those of drafts sent through the host, greedy and seeded sampled,
on eager passes and on the graph path (cluster.engine.worker.capture's stand-in)."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch

from cluster.engine.config import EngineConfig
from cluster.engine.drafters.base import DraftRequest
from cluster.engine.drafters.eagle3 import Eagle3Drafter
from cluster.engine.drafters.model import ModelDrafter
from cluster.engine.engine import Engine
from cluster.engine.sampling import SamplingParams
from cluster.engine.scheduling.sequence import SpecParams
from cluster.engine.worker.capture import eager_on_cpu
from cluster.engine.worker.loader import load_model
from tests.engine.eagle3_factory import random_head

PROMPTS = ["def f(x):\n    return f(x)\n\ndef f(", "abcabcabcabcabc", "z", "the quick brown fox " * 6, "x = [1, 2, 3]\n"]


@pytest.fixture(scope="module")
def models(random_models):
    return (load_model(random_models["llama"], torch.float32, "cpu"),
            load_model(random_models["llama_draft"], torch.float32, "cpu"))


def _engine(models, tokenizer, graphs: bool, drafter: str = "model") -> Engine:
    # steps that wait for the host (a step launched ahead drafts on the device its own way:
    # tests/engine/test_spec_ahead.py)
    cfg = EngineConfig(max_num_seqs=8, max_model_len=256, block_size=4, max_batch_tokens=128, gamma_max=6,
                       prefill_chunk=32, spec_ahead=False)
    with eager_on_cpu() if graphs else nullcontext():
        d = ModelDrafter(models[1], 16, 256) if drafter == "model" else Eagle3Drafter(random_head(models[0], 100), 16, 300)
        e = Engine(models[0], tokenizer, cfg, {drafter: d}, drafter)
    assert (e.runner.graphs is not None) == graphs
    return e


def _run(engine: Engine) -> list[list[int]]:
    """Greedy and seeded sampled rows at gammas 2 and 4 beside a row that does not speculate,
    all in one batch."""
    rows = [(SamplingParams(max_tokens=30, ignore_eos=True), SpecParams("fixed", 4)),
            (SamplingParams(max_tokens=30, temperature=0.9, seed=1, ignore_eos=True), SpecParams("fixed", 2)),
            (SamplingParams(max_tokens=30, ignore_eos=True), SpecParams("off")),
            (SamplingParams(max_tokens=30, temperature=1.2, top_k=20, seed=2, ignore_eos=True), SpecParams("fixed", 4)),
            (SamplingParams(max_tokens=30, ignore_eos=True), SpecParams("fixed", 3))]
    ids = [engine.add_request(p, params, spec) for p, (params, spec) in zip(PROMPTS, rows)]
    got = {i: [] for i in ids}
    while engine.has_work:
        for o in engine.step():
            got[o.seq_id] += o.token_ids
    assert engine.kv.held() == (0, 0) and not engine.seqs
    return [got[i] for i in ids]


@pytest.mark.parametrize("drafter", ["model", "eagle3"])
@pytest.mark.parametrize("graphs", [False, True])
def test_drafts_fed_on_the_device_give_the_tokens_of_drafts_fed_from_the_host(models, tokenizer, graphs, drafter):
    host, device = _engine(models, tokenizer, graphs, drafter), _engine(models, tokenizer, graphs, drafter)
    host.runner.carries_drafts = False  # the drafts reach the verify pass through the host
    want, got = _run(host), _run(device)
    assert got == want
    assert host.planner.counts["drafts_on_device"] == 0 and host.totals["drafted"] > 0
    assert device.planner.counts["drafts_on_device"] > 10
    assert device.totals["drafted"] == host.totals["drafted"] and device.totals["accepted"] == host.totals["accepted"]


def test_launch_leaves_each_rows_drafts_on_the_device(models):
    """ids [rows, most drafts] hold each row's drafts and -1 past them; counts are known at
    launch; a row past the drafter's length or asking for none drafts nothing."""
    d = ModelDrafter(models[1], 8, 64)
    for params in (SamplingParams(), SamplingParams(temperature=0.8, seed=4)):
        reqs = [DraftRequest("a", list(range(5, 17)), 4, params), DraftRequest("b", [7, 8, 9], 2, params),
                DraftRequest("c", list(range(3, 63)), 5, params), DraftRequest("d", [4, 5], 0, params)]
        pending = d.launch(reqs)
        assert pending.counts == [4, 2, 0, 0]
        ids = pending.device_ids().tolist()
        out = pending.finish()
        assert [len(t) for t in out.tokens] == [4, 2, 0, 0]
        assert ids == [t + [-1] * (4 - len(t)) for t in out.tokens]
        assert [q.shape[0] for q in out.q_ids] == [4, 2, 0, 0]
        d.release([r.seq_id for r in reqs])


def test_a_failing_launch_costs_the_drafts_not_the_tokens(models, tokenizer):
    """A drafter that raises while launching: those steps verify without drafts, and the
    greedy tokens are plain decoding's."""
    e = _engine(models, tokenizer, False)
    plain = e.generate(PROMPTS[:2], SamplingParams(max_tokens=20, ignore_eos=True), SpecParams("off"))
    d = e.drafters["model"]
    launch, calls = d.launch, []

    def flaky(reqs):
        calls.append(len(reqs))
        if len(calls) % 2:
            raise RuntimeError("out of memory")
        return launch(reqs)

    d.launch = flaky
    got = e.generate(PROMPTS[:2], SamplingParams(max_tokens=20, ignore_eos=True), SpecParams("fixed", 3))
    assert [r["token_ids"] for r in got] == [r["token_ids"] for r in plain]
    assert e.planner.counts["draft_failures"] == (len(calls) + 1) // 2 > 0
    assert e.planner.counts["drafts_on_device"] > 0 and e.kv.held() == (0, 0)
