"""Log-probabilities of emitted tokens: the target's, at the token's position, whether the
token came from plain decoding, a draft chain or a draft tree; only for requests that ask."""

import pytest
import torch

from cluster.engine.config import EngineConfig
from cluster.engine.drafters.medusa import MedusaDrafter, MedusaHeads
from cluster.engine.drafters.model import ModelDrafter
from cluster.engine.drafters.ngram import NgramDrafter
from cluster.engine.engine import Engine
from cluster.engine.logprobs import emitted_logprobs
from cluster.engine.sampling import InvalidRequest, SamplingParams
from cluster.engine.scheduling.sequence import SpecParams
from cluster.engine.worker.loader import load_model

PROMPTS = ["def f(x):\n    return f(x)\n\ndef f(", "abcabcabcabcabc", "the quick brown fox " * 4]
TOL = 1e-4  # fp32: a (gamma+1)-token pass and a 1-token pass differ in summation order only


@pytest.fixture(scope="module")
def engine(random_models, tokenizer):
    target = load_model(random_models["llama"], torch.float32, "cpu")
    draft = load_model(random_models["llama_draft"], torch.float32, "cpu")
    cfg = EngineConfig(max_num_seqs=8, max_model_len=256, block_size=4, max_batch_tokens=128, gamma_max=16)
    e = Engine(target, tokenizer, cfg, {"ngram": NgramDrafter(), "model": ModelDrafter(draft, 8, 256)}, "model")
    torch.manual_seed(0)
    heads = MedusaHeads(target.shape.hidden, 4)
    for p in heads.parameters():
        torch.nn.init.normal_(p, std=0.3)
    e.drafters["tree"] = MedusaDrafter.for_target(heads, e.model, [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
    return e


@pytest.fixture(scope="module")
def reference(random_models, tokenizer, engine):
    """Greedy outputs with speculation off, and the Hugging Face model's log_softmax over
    prompt + output in one forward pass: at output position i, the distribution after token i-1."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(random_models["llama"], dtype=torch.float32).eval()
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=32, ignore_eos=True, logprobs=5), SpecParams("off"))
    dists = []
    for p, r in zip(PROMPTS, outs):
        ids = tokenizer.encode(p) + r["token_ids"]
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0].float()
        n = len(tokenizer.encode(p))
        dists.append(logits.log_softmax(-1)[n - 1:len(ids) - 1])  # [output, V]
    return outs, dists


def test_greedy_logprobs_are_the_targets_log_softmax(reference):
    outs, dists = reference
    for r, dist in zip(outs, dists):
        assert len(r["logprobs"]) == len(r["token_ids"]) == 32
        for i, (t, lp) in enumerate(zip(r["token_ids"], r["logprobs"])):
            assert lp.token_id == t
            assert lp.logprob == pytest.approx(dist[i, t].item(), abs=TOL)
            want_v, want_i = dist[i].topk(5)
            assert [a for a, _ in lp.top] == want_i.tolist()
            assert [v for _, v in lp.top] == pytest.approx(want_v.tolist(), abs=TOL)
            assert lp.top[0][0] == t and lp.top[0][1] == pytest.approx(lp.logprob, abs=1e-6)  # greedy: the argmax


@pytest.mark.parametrize("drafter,gamma", [("model", 4), ("ngram", 3), ("tree", 6)])
def test_speculation_gives_the_same_logprobs(engine, reference, drafter, gamma):
    outs, _ = reference
    spec = engine.generate(PROMPTS, SamplingParams(max_tokens=32, ignore_eos=True, logprobs=5),
                           SpecParams("fixed", gamma), drafter)
    assert sum(r["spec"]["drafted"] for r in spec) > 0
    for a, b in zip(outs, spec):
        assert b["token_ids"] == a["token_ids"]
        for x, y in zip(a["logprobs"], b["logprobs"]):
            assert y.logprob == pytest.approx(x.logprob, abs=TOL)
            assert [i for i, _ in y.top] == [i for i, _ in x.top]
    assert engine.kv.held() == (0, 0)


@pytest.mark.parametrize("drafter,gamma", [("model", 4), ("medusa", 8)])
def test_accepted_drafts_carry_the_targets_logprobs(demo_pair, drafter, gamma):
    """The trained demo pair accepts drafts, so most tokens here come through speculation."""
    from cluster.bench.workloads import code_prompts
    from cluster.config import parse_config
    from cluster.serve.build import build_engine

    e = build_engine(parse_config({"models": {"drafter": drafter}, "engine": {"max_num_seqs": 4, "max_model_len": 512},
                                   "speculation": {"gamma_max": 16}}))
    prompts = code_prompts(3, chars=200, seed=5)
    params = SamplingParams(max_tokens=48, ignore_eos=True, logprobs=3)
    plain = e.generate(prompts, params, SpecParams("off"))
    spec = e.generate(prompts, params, SpecParams("fixed", gamma))
    assert sum(r["spec"]["accepted"] for r in spec) > 48
    for a, b in zip(plain, spec):
        assert b["token_ids"] == a["token_ids"]
        assert [y.logprob for y in b["logprobs"]] == pytest.approx([x.logprob for x in a["logprobs"]], abs=TOL)
        assert [[i for i, _ in y.top] for y in b["logprobs"]] == [[i for i, _ in x.top] for x in a["logprobs"]]


def test_k_alternatives_per_request_and_none_unless_asked(engine):
    params = [SamplingParams(max_tokens=12, ignore_eos=True, logprobs=k) for k in (None, 0, 2)]
    params.append(SamplingParams(max_tokens=12, ignore_eos=True, temperature=1.0, seed=3, logprobs=1))
    outs = engine.generate(PROMPTS + ["z"], params, SpecParams("fixed", 4))
    assert outs[0]["logprobs"] == []
    assert [len(lp.top) for lp in outs[1]["logprobs"]] == [0] * 12
    assert [len(lp.top) for lp in outs[2]["logprobs"]] == [2] * 12
    # sampled: the raw distribution's log-probability (vLLM's default), never above the top-1
    for lp in outs[3]["logprobs"]:
        assert lp.logprob <= lp.top[0][1] + 1e-6 and lp.logprob <= 0


def test_stop_keeps_logprobs_in_step_with_tokens(engine):
    out = engine.generate(["abcabcabcabcabc"], SamplingParams(max_tokens=40, logprobs=1, stop=["c"]),
                          SpecParams("fixed", 4), "ngram")[0]
    assert len(out["logprobs"]) == len(out["token_ids"]) > 0
    assert [lp.token_id for lp in out["logprobs"]] == out["token_ids"]


@pytest.mark.parametrize("k", [-1, 6, True, 1.5])
def test_out_of_range_is_refused(engine, k):
    with pytest.raises(InvalidRequest, match="logprobs"):
        engine.add_request("abc", SamplingParams(logprobs=k))
    assert not engine.seqs


def test_emitted_logprobs_reads_each_tokens_own_position():
    logits = torch.randn(2, 4, 10)
    out = emitted_logprobs(logits, [None, 2], [[1, 2], [3, 4, 5]], [[0, 1], [0, 2, 3]])
    assert out[0] is None
    ref = logits[1].log_softmax(-1)
    assert [lp.logprob for lp in out[1]] == pytest.approx([ref[0, 3].item(), ref[2, 4].item(), ref[3, 5].item()])
    assert [len(lp.top) for lp in out[1]] == [2, 2, 2]
