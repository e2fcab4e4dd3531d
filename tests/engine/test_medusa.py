"""Medusa heads and tree verification: tree attention is exact, acceptance is lossless."""

import copy

import pytest
import torch
from scipy.stats import chisquare

from cluster.engine.engine import Engine
from cluster.engine.scheduling.kv_cache import KVCache
from cluster.engine.drafters.medusa import (
    CHAIN,
    MedusaDrafter,
    MedusaHeads,
    independent_score,
    sparse_tree,
    tree_parents,
)
from cluster.engine.config import EngineConfig
from cluster.engine.sampling import SamplingParams
from cluster.engine.scheduling.sequence import SpecParams
from cluster.engine.spec.acceptance import accept_tree, walk
from cluster.engine.worker.loader import load_model
from cluster.engine.worker.runner import Runner
from cluster.engine.worker.tree import keep_path, tree_layout

PROMPTS = ["def f(x):\n    return f(x)\n\ndef f(", "abcabcabcabcabc", "z", "the quick brown fox " * 6]
SHAPES = {
    "chain": CHAIN[:4],
    "flat": [[0], [1], [2], [3]],
    "binary": [[0], [1], [0, 0], [0, 1], [1, 0], [1, 1], [0, 0, 0], [0, 0, 1], [1, 0, 0]],
}


def test_tree_layout_depths_and_ancestors():
    depth, mask = tree_layout([[-1, -1, 0, 2], None], 6, "cpu")
    assert depth[0, :5].tolist() == [0, 1, 1, 2, 3] and depth[1].tolist() == list(range(6))
    # node 3 (feed 4) sees root, node 0, node 2 and itself, never its uncle (node 1)
    assert mask[0, 4, :5].tolist() == [True, True, False, True, True]
    assert mask[1].equal(torch.ones(6, 6, dtype=torch.bool).tril())


def test_tree_paths_are_checked_and_sparse_tree_is_prefix_closed():
    assert tree_parents([[0], [1], [0, 0], [1, 0]]) == [-1, -1, 0, 1]
    for bad in ([[0, 0], [0]], [[0], [0]], [[]]):
        with pytest.raises(ValueError):
            tree_parents(bad)
    tree = sparse_tree(independent_score([[0.6, 0.2, 0.1], [0.5, 0.2, 0.1], [0.4, 0.1, 0.1]]), 3, 3, 20)
    assert tree[:3] == [[0], [0, 0], [1]] and len(tree) == 20  # 0.6, 0.3, 0.2
    for n in range(1, 21):
        tree_parents(tree[:n])  # every prefix is a tree


@pytest.fixture(scope="module")
def target(random_models):
    return load_model(random_models["llama"], torch.float32, "cpu")


def test_tree_attention_matches_each_path_run_alone(target):
    s = target.shape
    kv = KVCache.dense(s.layers, 2, 64, s.kv_heads, s.head_dim, torch.float32, "cpu")
    runner = Runner(target, kv, "sdpa")
    prefix, parents, nodes = [5, 9, 13, 2, 7], [-1, -1, 0, 0, 1, 2], [40, 41, 42, 43, 44, 45]
    runner.forward([0], [0], [prefix[:-1]], last_only=True)
    tree = runner.forward([0], [4], [[prefix[-1]] + nodes], last_only=False, trees=[parents])[0]
    for i in range(len(nodes)):
        path, j = [], i
        while j >= 0:
            path.insert(0, nodes[j])
            j = parents[j]
        chain = runner.forward([1], [0], [prefix + path], last_only=True)[0]
        torch.testing.assert_close(tree[i + 1], chain, atol=1e-4, rtol=1e-4)
    # the accepted path's K/V, moved into place, are what a chain pass writes
    keep_path(kv, kv.handles[0], 4, [1, 4])
    runner.forward([1], [0], [prefix + [41, 44]], last_only=True)
    at = [torch.tensor(kv.host_slots(h, list(range(7)))) for h in kv.handles]
    for cache in (kv.k, kv.v):
        flat = cache.flatten(1, 2)
        torch.testing.assert_close(flat[:, at[0]], flat[:, at[1]])


def test_walk_follows_the_target():
    draws = iter([7, 8, 3])  # root -> 7 (node 1), node 1 -> 8 (node 3), node 3 -> 3 (no child)
    path, tok = walk([-1, -1, 0, 1], [6, 7, 8, 8], lambda i: next(draws))
    assert (path, tok) == ([1, 3], 3)


@pytest.mark.parametrize("first", [0, 2])
def test_sampled_walk_keeps_the_target_distribution(first):
    """Tiny vocabulary, a tree whose root children are {0, 1} and node 0's child is 2:
    the first token follows p_root and the second, after a child was taken, p at that child."""
    V, n = 6, 15_000
    p = torch.tensor([[0.3, 0.2, 0.1, 0.1, 0.2, 0.1],     # root
                      [0.05, 0.05, 0.5, 0.2, 0.1, 0.1],   # at node 0 (token 0)
                      [0.2, 0.2, 0.2, 0.2, 0.1, 0.1],     # at node 1 (token 1)
                      [1 / 6] * 6], dtype=torch.float64)  # at node 2
    parents, tokens = [-1, -1, 0], [first, 1, 2]
    gen = torch.Generator().manual_seed(first)
    params = SamplingParams(temperature=1.0)
    emitted = []
    for _ in range(n):
        path, tok = accept_tree(parents, tokens, p.float().log(), params, gen)
        emitted.append([tokens[i] for i in path] + [tok])
    firsts = torch.tensor([e[0] for e in emitted])
    assert chisquare(torch.bincount(firsts, minlength=V).double(), p[0] * n).pvalue > 1e-4
    for node in (0, 1):  # second token given the walk moved to that root child
        seconds = torch.tensor([e[1] for e in emitted if e[0] == tokens[node] and len(e) > 1])
        counts = torch.bincount(seconds, minlength=V).double()
        assert chisquare(counts, p[node + 1] / p[node + 1].sum() * counts.sum()).pvalue > 1e-4


# ---- the engine, random model and random heads (exactness, not acceptance) ----------------

@pytest.fixture(scope="module")
def engine(target, tokenizer):
    e = Engine(target, tokenizer, EngineConfig(max_num_seqs=8, max_model_len=256, block_size=4, max_batch_tokens=128,
                                               gamma_max=16))
    torch.manual_seed(0)
    heads = MedusaHeads(target.shape.hidden, 4)
    for p in heads.parameters():
        torch.nn.init.normal_(p, std=0.3)
    for name, shape in SHAPES.items():
        e.drafters[name] = MedusaDrafter.for_target(heads, e.model, shape)
    return e


@pytest.fixture(scope="module")
def baseline(engine):
    return engine.generate(PROMPTS, SamplingParams(max_tokens=40, ignore_eos=True), SpecParams("off"))


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("gamma", [2, 9])
def test_greedy_tree_speculation_is_token_identical(engine, baseline, shape, gamma):
    out = engine.generate(PROMPTS, SamplingParams(max_tokens=40, ignore_eos=True), SpecParams("fixed", gamma), shape)
    assert [r["token_ids"] for r in out] == [r["token_ids"] for r in baseline]
    assert all(r["spec"]["drafted"] > 0 for r in out)
    assert engine.kv.held() == (0, 0) and not engine.seqs


def test_sampled_tree_speculation_matches_plain_decoding_seed_for_seed(engine):
    """The walk draws exactly what plain decoding draws, so a seed gives the same tokens."""
    params = [SamplingParams(max_tokens=30, temperature=t, top_p=tp, seed=s, ignore_eos=True)
              for s, (t, tp) in enumerate([(1.0, 1.0), (0.7, 0.9), (1.3, 1.0), (0.5, 0.5)])]
    plain = engine.generate(PROMPTS, params, SpecParams("off"))
    tree = engine.generate(PROMPTS, params, SpecParams("fixed", 9), "binary")
    assert [r["token_ids"] for r in tree] == [r["token_ids"] for r in plain]


def test_mixed_batch_and_chain_fallback(engine, baseline):
    """Tree rows, chain rows (the no-mask fallback) and sampled rows share verify passes."""
    chain = engine.drafters["binary"]
    chain.tree_ok = False  # as on FA3: the top-1 path only, verified as a plain row
    try:
        greedy = SamplingParams(max_tokens=40, ignore_eos=True)
        ids = [engine.add_request(p, greedy, SpecParams("fixed", g), d)
               for p, g, d in zip(PROMPTS, [9, 3, 0, 5], ["flat", "binary", "chain", "chain"])]
        noise = [engine.add_request("xyz" * 4, SamplingParams(max_tokens=30, temperature=1.0, seed=s),
                                    SpecParams("fixed", 6), "chain") for s in range(2)]
        got = {i: [] for i in ids + noise}
        while engine.has_work:
            for o in engine.step():
                got[o.seq_id] += o.token_ids
        assert [got[i] for i in ids] == [r["token_ids"] for r in baseline]
        assert engine.kv.held() == (0, 0)
    finally:
        chain.tree_ok = True


def test_heads_save_and_load(tmp_path, engine):
    heads = engine.drafters["chain"].heads
    heads.save(tmp_path, {"tree": SHAPES["binary"]})
    again, cfg = MedusaHeads.load(tmp_path)
    assert cfg["tree"] == SHAPES["binary"] and cfg["num_heads"] == 4
    h = torch.randn(2, heads.hidden)
    w = engine.model.lm_head.weight
    stored = copy.deepcopy(heads).to(torch.bfloat16).float()  # the file holds bf16
    torch.testing.assert_close(again(h, w), stored(h, w))
    with pytest.raises(FileNotFoundError):
        MedusaHeads.load(tmp_path / "nowhere")


# ---- the demo target with its trained heads -------------------------------------------------

@pytest.fixture(scope="module")
def demo(demo_pair):
    from cluster.config import parse_config
    from cluster.serve.build import build_engine

    e = build_engine(parse_config({"models": {"drafter": "medusa"},
                                   "engine": {"max_num_seqs": 8, "max_model_len": 768},
                                   "speculation": {"gamma_max": 32}}))
    assert "medusa" in e.drafters and e.default_drafter == "medusa"
    return e


@pytest.mark.parametrize("shape,gamma", [("trained", 4), ("trained", 16), ("trained", 32), ("chain", 4),
                                         ("binary", 9)])
def test_demo_greedy_identical_and_accepting(demo, shape, gamma):
    from cluster.bench.workloads import code_prompts

    prompts = code_prompts(3, chars=300, seed=3)
    medusa = demo.drafters["medusa"]
    if shape != "trained":
        demo.drafters[shape] = MedusaDrafter.for_target(medusa.heads, demo.model, SHAPES[shape])
    base = demo.generate(prompts, SamplingParams(max_tokens=48), SpecParams("off"))
    out = demo.generate(prompts, SamplingParams(max_tokens=48), SpecParams("fixed", gamma),
                        "medusa" if shape == "trained" else shape)
    assert [r["token_ids"] for r in out] == [r["token_ids"] for r in base]
    steps = sum(r["spec"]["verify_steps"] for r in out)
    mean_len = (sum(r["spec"]["accepted"] for r in out) + steps) / steps
    assert mean_len > 1.3, f"mean accepted length {mean_len:.2f}"


def test_demo_sampled_matches_plain_decoding_seed_for_seed(demo):
    from cluster.bench.workloads import code_prompts

    prompts = code_prompts(2, chars=300, seed=5)
    params = [SamplingParams(max_tokens=48, temperature=0.8, seed=11), SamplingParams(max_tokens=48, temperature=1.0,
                                                                                      top_k=20, seed=12)]
    plain = demo.generate(prompts, params, SpecParams("off"))
    tree = demo.generate(prompts, params, SpecParams("fixed", 16), "medusa")
    assert [r["token_ids"] for r in tree] == [r["token_ids"] for r in plain]
    assert sum(r["spec"]["accepted"] for r in tree) > 0


def test_cli_local_medusa(demo_pair):
    import json
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "cluster.cli", "generate", "def parse_args(argv):\n", "--local", "--json",
           "--max-tokens", "24", "--speculation", "8", "--drafter", "medusa"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert len(out["token_ids"]) == 24 and out["spec"]["drafted"] > 0
