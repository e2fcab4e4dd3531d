"""Tensor parallelism on CPU (gloo, fp32): a target split over ranks produces exactly the
tokens one process produces, for plain decoding, every colocated drafter and seeded sampling,
and with an fp8 KV cache; nothing leaks; a dead rank is an error on rank 0, not a hang."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from cluster.engine.config import EngineConfig
from cluster.engine.distributed.ranks import start_ranks
from cluster.engine.drafters.early_exit import EarlyExitDrafter
from cluster.engine.drafters.model import ModelDrafter
from cluster.engine.drafters.ngram import NgramDrafter
from cluster.engine.engine import Engine
from cluster.engine.sampling import SamplingParams
from cluster.engine.scheduling.sequence import SpecParams
from cluster.engine.worker.loader import load_model
from cluster.engine.worker.model import ModelShape
from cluster.engine.worker.sharding import kv_heads_of, local_shape, take, vocab_rows, weight_slice

REPO = Path(__file__).resolve().parents[2]
PROMPTS = ["def f(x):\n    return f(x)\n\ndef f(", "abcabcabcabcabc", "z", "the quick brown fox " * 6]
GREEDY = SamplingParams(max_tokens=32, ignore_eos=True)


def _shape(path) -> ModelShape:
    from transformers import AutoConfig

    return ModelShape.from_hf(AutoConfig.from_pretrained(path))


def _engine(random_models, tokenizer, tp: int) -> Engine:
    cfg = EngineConfig(max_num_seqs=8, max_model_len=256, block_size=4, max_batch_tokens=64, tensor_parallel_size=tp)
    group = start_ranks(str(random_models["llama"]), cfg) if tp > 1 else None
    target = load_model(random_models["llama"], torch.float32, "cpu", group)
    draft = load_model(random_models["llama_draft"], torch.float32, "cpu")
    e = Engine(target, tokenizer, cfg, {"ngram": NgramDrafter(), "model": ModelDrafter(draft, 8, 256)}, "model")
    e.drafters["early-exit"] = EarlyExitDrafter(e.runner, layers=1)
    return e


@pytest.fixture(scope="module")
def single(random_models, tokenizer):
    return _engine(random_models, tokenizer, 1)


@pytest.fixture(scope="module")
def split(random_models, tokenizer):
    """Rank 0 of two, in this process (a process holds one group: other group sizes run in
    their own processes, tests.engine.tp_rank0). Headers carry 16 payload values inline
    (sent to the followers at setup), so decode steps' headers go in one broadcast and
    prefill chunks' in two."""
    from cluster.engine.distributed import ranks

    inline, ranks.INLINE = ranks.INLINE, 16
    try:
        e = _engine(random_models, tokenizer, 2)
    finally:
        ranks.INLINE = inline
    assert e.runner.inline == 16
    yield e
    e.close()
    assert all(not p.is_alive() for p in e.runner.group.procs), "a follower outlived STOP"


@pytest.mark.parametrize("drafter,spec", [(None, SpecParams("off")), ("model", SpecParams("fixed", 4)),
                                          ("ngram", SpecParams("fixed", 3)), ("early-exit", SpecParams("fixed", 2))])
def test_greedy_tokens_match_one_process(single, split, drafter, spec):
    want = single.generate(PROMPTS, GREEDY, spec, drafter)
    got = split.generate(PROMPTS, GREEDY, spec, drafter)
    assert [r["token_ids"] for r in got] == [r["token_ids"] for r in want]
    if drafter in ("model", "early-exit"):
        assert sum(r["spec"]["drafted"] for r in got) > 0, "it speculated"
    assert split.kv.held() == (0, 0) and not split.seqs
    assert split.runner.broadcasts[1] > 0 and split.runner.broadcasts[2] > 0  # inline headers, and longer ones


def test_seeded_sampling_matches_one_process(single, split):
    sp = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.9, seed=11, ignore_eos=True)
    for spec in (SpecParams("off"), SpecParams("fixed", 3)):
        want = single.generate(PROMPTS, sp, spec, "model")
        got = split.generate(PROMPTS, sp, spec, "model")
        assert [r["token_ids"] for r in got] == [r["token_ids"] for r in want]
    assert split.kv.held() == (0, 0)


def test_mixed_prefill_keeps_separate_steps_under_tensor_parallelism(split):
    """The followers' header describes one padded pass: rank 0's runner does not mix (the
    engine keeps prefill and verify steps apart there) and refuses a mixed pass outright."""
    assert not split.runner.can_mix and not split.scheduler.mixed
    with pytest.raises(NotImplementedError):
        split.runner.forward_mixed(([0], [0], [[1]]), ([1], [0], [[1, 2]]))


def test_each_rank_holds_its_own_kv_heads(split, single):
    """The KV pool of a rank has its share of the KV heads (here 2 heads over 2 ranks: one)."""
    assert split.kv.k.shape[-2] == single.kv.k.shape[-2] // 2
    assert split.model.shape.heads == single.model.shape.heads // 2
    assert split.model.lm_head.weight.shape[0] == single.model.shape.vocab_size // 2


@pytest.mark.parametrize("size", [2, 4])
def test_shards_reassemble_the_weights(random_models, size):
    """Every rank's slices, read lazily from the safetensors file, put back together are the
    model's weights: q and MLP rows and o/down columns split in order, KV heads split, or
    with fewer KV heads than ranks (2 over 4) each rank holding its q heads' KV head."""
    from safetensors import safe_open

    path = random_models["llama"]
    shape, full = _shape(path), load_file(path / "model.safetensors")
    parts = {r: {} for r in range(size)}
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            for r in range(size):
                sl = f.get_slice(name)
                parts[r][name] = take(sl, sl.get_shape(), weight_slice(name, shape, r, size))
    p = "model.layers.1."
    for name, dim in ((p + "self_attn.q_proj.weight", 0), (p + "mlp.gate_proj.weight", 0),
                      (p + "self_attn.o_proj.weight", 1), (p + "mlp.down_proj.weight", 1),
                      ("model.embed_tokens.weight", 0), ("lm_head.weight", 0)):
        assert torch.equal(torch.cat([parts[r][name] for r in range(size)], dim), full[name]), name
    d = shape.head_dim
    for r in range(size):
        first, n = kv_heads_of(shape, r, size)
        q_heads = range(r * shape.heads // size, (r + 1) * shape.heads // size)
        group = shape.heads // shape.kv_heads
        assert {h // group for h in q_heads} == set(range(first, first + n)), "q heads read their own KV heads"
        assert torch.equal(parts[r][p + "self_attn.k_proj.weight"], full[p + "self_attn.k_proj.weight"][first * d:(first + n) * d])
        assert torch.equal(parts[r][p + "input_layernorm.weight"], full[p + "input_layernorm.weight"])
    assert local_shape(shape, size).kv_heads == max(1, shape.kv_heads // size)


def test_vocab_slices_pad_the_last_rank():
    t = torch.arange(10.0)[:, None].repeat(1, 3)
    start, rows = vocab_rows(10, 2, 3)
    assert (start, rows) == (8, 4)
    part = take(t, list(t.shape), (0, start, start + rows))
    assert torch.equal(part[:2], t[8:]) and not part[2:].any()


@pytest.mark.parametrize("size,heads,kv", [(3, 4, 2), (4, 8, 3), (2, 4, 2)])
def test_shapes_that_do_not_split_are_refused(random_models, size, heads, kv):
    from dataclasses import replace

    from cluster.engine.worker.sharding import check

    shape = replace(_shape(random_models["llama"]), heads=heads, kv_heads=kv)
    if heads % size == 0 and (kv % size == 0 if kv >= size else size % kv == 0):
        check(shape, size)
    else:
        with pytest.raises(ValueError, match="tensor_parallel_size"):
            check(shape, size)


def _rank0(*args, timeout: float) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-m", "tests.engine.tp_rank0", *map(str, args)], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=timeout)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_killed_rank_is_an_error_on_rank_0_not_a_hang(random_models):
    """SIGKILL rank 1 mid-generation: rank 0's next step raises RankFailure naming the rank,
    well before the step timeout (30 s here), and the process exits."""
    t0 = time.perf_counter()
    out = _rank0("kill", random_models["llama"], 2, timeout=240)
    assert out["error"] == "RankFailure", out
    assert "rank 1" in out["message"] and out["seconds"] < 30, out
    assert time.perf_counter() - t0 < 240


def test_a_rank_that_fails_says_why_and_ends(random_models):
    """A follower whose shard cannot load logs its error and ends at once (leaving the group
    after a failure can wait forever on its peers); rank 0's start is a RankFailure naming it."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-m", "tests.engine.tp_rank0", "follower-fails", random_models["llama"], "2"],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["error"] == "RankFailure" and "rank 1 (exit code 1) gone" in got["message"], got
    assert got["seconds"] < 30, got  # well before the 30 s step timeout
    assert "rank 1 of 2 failed; ending this rank" in out.stderr and "/nonexistent/target" in out.stderr


def test_fp8_cache_matches_one_process_on_every_rank(random_models):
    """An fp8 KV cache over 2 ranks (rank 0 in its own process, tests.engine.tp_rank0): each
    rank calibrates on its own heads and the ranks take the maximum, so every rank holds the
    same scales, the one-process engine's up to fp32 rounding; greedy tokens are the
    one-process fp8 engine's, plain and with the draft model speculating (lossless relative
    to the quantized target)."""
    from tests.engine.tp_rank0 import fp8_engine, fp8_tokens

    target, draft = random_models["llama"], random_models["llama_draft"]
    one = fp8_engine(target, draft, 1)
    want = fp8_tokens(one)
    got = _rank0("fp8", target, 2, draft, timeout=300)
    assert want["spec"] == want["plain"] and want["drafted"] > 0
    assert got["plain"] == want["plain"] and got["spec"] == want["plain"]
    assert got["drafted"] > 0 and got["held"] == [0, 0]
    rank0, *followers = (torch.tensor(s) for s in got["scales"])
    assert len(followers) == 1 and all(torch.equal(s, rank0) for s in followers), "every rank the same scales"
    # Not bit for bit: past layer 0 the residual stream adds the ranks' partial o_proj and
    # down_proj sums (the all-reduce) where one process sums in one matmul, so activations
    # and their amaxes differ by rounding (on this model, layer 1's k scale by one ulp).
    # Taking each rank's own amax instead (vLLM's calc_kv_scales) misses by far more.
    torch.testing.assert_close(rank0, one.kv.scales, rtol=1e-5, atol=0)


def test_graphs_replay_in_lockstep_on_every_rank(random_models):
    """CUDA graphs under tensor parallelism (the CPU stand-in runs each graph's body at every
    replay, collectives included): 2 ranks give the one-process graph engine's greedy tokens,
    plain and with the draft model, and its seeded samples; every graph rank 0 replayed, the
    follower replayed as often (the same graph each pass, so their collectives pair up), and
    plain and verify widths both ran as graphs. Plain decoding ran launched ahead on both
    ranks, the follower's launches fed by rank 0's drawn tokens (AnnouncedGraphs), speculative
    steps too, and verify passes that waited for the host read the draft model's drafts on the
    device on both ranks; close freed every graph
    on both ranks."""
    target, draft = random_models["llama"], random_models["llama_draft"]
    want = _rank0("graphs", target, 1, draft, timeout=300)
    got = _rank0("graphs", target, 2, draft, timeout=300)
    assert want["spec"] == want["plain"]
    for key in ("plain", "spec", "sampled", "sampled_waiting", "sampled_plain"):
        assert got[key] == want[key], key
    assert got["sampled_waiting"] == got["sampled"]  # a seed's tokens, launched ahead or not
    assert got["ahead"]["hits"] > 10 and got["ahead"]["launched"] >= got["ahead"]["hits"], got["ahead"]
    # speculative steps launched ahead: the follower's verify passes read their rows' tokens
    # and lengths from rank 0's device (AnnouncedGraphs.launch_rows), step for step
    assert got["spec_ahead"] == want["spec_ahead"] and got["spec_ahead"]["hits"] > 10, got["spec_ahead"]
    # the draft model's drafts fed the verify passes from rank 0's device, broadcast to the follower's
    assert got["drafts_on_device"] == want["drafts_on_device"] > 10
    assert got["held"] == [0, 0]
    replayed = {k: n for k, n in got["replays"].items() if n}
    assert got["followers"] == [got["replays"]], "the follower replays rank 0's graphs, pass for pass"
    # NCCL's teardown waits forever for a live graph that captured its collectives
    assert got["released"] and got["followers_released"] == [True], "close frees every rank's graphs"
    widths = {ast.literal_eval(k)[1] for k in replayed}  # keys are (batch bucket, width, layers)
    assert 1 in widths and 5 in widths, replayed


def test_launch_ahead_keeps_every_token_through_finishes_aborts_and_preemption(random_models):
    """Plain decoding launched ahead on 2 ranks (AnnouncedGraphs): rows ending by length, a stop
    string and an abort, a row arriving mid-run, and six rows preempted in a pool of 40 blocks
    a rank give the one-process pipelined engine's tokens, with the same launches used,
    deferred and dropped, and every block back on both."""
    target = random_models["llama"]
    want = _rank0("pipeline", target, 1, timeout=300)
    got = _rank0("pipeline", target, 2, timeout=300)
    assert got["script"] == want["script"] and all(got["script"].values())
    assert got["tight"] == want["tight"]
    for part in ("script", "tight"):
        assert got[part + "_counts"] == want[part + "_counts"], part
    counts, tight = got["script_counts"], got["tight_counts"]
    assert counts["hits"] > 20 and counts["deferred_rows"] == 1 and counts["dropped_rows"] >= 2, counts
    assert tight["preemptions"] > 0 and tight["hits"] > 0 and tight["blocks"] == 40, tight
    assert counts["held"] == tight["held"] == [0, 0]


def test_eagle3_head_matches_one_process(demo_pair):
    """The demo target's EAGLE-3 head drafting chains over 2 ranks (as build_engine builds
    it, rank 0 in its own process): rank 0 captures the aux layers' inputs, the residual
    stream every rank holds whole, so the head sees the one-process states and drafts the
    same tokens; greedy tokens and each request's drafted and accepted counts are the
    one-process engine's."""
    want = _rank0("eagle3", demo_pair[0], 1, timeout=300)
    got = _rank0("eagle3", demo_pair[0], 2, timeout=300)
    assert got["tokens"] == want["tokens"]
    assert got["drafted"] == want["drafted"] and got["accepted"] == want["accepted"]
    assert sum(got["accepted"]) > 0, "the head's drafts were accepted"
    assert got["held"] == [0, 0]


@pytest.mark.parametrize("drafter", ["medusa", "eagle3-tree"])
def test_draft_trees_match_one_process(demo_pair, drafter):
    """Draft trees over 2 ranks: the header carries each row's parents (the followers' tree
    mask and depth positions) and the accepted paths' KV copies, which every follower repeats
    on its own heads. The demo target's Medusa heads (rank 0 has the final hidden state whole
    and projects through the whole lm_head read from the files) and EAGLE-3 greedy trees give
    the one-process greedy tokens and drafted/accepted counts."""
    want = _rank0(drafter, demo_pair[0], 1, timeout=300)
    got = _rank0(drafter, demo_pair[0], 2, timeout=300)
    assert got["tokens"] == want["tokens"]
    assert got["drafted"] == want["drafted"] and got["accepted"] == want["accepted"]
    assert sum(got["accepted"]) > 0, "the trees' drafts were accepted"
    assert got["held"] == [0, 0]


@pytest.mark.slow
@pytest.mark.parametrize("model,tp", [("qwen2", 2), ("llama", 4)])
def test_other_splits_match_one_process(random_models, model, tp):
    """Qwen2 (q/k/v biases, tied embeddings) over 2 ranks; 2 KV heads replicated over 4 ranks."""
    want = _rank0("generate", random_models[model], 1, timeout=600)
    got = _rank0("generate", random_models[model], tp, timeout=600)
    assert got == want and got["held"] == [0, 0]


def test_cli_local_starts_the_ranks_itself(demo_pair, tmp_path):
    """`spec-cluster generate --local` with engine.tensor_parallel_size: 2 in the config file:
    the demo pair's greedy text is the one-process text, and the followers are gone after."""
    def run(tp: int) -> dict:
        cfg = tmp_path / f"tp{tp}.yaml"
        cfg.write_text(f"engine:\n  tensor_parallel_size: {tp}\n  max_num_seqs: 4\n  max_model_len: 256\n")
        cmd = [sys.executable, "-m", "cluster.cli", "generate", "def parse_args(argv):\n", "--local", "--json",
               "--config", str(cfg), "--max-tokens", "24", "--speculation", "3", "--drafter", "model"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO,
                           env={**os.environ, "PYTHONPATH": str(REPO)})
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads(r.stdout)

    one, two = run(1), run(2)
    assert two["token_ids"] == one["token_ids"] and len(two["token_ids"]) == 24
    assert two["spec"]["drafted"] > 0


def test_an_embedded_target_splits_like_a_checkpoint(demo_pair, tmp_path):
    """An embedded target (embed.json: the demo target in a larger shape, here padded to a
    vocabulary that does not split evenly) over 2 ranks, each building only its slices
    (cluster.engine.worker.embedded.embed_llama_shard): the one-process greedy tokens, plain and
    with speculation, through `generate --local`."""
    target = tmp_path / "embedded"
    target.mkdir()
    shape = dict(vocab_size=5001, hidden_size=512, num_hidden_layers=8, num_attention_heads=16,
                 num_key_value_heads=4, head_dim=64, intermediate_size=1024, max_position_embeddings=2048)
    (target / "embed.json").write_text(json.dumps({"source": str(demo_pair[0]), "shape": shape}))

    def run(tp: int, speculation: str, drafter: str = "ngram") -> dict:
        cfg = tmp_path / f"tp{tp}.yaml"
        cfg.write_text(f"models:\n  target: {target}\n  draft: null\n  drafter: ngram\n"
                       f"engine:\n  tensor_parallel_size: {tp}\n  max_num_seqs: 4\n  max_model_len: 256\n")
        cmd = [sys.executable, "-m", "cluster.cli", "generate", "for i in range(10):\n    x = x", "--local",
               "--json", "--config", str(cfg), "--max-tokens", "24", "--speculation", speculation,
               "--drafter", drafter]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=REPO,
                           env={**os.environ, "PYTHONPATH": str(REPO)})
        assert r.returncode == 0, r.stderr[-3000:]
        return json.loads(r.stdout)

    one = run(1, "off")
    assert len(one["token_ids"]) == 24
    assert run(2, "off")["token_ids"] == one["token_ids"]
    spec = run(2, "3", "early-exit")  # drafts from the target's own first layers: it always drafts
    assert spec["token_ids"] == one["token_ids"] and spec["spec"]["drafted"] > 0
