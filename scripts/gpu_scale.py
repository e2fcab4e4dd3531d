"""The paged engine where real traffic begins, on one Hopper GPU: the demo pair embedded in
Llama-3.1-8B dimensions (cluster/engine/worker/embedded.py), bf16, the Hopper config's engine shape
(256 sequences, 33k-token context, 2048-token steps, prefill chunks of 512, KV from memory).

    bash scripts/gpu_py.sh gpu_scale.py     # writes $OUT/gpu_scale.json

PARTS (comma-separated, default all):
- sweep: ~640-token code prompts (640 tokens of held-out code, each request of a level its own),
  64..192 output tokens, c requests in flight over 2c requests (at least 16), plain / fixed gamma 4 /
  goodput on the same requests with prefix caching off, c in LEVELS (default 1,16,64,128,256). Beside each point the workload's roofline: prefill FLOPs
  at the measured bf16 matmul rate, plus decode steps that read the weights and every live
  sequence's KV at the measured copy bandwidth, c rows a step; and the closed-loop roofline, the
  same with the decode steps this client leaves part-empty as requests end (harness.closed_loop_roofline). GPU time by pass kind (decode, verify and
  prefill graph replays, drafter replays, eager target passes: `gpu_by_kind`) and host ms per
  step (step wall time minus all of that GPU time), for each mode.
- capacity: 256 concurrent 2k-token sequences (1920-token prompts, 128 new tokens), and one
  request of a 32,000-token prompt.
- MIXED_PREFILL=1 runs everything with engine.mixed_prefill (prefill chunks in the verify
  steps' pass); compare its sweep with a run without it on the same warm machine.
- RAGGED=inf runs prefill passes of unequal prompt chunks padded to the widest, as before
  segments (cluster.engine.worker.runner.RAGGED): a same-machine before/after.
- TEMPERATURE=0.8 samples the sweep's requests at that temperature (greedy by default): the
  draws of sampled rows, and their plain steps launched ahead (benchmarks/gpu/h100/sampled_ahead).
- PROFILE=1 adds, per level, a fixed gamma-4 run of the same requests under cProfile
  (OUT/profile_<c>.txt: the top functions by own and cumulative time).
- prefix: a shared 2k-token prompt: TTFT of requests whose prefix is cached against requests
  with a fresh prefix, one at a time.
"""

from __future__ import annotations

import os
import random
import sys
import time

import torch

from cluster.bench.load import run_engine, summarise
from cluster.bench.profiling import CatchUps
from cluster.bench.harness import (COMPILE_CACHE, DEMO, closed_loop_roofline, copy_bandwidth, log, matmul_rate, roofline,
                                   write_json)
from cluster.bench.workloads import code_prompts, random_token_prompts
from cluster.engine.config import EngineConfig
from cluster.engine.drafters.model import ModelDrafter
from cluster.engine.drafters.ngram import NgramDrafter
from cluster.engine.engine import Engine
from cluster.engine.scheduling.sequence import SpecParams
from cluster.engine.worker.embedded import demo_8b
from cluster.policy import SpeculationPolicyConfig, make_controller

REPLAYS: list = []  # (kind, start, end): CUDA events of every graph replay and eager target pass
KINDS: dict[int, str] = {}  # id(CUDA graph) -> decode / verify / prefill / draft


def time_replays(engine) -> None:
    """Time every graph replay and every eager pass of the target on the GPU, by kind: decode
    (one token a row), verify (gamma + 1), prefill (a prompt width's graph), draft (a drafter's
    graph), eager (a target pass no graph serves)."""
    g = engine.runner.graphs
    for (_, width, _), graph in g.graphs.items():
        KINDS[id(graph.graph)] = "decode" if width == 1 else "verify" if width <= g.max_width else "prefill"
    replay = torch.cuda.CUDAGraph.replay

    def bracket(kind, fn, *args, **kw):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        out = fn(*args, **kw)
        b.record()
        REPLAYS.append((kind, a, b))
        return out

    torch.cuda.CUDAGraph.replay = lambda self: bracket(KINDS.get(id(self), "draft"), replay, self)
    from cluster.engine.worker.runner import ragged  # such passes run as segments, eagerly

    forward = engine.runner.forward

    def timed_forward(rows, cache_lens, tokens, last_only, *args, trees=None, **kw):
        q_lens = [len(t) for t in tokens]
        served = (trees is None or all(t is None for t in trees)) and not (last_only and ragged(q_lens))
        if served and g.eligible(len(tokens), max(q_lens), last_only):
            return forward(rows, cache_lens, tokens, last_only, *args, trees=trees, **kw)
        return bracket("eager", forward, rows, cache_lens, tokens, last_only, *args, trees=trees, **kw)

    engine.runner.forward = timed_forward


def measured(engine, fn) -> tuple[dict, dict]:
    """fn's result, and the engine's steps, GPU seconds of graph replays and eager passes (by
    kind) and host ms per step meanwhile."""
    p = engine.pipeline
    counters = lambda: {k: getattr(p, k) for k in ("launched", "hits", "fresh", "deferred_rows", "dropped_rows")} if p else {}  # noqa: E731
    steps0, prefill0, ahead0, REPLAYS[:] = engine.totals["steps"], engine.totals["prefill_steps"], counters(), []
    t = time.perf_counter()
    out = fn()
    wall = time.perf_counter() - t
    torch.cuda.synchronize()
    by_kind: dict[str, dict] = {}
    for kind, a, b in REPLAYS:
        k = by_kind.setdefault(kind, {"count": 0, "gpu_s": 0.0})
        k["count"] += 1
        k["gpu_s"] += a.elapsed_time(b) / 1e3
    for k in by_kind.values():
        k["gpu_ms_each"] = 1e3 * k["gpu_s"] / k["count"]
    gpu = sum(k["gpu_s"] for k in by_kind.values())
    steps = engine.totals["steps"] - steps0
    # the launch-ahead pipeline: steps that used a launch, ran afresh, rows that waited a step or were dropped
    ahead = {k: v - ahead0[k] for k, v in counters().items()}
    return out, {"steps": steps, "prefill_steps": engine.totals["prefill_steps"] - prefill0, "launch_ahead": ahead,
                 "gpu_s": gpu, "wall_s": wall, "host_ms_per_step": 1e3 * (wall - gpu) / max(steps, 1),
                 # GPU time by pass kind: decode replays to hold against the bytes a step reads,
                 # prefill (graphs and eager passes) against its FLOPs
                 "gpu_by_kind": by_kind}


def sweep(engine, R: dict) -> None:
    tok = engine.tokenizer
    levels = [int(x) for x in os.environ.get("LEVELS", "1,16,64,128,256").split(",")]
    # distinct prompts within a level (repeats would skip prefill the roofline counts), and the
    # same prompts for every mode of a level with prefix caching off, so no mode inherits
    # another's cache: how well drafts are accepted varies by prompt, and at one stream 16
    # requests on other prompts measured the prompts, not the policy
    need = sum(max(16, 2 * c) + c for c in levels)
    distinct: dict[tuple, list[int]] = {}
    for seed in range(11, 40):  # many windows end early (a file's tail): draw until there are enough
        texts = code_prompts(need, chars=4000, seed=seed)
        distinct.update((tuple(ids[:640]), ids[:640]) for ids in (tok.encode(t) for t in texts) if len(ids) >= 640)
        if len(distinct) >= need:
            break
    log(f"{len(distinct)} distinct prompts for {need} requests")
    prompts = iter(distinct.values())
    take = lambda k: [next(prompts) for _ in range(k)]  # noqa: E731
    R["sweep_prompt_tokens"] = 640
    temp = R["sweep_temperature"] = float(os.environ.get("TEMPERATURE", "0"))
    rng = random.Random(5)
    lengths = [rng.randint(64, 192) for _ in range(max(16, 2 * max(levels)))]
    controller = make_controller(SpeculationPolicyConfig(mode="goodput"))
    catch_ups = CatchUps.of(engine)  # each step's catch-ups (what a switch up pays), in the goodput trace
    out = R.setdefault("sweep", [])
    caching, engine.kv.pool.prefix_caching = engine.kv.pool.prefix_caching, False
    for c in levels:
        n = max(16, 2 * c)
        point = {"concurrency": c, "requests": n, "roofline_tokens_per_s": roofline([640] * n, lengths[:n], c, R)}
        point["closed_loop_roofline_tokens_per_s"], point["closed_loop_decode_steps"] = closed_loop_roofline(
            [640] * n, lengths[:n], c, R)
        warm, reqs = take(c), take(n)
        for name, spec in (("off", SpecParams("off")), ("fixed4", SpecParams("fixed", 4)), ("goodput", SpecParams("auto"))):
            engine.controller = controller if name == "goodput" else None
            run_engine(engine, warm, c, lengths[:c], spec, temp)  # warm-up (and the controller)
            # per step, the controller's inputs: batch, gamma, drafted, accepted, step, verify and draft ms
            # (verify and draft apart: the fits see them apart, benchmarks/gpu/h200/pointwise_5e46173/README.md),
            # then the step's catch-ups (cluster.bench.profiling.CatchUps.FIELDS: calls, rows, tokens, passes, ms, compiled)
            trace: list = []
            catch_ups.take()  # not the warm-up's
            engine.on_verify = lambda o: trace.append((  # noqa: B023 - read before the next mode
                o.batch_size, o.gamma, o.drafted, sum(o.accepted_per_position),
                *(round(1e3 * x, 3) for x in (o.step_s, o.verify_s, o.draft_s)),
                catch_ups.row()))
            (res, wall), host = measured(engine, lambda: run_engine(engine, reqs, c, lengths[:n], spec, temp))
            engine.on_verify = None
            s = summarise(res, wall)
            point[name] = {**s, **host, "preemptions": engine.scheduler.preemptions,
                           "prefix_hit_tokens": engine.scheduler.prefix_hit_tokens}
            if name == "goodput":
                point[name]["controller"] = controller.snapshot()
                point[name]["trace"] = trace
        engine.controller = None
        if os.environ.get("PROFILE") == "1":  # an extra fixed-gamma-4 run under cProfile: where host time goes
            profile(engine, lambda: run_engine(engine, reqs, c, lengths[:n], SpecParams("fixed", 4), temp), c)
        best = max(point["off"]["tokens_per_s"], point["fixed4"]["tokens_per_s"])
        point["off_over_roofline"] = point["off"]["tokens_per_s"] / point["roofline_tokens_per_s"]
        point["off_over_closed_loop"] = point["off"]["tokens_per_s"] / point["closed_loop_roofline_tokens_per_s"]
        point["goodput_over_best"] = point["goodput"]["tokens_per_s"] / best
        point["kv_blocks"] = {k: engine.stats()[k] for k in ("kv_blocks_total", "kv_blocks_used", "kv_blocks_cached")}
        out.append(point)
        log("sweep", c, {k: (round(v["tokens_per_s"]) if "tokens_per_s" in v else v) if isinstance(v, dict) else v
                         for k, v in point.items()},
            "host ms/step", {m: round(point[m]["host_ms_per_step"], 2) for m in ("off", "fixed4", "goodput")})
        write(R)
    engine.kv.pool.prefix_caching = caching
    catch_ups.close()


def profile(engine, fn, c: int) -> None:
    """cProfile of `fn` (its figures are not the sweep's: the profiler slows every Python call),
    the top functions by own and by cumulative time to OUT/profile_<c>.txt."""
    import cProfile
    import io
    import pstats

    from cluster.bench.harness import OUT

    prof = cProfile.Profile()
    steps0 = engine.totals["steps"]
    prof.runcall(fn)
    text = io.StringIO()
    print(f"{engine.totals['steps'] - steps0} steps at {c} streams, fixed gamma 4", file=text)
    for key in ("tottime", "cumulative"):
        pstats.Stats(prof, stream=text).sort_stats(key).print_stats(45)
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"profile_{c}.txt").write_text(text.getvalue())


def capacity(engine, R: dict) -> None:
    vocab = 4000  # the demo tokenizer's ids; any ids serve for speed
    prompts = random_token_prompts(256, 1920, vocab, seed=3)
    before = engine.scheduler.preemptions
    (res, wall), host = measured(engine, lambda: run_engine(engine, prompts, 256, 128, SpecParams("off")))
    s = summarise(res, wall)
    R["capacity_256x2k"] = {**s, **host, "completed": len(res), "all_128_tokens": all(len(r["token_ids"]) == 128 for r in res),
                            "preemptions": engine.scheduler.preemptions - before,
                            "kv_blocks_total": engine.kv.pool.num_blocks, "block_size": engine.cfg.block_size}
    log("256 x 2k:", R["capacity_256x2k"])
    write(R)
    long = random_token_prompts(1, 32000, vocab, seed=4)
    (res, wall), host = measured(engine, lambda: run_engine(engine, long, 1, 64, SpecParams("off")))
    R["one_32k"] = {**summarise(res, wall), **host, "completed": len(res), "prompt_tokens": 32000,
                    "new_tokens": len(res[0]["token_ids"]) if res else 0}
    log("one 32k request:", R["one_32k"])
    write(R)


def prefix(engine, R: dict) -> None:
    vocab = 4000
    shared = random_token_prompts(1, 2000, vocab, seed=7)[0]
    suffixes = random_token_prompts(17, 16, vocab, seed=8)
    fresh = random_token_prompts(16, 2000, vocab, seed=9)
    run_engine(engine, [shared + suffixes[16]], 1, 8, SpecParams("off"))  # caches the shared blocks
    hits = summarise(*run_engine(engine, [shared + s for s in suffixes[:16]], 1, 8, SpecParams("off")))
    misses = summarise(*run_engine(engine, [f + s for f, s in zip(fresh, suffixes)], 1, 8, SpecParams("off")))
    R["prefix_ttft"] = {"hit_ttft_ms_p50": hits["ttft_ms_p50"], "miss_ttft_ms_p50": misses["ttft_ms_p50"],
                        "hit_over_miss": hits["ttft_ms_p50"] / misses["ttft_ms_p50"],
                        "prefix_hit_tokens": engine.scheduler.prefix_hit_tokens}
    log("prefix TTFT:", R["prefix_ttft"])
    write(R)


def write(R: dict) -> None:
    write_json(R, os.environ.get("NAME", "gpu_scale") + ".json")


def main() -> int:
    import logging

    from transformers import AutoTokenizer

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    R: dict = {"device": torch.cuda.get_device_name(), "command": "bash scripts/gpu_py.sh gpu_scale.py"}
    R["copy_bandwidth"], R["matmul_flops"] = copy_bandwidth(), matmul_rate()
    target, draft = demo_8b(DEMO / "target", DEMO / "draft")
    s = target.shape
    R["param_bytes"] = sum(p.numel() * p.element_size() for p in target.parameters())
    R["param_count"] = sum(p.numel() for p in target.parameters())
    R["kv_bytes_per_token"] = 2 * s.layers * s.kv_heads * s.head_dim * (1 if os.environ.get("KV_CACHE_DTYPE") == "fp8" else 2)
    log(f"copy {R['copy_bandwidth'] / 1e12:.2f} TB/s, matmul {R['matmul_flops'] / 1e12:.0f} TFLOP/s")
    cfg = EngineConfig(max_num_seqs=256, max_model_len=33000, max_waiting=1024, max_batch_tokens=2048,
                       prefill_chunk=512, gamma=4, gamma_max=8, device="cuda", dtype="bfloat16", compile=True,
                       gpu_memory_utilization=float(os.environ.get("GPU_MEMORY_UTILIZATION", "0.9")),
                       kv_cache_dtype=os.environ.get("KV_CACHE_DTYPE", "auto"),
                       mixed_prefill=os.environ.get("MIXED_PREFILL") == "1",
                       compile_cache_dir=COMPILE_CACHE)
    R["kv_cache_dtype"], R["mixed_prefill"] = cfg.kv_cache_dtype, cfg.mixed_prefill
    from cluster.engine.worker import runner

    runner.RAGGED = float(os.environ.get("RAGGED", runner.RAGGED))
    R["ragged"] = runner.RAGGED if runner.RAGGED != float("inf") else "off"
    drafter = ModelDrafter(draft, 2 * cfg.max_num_seqs, 2048)  # longer rows decode without drafts
    tok = AutoTokenizer.from_pretrained(DEMO / "target")
    t = time.time()
    engine = Engine(target, tok, cfg, {"model": drafter, "ngram": NgramDrafter()}, "model", identity="demo-8b")
    free, total = torch.cuda.mem_get_info()
    R["engine"] = {"start_s": time.time() - t, "backend": engine.backend, "kv_blocks": engine.kv.pool.num_blocks,
                   "kv_tokens": engine.kv.pool.num_blocks * cfg.block_size,
                   "kv_gib": engine.kv.k.numel() * 2 * engine.kv.k.element_size() / 2**30,
                   "free_gib_after_start": free / 2**30, "card_gib": total / 2**30}
    log("engine:", R["engine"])
    time_replays(engine)
    parts = os.environ.get("PARTS", "sweep,capacity,prefix").split(",")
    for part in parts:
        try:
            {"sweep": sweep, "capacity": capacity, "prefix": prefix}[part](engine, R)
        except Exception as e:  # noqa: BLE001 - keep what the other parts measure
            import traceback

            traceback.print_exc()
            R.setdefault("errors", {})[part] = f"{type(e).__name__}: {e}"
    write(R)
    log("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
