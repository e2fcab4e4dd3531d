"""The shipped demo pair: lossless speculation, real acceptance, a working CLI."""

import json
import subprocess
import sys

import pytest

from cluster.bench.workloads import code_prompts
from cluster.config import parse_config
from cluster.engine.sampling import SamplingParams
from cluster.engine.scheduling.sequence import SpecParams
from cluster.serve.build import build_engine


@pytest.fixture(scope="module")
def engine(demo_pair):
    return build_engine(parse_config({"engine": {"max_num_seqs": 16, "max_model_len": 768}}))


@pytest.fixture(scope="module")
def prompts():
    return code_prompts(4, chars=300, seed=3)


@pytest.fixture(scope="module")
def baseline(engine, prompts):
    return engine.generate(prompts, SamplingParams(max_tokens=64), SpecParams("off"))


@pytest.mark.parametrize("drafter", ["model", "ngram"])
@pytest.mark.parametrize("gamma", [1, 3, 5, 8])
def test_greedy_identical_to_plain_decoding(engine, prompts, baseline, drafter, gamma):
    out = engine.generate(prompts, SamplingParams(max_tokens=64), SpecParams("fixed", gamma), drafter)
    assert [r["token_ids"] for r in out] == [r["token_ids"] for r in baseline]
    assert engine.kv.held() == (0, 0)


def test_greedy_acceptance_at_gamma4_on_held_out_code(engine):
    out = engine.generate(code_prompts(16, seed=11), SamplingParams(max_tokens=128, ignore_eos=True),
                          SpecParams("fixed", 4), "model")
    drafted = sum(r["spec"]["drafted"] for r in out)
    accepted = sum(r["spec"]["accepted"] for r in out)
    assert accepted / drafted >= 0.5, f"acceptance {accepted / drafted:.2f}"


def test_cli_local_json(demo_pair):
    cmd = [sys.executable, "-m", "cluster.cli", "generate", "def parse_args(argv):\n", "--local", "--json",
           "--max-tokens", "32", "--speculation", "4"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert set(out) >= {"text", "token_ids", "finish_reason", "spec", "timing"}
    assert len(out["token_ids"]) == 32 and out["text"].strip()
    assert out["text"].isascii()
    assert set(out["spec"]) >= {"drafted", "accepted", "acceptance_rate", "mean_accepted_len", "per_position"}
    assert set(out["timing"]) >= {"ttft_ms", "itl_ms_p50", "total_ms"}


@pytest.mark.parametrize("args,needle", [
    (["--max-tokens", "0"], "max_tokens"),
    (["--temperature", "-1"], "temperature"),
    (["--top-p", "2"], "top_p"),
    (["--drafter", "eagle"], "invalid choice"),
    (["--speculation", "lots"], "--speculation"),
])
def test_cli_bad_arguments_exit_nonzero_with_one_line(args, needle):
    r = subprocess.run([sys.executable, "-m", "cluster.cli", "generate", "x", "--local", *args],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], r.stderr
