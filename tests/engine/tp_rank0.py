"""Rank 0 of a tensor-parallel engine in its own process, for tests that need a fresh process
group (a process holds one): `python -m tests.engine.tp_rank0 MODE TARGET TP [DRAFT]`.

generate: prints the greedy and seeded-sampled token ids of PROMPTS as JSON (plain decoding).
graphs: with the CUDA-graph stand-in on every rank and the DRAFT model drafting, prints the
greedy (plain and speculative) and seeded-sampled (speculative and plain) token ids of PROMPTS,
each rank's graph replays, whether close freed every rank's graphs, and the steps plain
decoding launched ahead as JSON.
pipeline: plain decoding launched ahead (the CUDA-graph stand-in on every rank) through rows
ending, arriving and aborted, and through preemption in a small pool: tokens and the pipeline's
counts as JSON.
fp8: with an fp8 KV cache and the DRAFT model drafting, prints the greedy token ids of PROMPTS
plain and with speculation, and the fp8 scales every rank calibrated, as JSON.
eagle3, eagle3-tree, medusa: TARGET's engine as build_engine makes it, with the EAGLE-3 head
beside it drafting chains (or greedy trees of width 3) or its Medusa heads drafting their
tree, prints the greedy token ids of PROMPTS and each request's drafted and accepted counts
as JSON.
kill: starts a generation, SIGKILLs rank 1 after a few steps, and prints how rank 0's next
steps ended (the exception's type and message, and the seconds it took) as JSON.
follower-fails: rank 1 cannot load its target; prints how rank 0's start ended, as kill does.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import torch

from cluster.engine.config import EngineConfig
from cluster.engine.distributed.ranks import follow, spawn, start_ranks
from cluster.engine.drafters.model import ModelDrafter
from cluster.engine.engine import Engine
from cluster.engine.sampling import SamplingParams
from cluster.engine.scheduling.sequence import SpecParams
from cluster.engine.worker.loader import load_model
from tests.engine.conftest import CharTokenizer

PROMPTS = ["def f(x):\n    return f(x)\n\ndef f(", "abcabcabcabcabc", "the quick brown fox " * 6]
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True)


def config(tp: int, kv_cache_dtype: str = "auto") -> EngineConfig:
    return EngineConfig(max_num_seqs=8, max_model_len=256, block_size=4, max_batch_tokens=64, tensor_parallel_size=tp,
                        kv_cache_dtype=kv_cache_dtype)


def engine(target: str, tp: int, step_timeout_s: float = 120.0) -> Engine:
    cfg = config(tp)
    group = start_ranks(target, cfg, step_timeout_s) if tp > 1 else None
    return Engine(load_model(target, torch.float32, "cpu", group), CharTokenizer(), cfg)


def fp8_engine(target: str, draft: str | None, tp: int, launch=None) -> Engine:
    """The fp8-cache engine the fp8 mode runs, and its one-process reference (tp 1)."""
    cfg = config(tp, "fp8")
    group = start_ranks(target, cfg, launch=launch) if tp > 1 else None
    drafters = {"model": ModelDrafter(load_model(draft, torch.float32, "cpu"), 8, 256)} if draft else {}
    return Engine(load_model(target, torch.float32, "cpu", group), CharTokenizer(), cfg, drafters, "model")


def follow_saving_scales(out: str, *args) -> None:
    """A follower (cluster.engine.distributed.ranks.follow) that saves its fp8 scales to `out` after STOP."""
    torch.save(follow(*args).kv.scales, out)


def follow_saving_replays(out: str, *args) -> None:
    """A follower that saves how often each of its graphs (the CPU stand-in's) replayed, after STOP."""
    graphs = follow(*args).graphs.graphs
    Path(out).write_text(json.dumps({"replays": {str(k): g.graph.replays for k, g in graphs.items()},
                                     "released": all(g.graph.resets == 1 for g in graphs.values())}))


def saving_launcher(out_dir: str, save=follow_saving_scales, suffix: str = "pt"):
    """A ranks launcher (as cluster.engine.distributed.ranks.spawn) whose followers save what
    `save` saves in out_dir (their fp8 scales)."""
    def launch(rank, size, addr, port, target, cfg, step_timeout_s):
        ctx = torch.multiprocessing.get_context("spawn")
        p = ctx.Process(target=save, daemon=True, name=f"tp-rank-{rank}",
                        args=(f"{out_dir}/rank{rank}.{suffix}", rank, size, port, target, cfg, step_timeout_s, addr))
        p.start()
        return p
    return launch


def fp8_tokens(e: Engine) -> dict:
    plain = e.generate(PROMPTS, GREEDY, SpecParams("off"))
    spec = e.generate(PROMPTS, GREEDY, SpecParams("fixed", 4), "model")
    return {"plain": [r["token_ids"] for r in plain], "spec": [r["token_ids"] for r in spec],
            "drafted": sum(r["spec"]["drafted"] for r in spec), "held": list(e.kv.held())}


def waiting(e: Engine, fn):
    """fn() with every speculative step waiting for the host (its drafts fed on the device by
    the planner, Runner.forward's `carried`), not launched ahead."""
    held, e.spec_ahead = e.spec_ahead, None
    try:
        return fn()
    finally:
        e.spec_ahead = held


def graph_tokens(target: str, draft: str, tp: int) -> dict:
    """Greedy plain and speculative, and seeded sampled, token ids with CUDA graphs (the CPU
    stand-in, cluster.engine.worker.capture) on every rank; with tp > 1 how often each graph
    replayed on rank 0 and on each follower."""
    from cluster.engine.worker.capture import eager_on_cpu

    cfg = config(tp)
    with tempfile.TemporaryDirectory() as tmp, eager_on_cpu():
        group = start_ranks(target, cfg, launch=saving_launcher(tmp, follow_saving_replays, "json")) if tp > 1 else None
        e = Engine(load_model(target, torch.float32, "cpu", group), CharTokenizer(), cfg,
                   {"model": ModelDrafter(load_model(draft, torch.float32, "cpu"), 8, 256)}, "model")
        try:
            out = {"plain": [r["token_ids"] for r in e.generate(PROMPTS, GREEDY, SpecParams("off"))],
                   "spec": [r["token_ids"] for r in e.generate(PROMPTS, GREEDY, SpecParams("fixed", 4), "model")],
                   "sampled": [r["token_ids"] for r in e.generate(PROMPTS, SAMPLED, SpecParams("fixed", 2), "model")],
                   "sampled_waiting": waiting(e, lambda: [r["token_ids"] for r in e.generate(PROMPTS, SAMPLED,
                                                                                            SpecParams("fixed", 2), "model")]),
                   "sampled_plain": [r["token_ids"] for r in e.generate(PROMPTS, SAMPLED, SpecParams("off"))],
                   "ahead": {"launched": e.pipeline.launched, "hits": e.pipeline.hits},
                   "spec_ahead": {"hits": e.spec_ahead.hits, "fresh": e.spec_ahead.fresh},
                   "drafts_on_device": e.planner.counts["drafts_on_device"],
                   "held": list(e.kv.held()),
                   "replays": {str(k): g.graph.replays for k, g in e.runner.graphs.graphs.items()}}
        finally:
            e.close()
        out["released"] = all(g.graph.resets == 1 for g in e.runner.graphs.graphs.values()) if tp > 1 else None
        followers = [json.loads((Path(tmp) / f"rank{r}.json").read_text()) for r in range(1, tp)]
        out["followers"] = [f["replays"] for f in followers]
        out["followers_released"] = [f["released"] for f in followers]
    return out


def pipeline_tokens(target: str, tp: int) -> dict:
    """Plain decoding launched ahead with the CUDA-graph stand-in on every rank: the tokens of
    test_pipeline's script (rows ending by length, a stop string and an abort; a late arrival)
    and of its six rows in a pool of 40 blocks a rank (preemption), with the pipeline's counts."""
    from cluster.engine.scheduling.kv_cache import block_bytes
    from cluster.engine.worker.capture import eager_on_cpu
    from tests.engine.test_pipeline import FINISHES_AND_ARRIVALS, TIGHT_PROMPTS, run

    out = {}
    for name in ("script", "tight"):
        cfg = EngineConfig(max_num_seqs=8, max_model_len=96, block_size=4, max_batch_tokens=64, tensor_parallel_size=tp)
        with eager_on_cpu():
            group = start_ranks(target, cfg) if tp > 1 else None
            model = load_model(target, torch.float32, "cpu", group)
            if name == "tight":  # the shard's own KV heads: 40 blocks on every rank
                s = model.shape
                cfg = cfg.model_copy(update={"prefill_chunk": 16, "kv_cache_gb": 40 * block_bytes(
                    s.layers, 4, s.kv_heads, s.head_dim, torch.float32) / 2**30})
            e = Engine(model, CharTokenizer(), cfg, {}, None)
        try:
            if name == "script":
                out[name] = run(e, FINISHES_AND_ARRIVALS)
            else:
                out[name] = [r["token_ids"] for r in e.generate(TIGHT_PROMPTS, SamplingParams(max_tokens=40, ignore_eos=True),
                                                                SpecParams("off"))]
            p = e.pipeline
            out[name + "_counts"] = {"hits": p.hits, "fresh": p.fresh, "deferred_rows": p.deferred_rows,
                                     "dropped_rows": p.dropped_rows, "preemptions": e.scheduler.preemptions,
                                     "blocks": e.kv.pool.num_blocks, "held": list(e.kv.held())}
        finally:
            e.close()
    return out


def head_tokens(drafter: str, target: str, tp: int) -> dict:
    from cluster.config import ClusterConfig
    from cluster.serve.build import build_engine

    from cluster.engine.drafters.eagle3 import Eagle3Drafter

    cfg = ClusterConfig(models={"target": target, "draft": None, "drafter": drafter.removesuffix("-tree")},
                        engine={"tensor_parallel_size": tp, "max_num_seqs": 8, "max_model_len": 256})
    e = build_engine(cfg)
    if drafter == "eagle3-tree":
        chain = e.drafters["eagle3"]
        e.drafters[drafter] = Eagle3Drafter(chain.head, 8, chain.max_len, tree_width=3)
    try:
        out = e.generate(PROMPTS, GREEDY, SpecParams("fixed", 4), drafter)
        return {"tokens": [r["token_ids"] for r in out], "drafted": [r["spec"]["drafted"] for r in out],
                "accepted": [r["spec"]["accepted"] for r in out], "held": list(e.kv.held())}
    finally:
        e.close()


def main(mode: str, target: str, tp: int, draft: str | None = None) -> dict:
    if mode in ("eagle3", "eagle3-tree", "medusa"):
        return head_tokens(mode, target, tp)
    if mode == "graphs":
        return graph_tokens(target, draft, tp)
    if mode == "pipeline":
        return pipeline_tokens(target, tp)
    if mode == "fp8":
        with tempfile.TemporaryDirectory() as tmp:
            e = fp8_engine(target, draft, tp, saving_launcher(tmp))
            try:
                out = fp8_tokens(e)
            finally:
                e.close()
            followers = [torch.load(Path(tmp) / f"rank{r}.pt") for r in range(1, tp)]
        out["scales"] = [s.tolist() for s in [e.kv.scales] + followers]
        return out
    if mode == "generate":
        e = engine(target, tp)
        try:
            greedy = [r["token_ids"] for r in e.generate(PROMPTS, GREEDY, SpecParams("off"))]
            sampled = [r["token_ids"] for r in e.generate(PROMPTS, SAMPLED, SpecParams("off"))]
            return {"greedy": greedy, "sampled": sampled, "held": list(e.kv.held())}
        finally:
            e.close()
    if mode == "follower-fails":  # rank 1 is given a target it cannot load
        def launch(rank, size, addr, port, _target, cfg, step_timeout_s):
            return spawn(rank, size, addr, port, "/nonexistent/target", cfg, step_timeout_s)
        t0 = time.perf_counter()
        try:
            group = start_ranks(target, config(tp), 30.0, launch=launch)
            Engine(load_model(target, torch.float32, "cpu", group), CharTokenizer(), config(tp)).close()
            return {"error": None}
        except Exception as ex:  # noqa: BLE001 - the test judges what it was
            return {"error": type(ex).__name__, "message": str(ex), "seconds": time.perf_counter() - t0}
    e = engine(target, tp, step_timeout_s=30.0)
    for p in PROMPTS:
        e.add_request(p, SamplingParams(max_tokens=200, ignore_eos=True), SpecParams("off"))
    for _ in range(3):
        e.step()
    os.kill(e.runner.group.procs[0].pid, signal.SIGKILL)
    t0 = time.perf_counter()
    try:
        while e.has_work:
            e.step()
        return {"error": None}
    except Exception as ex:  # noqa: BLE001 - the test judges what it was
        return {"error": type(ex).__name__, "message": str(ex), "seconds": time.perf_counter() - t0}
    finally:
        e.close()


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), *sys.argv[4:])))
