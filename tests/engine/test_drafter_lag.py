"""Drafter.lag through the engine: what a goodput controller is told turning speculation on
would make the drafters catch up (cluster.policy.controller prices a switch up by it)."""

import pytest
import torch

from cluster.engine.config import EngineConfig
from cluster.engine.drafters.model import ModelDrafter
from cluster.engine.engine import Engine
from cluster.engine.sampling import SamplingParams
from cluster.engine.scheduling.sequence import SpecParams
from cluster.engine.worker.loader import load_model
from cluster.policy import SpeculationPolicyConfig, make_controller

PROMPTS = ["def f(x):\n    return f(x)\n\ndef f(", "abcabcabcabcabc"]


@pytest.fixture(scope="module")
def engine(random_models, tokenizer):
    target = load_model(random_models["llama"], torch.float32, "cpu")
    draft = load_model(random_models["llama_draft"], torch.float32, "cpu")
    cfg = EngineConfig(max_num_seqs=8, max_model_len=256, block_size=4, max_batch_tokens=64)
    return Engine(target, tokenizer, cfg, {"model": ModelDrafter(draft, 8, 256)}, "model")


def test_drafters_lag_is_what_turning_speculation_on_would_catch_up(engine):
    """The tokens the draft model would run over before drafting (Drafter.lag), which the engine
    hands a goodput controller (`drafter_lag`, its price of switching up): every token of a row
    it never drafted for, at most a step's new ones of a row it drafts each step; only the rows
    the controller governs (spec "auto") count."""
    ctrl = make_controller(SpeculationPolicyConfig(mode="goodput", prior_acceptance=0.0))  # holds gamma 0
    engine.controller = ctrl
    try:
        params = SamplingParams(max_tokens=24, ignore_eos=True)
        auto = engine.seqs[engine.add_request(PROMPTS[0], params, SpecParams("auto"))]
        fixed = engine.seqs[engine.add_request(PROMPTS[1], params, SpecParams("fixed", 2))]
        for _ in range(40):
            engine.step()
            if auto.num_output >= 6 and fixed.num_output >= 6:
                break
        assert auto.num_output >= 6 and fixed.num_output >= 6
        assert fixed.stats.drafted > 0 and auto.stats.drafted == 0
        assert ctrl.gamma(2) == 0 and ctrl.drafter_lag() == len(auto.token_ids)  # never drafted: all of it
        # what the auto row may still produce: the switch's horizon (cluster.policy.switch)
        assert ctrl.tokens_left() == params.max_tokens - auto.num_output
        assert engine.planner.lag([fixed]) <= 3  # drafted last step: the tokens that step added
        assert engine.planner.lag([auto, fixed]) == len(auto.token_ids) + engine.planner.lag([fixed])
        while engine.has_work:
            engine.step()
    finally:
        engine.controller = None
    assert engine.kv.held() == (0, 0) and not engine.seqs and not engine.drafters["model"].state
