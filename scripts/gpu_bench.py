"""Hopper speed of the verifier engine at Llama-3.1-8B dimensions (bf16), with a drafter
whose acceptance is real: the trained demo pair embedded in the 8B shape (cluster/engine/worker/embedded.py;
every weight of the 8B shape is read each step, the function is the demo target's).

    bash scripts/gpu_bench.sh      # on the GPU machine; writes $OUT/gpu_bench.json

1. batch-1 plain decoding (engine loop, CUDA graphs, FA3) against the bandwidth ceiling;
2. a verify pass over gamma=4 drafts against a one-token decode step (graph replays);
3. single-stream speculation with the demo drafter (its own replica-free runner, CUDA graphs):
   measured acceptance, speedup over plain decoding, and the ideal
   E[N] * t_target / (t_target + gamma * t_draft) from the measured parts;
4. FA3 against SDPA on the verify step's attention at 8k context, batch 64;
5. a concurrency sweep (c requests kept in flight), plain decoding and gamma 4 against the
   goodput controller (warm-up per level).
"""

from __future__ import annotations

import os
import random
import sys
import time
from pathlib import Path

import torch

from cluster.bench import harness
from cluster.bench.harness import (DEMO, OUT, agreement, copy_bandwidth, cuda_time, decode_rate, drop_ids, step_calls,
                                    write_json)
from cluster.bench.workloads import code_prompts
from cluster.engine.config import EngineConfig
from cluster.engine.drafters.base import DraftRequest
from cluster.engine.drafters.model import ModelDrafter
from cluster.engine.drafters.ngram import NgramDrafter
from cluster.engine.engine import Engine
from cluster.engine.scheduling.kv_cache import KVCache
from cluster.engine.scheduling.sequence import SpecParams
from cluster.engine.worker.attention import AttnContext, SdpaBackend, make_backend
from cluster.engine.worker.embedded import demo_8b
from cluster.policy import SpeculationPolicyConfig, make_controller



def log(*a, R: dict | None = None):
    """Print a result line; with R, also rewrite gpu_bench.json with everything so far, so a
    run cut short (the device's 10-minute limit) keeps what it measured."""
    harness.log(*a)
    if R is not None and os.environ.get("SWEEP_ONLY") != "1":
        write_json({**R, "partial": True}, "gpu_bench.json")


def gemv_configs() -> dict:
    """The Triton GEMV's tuned config per weight shape this run (tuning is timed, so it can
    differ between runs, and with it the decode step's rounding)."""
    from cluster.engine.worker.gemv import _gemv

    return {str(k[:4]): str(c) for k, c in getattr(_gemv, "cache", {}).items()}


def draft_time(drafter: ModelDrafter, ids: list[int], gamma: int) -> float:
    """Seconds per drafted token: a propose of gamma tokens after one accepted token
    (catch-up of one token + gamma - 1 draft steps, each with its host round trip)."""
    req = [DraftRequest("timing", ids, gamma)]
    drafter.propose(req)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20):
        drafter.propose(req)
    drafter.release(["timing"])
    return (time.perf_counter() - t0) / 20 / gamma


def main() -> int:
    from transformers import AutoTokenizer

    import logging

    # the engine's own log (graph captures, slow draft calls), with times, beside the results
    os.makedirs(OUT, exist_ok=True)
    handler = logging.FileHandler(os.path.join(OUT, "engine.log"))
    handler.setFormatter(logging.Formatter("%(relativeCreated)9.0f ms %(name)s %(levelname)s %(message)s"))
    logging.getLogger("cluster").addHandler(handler)
    logging.getLogger("cluster").setLevel(logging.INFO)

    R: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
               "model": "demo target embedded in Llama-3.1-8B dimensions (bf16); drafter: demo draft, vocab 128256"}
    bw = copy_bandwidth()
    target, draft = demo_8b(DEMO / "target", DEMO / "draft")
    param_bytes = sum(p.numel() * p.element_size() for p in target.parameters())
    draft_bytes = sum(p.numel() * p.element_size() for p in draft.parameters())
    ceiling = bw / param_bytes
    R.update(copy_bandwidth_TBps=bw / 1e12, param_bytes=param_bytes, draft_param_bytes=draft_bytes,
             ceiling_tokens_per_s=ceiling)
    log(f"bandwidth {bw/1e12:.2f} TB/s, ceiling {ceiling:.1f} tok/s, target {param_bytes/1e9:.2f} GB")
    cfg = EngineConfig(max_num_seqs=64, max_model_len=1024, max_batch_tokens=4096, prefill_chunk=512, prefix_caching=False,
                       gamma=4, gamma_max=8, device="cuda", dtype="bfloat16",
                       compile=os.environ.get("COMPILE", "1") == "1")
    drafter = ModelDrafter(draft, cfg.max_num_seqs + 2, cfg.max_model_len)
    tok = AutoTokenizer.from_pretrained(DEMO / "target")
    engine = Engine(target, tok, cfg, {"model": drafter, "ngram": NgramDrafter()}, "model", identity="demo-8b")
    R["backend"], R["compiled_kernels"] = engine.backend, cfg.compile
    prompts = code_prompts(64, seed=11)
    one = prompts[:1]
    R["prefill_ms"] = {f"{n}x{len(tok.encode(prompts[0]))}": prefill_ms(engine, [tok.encode(p) for p in prompts[:n]])
                       for n in (1, 3, 8, 16)}
    log("prefill (graph vs eager, wall ms):", R["prefill_ms"], R=R)
    if os.environ.get("SWEEP_ONLY") == "1":
        return sweep_only(engine, prompts, R)
    decode_rate(engine, one, SpecParams("off"), new=16)  # capture graphs, tune kernels
    hits = engine.pipeline.hits if engine.pipeline else 0
    plain = decode_rate(engine, one, SpecParams("off"))
    R["plain_batch1"] = {**drop_ids(plain), "fraction_of_ceiling": plain["tokens_per_s"] / ceiling,
                         "steps_launched_ahead": (engine.pipeline.hits - hits) if engine.pipeline else 0}
    log("plain batch 1:", R["plain_batch1"], R=R)
    pipeline, engine.pipeline = engine.pipeline, None  # the same, each step launched after the last
    serial = decode_rate(engine, one, SpecParams("off"))
    engine.pipeline = pipeline
    R["plain_batch1_not_pipelined"] = {**drop_ids(serial), "fraction_of_ceiling": serial["tokens_per_s"] / ceiling,
                                       "same_tokens": serial["token_ids"] == plain["token_ids"]}
    log("plain batch 1, not pipelined:", R["plain_batch1_not_pipelined"], R=R)

    ctx_ids = tok.encode(prompts[1])[:512]
    ctx_ids = (ctx_ids * (512 // len(ctx_ids) + 1))[:512]
    gammas = (1, 2, 3, 4, 6, 8)
    slot, step = step_calls(engine, ctx_ids, (1, *(g + 1 for g in gammas)))
    t_dec = cuda_time(step[1])
    t_ver = {g: cuda_time(step[g + 1]) for g in gammas}
    R["verify_gamma4_over_decode"] = {"decode_ms": 1e3 * t_dec, "verify5_ms": 1e3 * t_ver[4], "ratio": t_ver[4] / t_dec}
    R["verify_ms_by_gamma"] = {g: 1e3 * t for g, t in t_ver.items()}
    engine.kv.close(slot)
    log("verify/decode:", R["verify_gamma4_over_decode"], R["verify_ms_by_gamma"], R=R)

    R["speculation_batch1"] = {}
    for gamma in (1, 2, 3, 4, 6):
        decode_rate(engine, one, SpecParams("fixed", gamma), "model", new=16)  # capture this width
        spec = decode_rate(engine, one, SpecParams("fixed", gamma), "model")
        t_draft = draft_time(drafter, tok.encode(prompts[2]), gamma)
        n = spec["mean_accepted_len"]
        ideal = n * t_dec / (t_dec + gamma * t_draft)          # the formula
        ideal_v = n * t_dec / (t_ver[gamma] + gamma * t_draft)  # with the measured verify cost
        speedup = spec["tokens_per_s"] / plain["tokens_per_s"]
        R["speculation_batch1"][f"g{gamma}"] = {
            **drop_ids(spec), "draft_ms_per_token": 1e3 * t_draft, "speedup": speedup,
            "ideal_speedup": ideal, "fraction_of_ideal": speedup / ideal,
            "ideal_speedup_measured_verify": ideal_v, "fraction_of_ideal_measured_verify": speedup / ideal_v,
            "same_tokens_as_plain": spec["token_ids"] == plain["token_ids"],
            "agreement": agreement(engine, tok.encode(prompts[0]), spec["token_ids"][0], plain["token_ids"][0])}
        log(f"model drafter g{gamma}:", R["speculation_batch1"][f"g{gamma}"])
    R["gemv_configs"] = gemv_configs()
    # the drafter's look-ahead (drafting the next step on its stream during the verify) on and off
    counts = dict(engine.planner.counts)
    on = decode_rate(engine, one, SpecParams("fixed", 4), "model")
    hits = {k: engine.planner.counts[k] - counts[k] for k in ("ahead_hits", "ahead_misses")}
    drafter.look_ahead = None
    off = decode_rate(engine, one, SpecParams("fixed", 4), "model")
    drafter.look_ahead = "free"
    R["look_ahead_g4"] = {"on_tokens_per_s": on["tokens_per_s"], "off_tokens_per_s": off["tokens_per_s"], **hits,
                          "same_tokens": on["token_ids"] == off["token_ids"] == plain["token_ids"]}
    log("look-ahead g4:", R["look_ahead_g4"], R=R)
    ng = decode_rate(engine, one, SpecParams("fixed", 4), "ngram")
    R["ngram_batch1_g4"] = {**drop_ids(ng), "speedup": ng["tokens_per_s"] / plain["tokens_per_s"]}
    log("ngram g4:", R["ngram_batch1_g4"], R=R)

    # attention only: the verify step (q = 5) at 8k context, batch 64, paged (the engine's
    # backend, key writes included) against SDPA over the same blocks
    s = target.shape
    B, T, ctx_len = 64, 5, 8192
    kv = KVCache.dense(1, B, ctx_len, s.kv_heads, s.head_dim, torch.bfloat16, "cuda")
    kv.k.normal_()
    kv.v.normal_()
    q = torch.randn((B, T, s.heads, s.head_dim), dtype=torch.bfloat16, device="cuda")
    k = torch.randn((B, T, s.kv_heads, s.head_dim), dtype=torch.bfloat16, device="cuda")
    actx = AttnContext.build(kv, list(range(B)), [ctx_len - T] * B, [T] * B, "cuda")
    actx.splits = engine.runner._splits(B, T, ctx_len)
    paged = make_backend("auto", torch.device("cuda"), torch.bfloat16)
    kc, vc = kv.k[0], kv.v[0]
    t_paged = cuda_time(lambda: paged(q, k, k, kc, vc, actx))
    t_sdpa = cuda_time(lambda: SdpaBackend()(q, k, k, kc, vc, actx))
    R["verify_attention_8k_b64"] = {"backend": paged.name, "paged_ms": 1e3 * t_paged, "sdpa_ms": 1e3 * t_sdpa,
                                    "sdpa_over_paged": t_sdpa / t_paged}
    log("attention 8k b64:", R["verify_attention_8k_b64"], R=R)
    kv = kc = vc = None  # the 8k cache goes before the sweep

    return sweep_only(engine, prompts, R)


def watch_steps(engine) -> None:
    """A step that runs past 10 s dumps every thread's Python stack to $OUT/stall_stacks.txt:
    where the host waits (on the GPU, or in Python) when a step stalls."""
    import faulthandler

    out = open(os.path.join(OUT, "stall_stacks.txt"), "w")  # noqa: SIM115 (lives with the process)
    step = engine.step

    def watched():
        faulthandler.dump_traceback_later(10, repeat=True, file=out)
        try:
            return step()
        finally:
            faulthandler.cancel_dump_traceback_later()

    engine.step = watched


def prefill_ms(engine, ids: list[list[int]]) -> dict:
    """Wall ms of one prefill pass over these prompts (host work included), on its CUDA
    graph and eagerly."""
    run, handles = engine.runner, [engine.kv.open() for _ in ids]
    for h, x in zip(handles, ids):
        engine.kv.grow(h, len(x) + 512)  # a prefill graph pads the row to its width
    rows = [h.row for h in handles]

    def wall() -> float:
        once = lambda: (run.forward(rows, [0] * len(ids), ids, last_only=True), torch.cuda.synchronize())  # noqa: E731
        once()
        times = []
        for _ in range(10):
            t = time.perf_counter()
            once()
            times.append(time.perf_counter() - t)
        return 1e3 * sorted(times)[5]

    graphed = wall()
    graphs, run.graphs = run.graphs, None
    eager = wall()
    run.graphs = graphs
    for h in handles:
        engine.kv.close(h)
    return {"graph_ms": graphed, "eager_ms": eager}


def sweep_only(engine, prompts, R) -> int:
    """Throughput at concurrency c: c requests in flight, each finished one replaced by the
    next (as `spec-cluster bench` and serving benchmarks count it), over 4c requests of 64 to
    192 tokens (at least 8), for plain decoding, gamma 4 and the goodput controller. Waiting for
    a whole batch to finish instead would time the stragglers: rows accept at different
    rates, so with speculation the last few run alone for many steps."""
    from cluster.bench.load import run_engine, summarise

    if os.environ.get("SKIP_SWEEP") == "1":
        return _write(R, "gpu_bench.json")
    # One controller for the whole ramp, as in a server whose load rises: what it learnt at
    # low concurrency (acceptance, cost per token) carries over; each level warms it up.
    sweep, controller = [], make_controller(SpeculationPolicyConfig(mode="goodput"))
    watch_steps(engine)
    # Output lengths 64..192 (mean 128, the same list for every mode). With one length for
    # all, plain decoding's requests finish in the same step and their successors prefill
    # as one batch, while speculation's finish one by one, each a prefill step of its own:
    # that measures the prefill schedule, not speculation (H100 run, 64 streams: 0.67 of
    # plain with the controller speculating where its steps paid; benchmarks/gpu/h100/sweep_equal_lengths).
    fixed_len = int(os.environ.get("SWEEP_MAX_TOKENS", "0"))
    levels = list(map(int, os.environ.get("SWEEP_LEVELS", "1,4,16,64").split(",")))
    rng = random.Random(5)
    lengths = [fixed_len or rng.randint(64, 192) for _ in range(max(8, 4 * max(levels)))]
    for c in levels:
        if time.time() - harness.T0 > 480:
            log("time budget reached; sweep stops at", c)
            break
        reqs = [prompts[i % len(prompts)] for i in range(max(8, 4 * c))]
        rate = lambda spec, n=len(reqs): summarise(*run_engine(engine, reqs[:n], c, lengths[:n], spec))  # noqa: E731
        rate(SpecParams("off"), c)  # warm-up: this level's graphs
        off, off_trace = traced(engine, lambda: rate(SpecParams("off")))
        rate(SpecParams("fixed", 4), c)
        fixed, fixed_trace = traced(engine, lambda: profiled(f"fixed4_c{c}", lambda: rate(SpecParams("fixed", 4))))
        engine.controller = controller
        rate(SpecParams("auto"), 2 * c)  # let the controller measure this level
        auto, trace = traced(engine, lambda: rate(SpecParams("auto")))
        snap = engine.controller.snapshot()
        engine.controller = None
        sweep.append({"concurrency": c, "requests": len(reqs), "max_tokens": fixed_len or "64..192",
                      "off_tokens_per_s": off["tokens_per_s"],
                      "fixed4_tokens_per_s": fixed["tokens_per_s"], "fixed4_acceptance": fixed["acceptance_rate"],
                      "goodput_tokens_per_s": auto["tokens_per_s"], "goodput_gamma": snap["gamma"],
                      "measured_over_model": snap.get("measured_over_model"),
                      "goodput_acceptance": auto["acceptance_rate"], "goodput_itl_ms_p50": auto["itl_ms_p50"],
                      "off_itl_ms_p50": off["itl_ms_p50"], "trace": trace,
                      "off_trace": off_trace, "fixed4_trace": fixed_trace,
                      "ratio": auto["tokens_per_s"] / off["tokens_per_s"]})
        free, _ = torch.cuda.mem_get_info()
        sweep[-1]["memory_gb"] = {"free": free / 1e9, "reserved": torch.cuda.memory_reserved() / 1e9,
                                  "graphs": engine._graphs_captured()}
        log("sweep:", {k: v for k, v in sweep[-1].items() if not k.endswith("trace")}, R={**R, "concurrency_sweep": sweep})
    R["concurrency_sweep"] = sweep
    return _write(R, "gpu_bench_sweep.json" if os.environ.get("SWEEP_ONLY") == "1" else "gpu_bench.json")


def traced(engine, fn):
    """(fn(), its verify steps): per step its end (ms from the first), rows, gamma, drafted,
    pipelined, verify, draft and whole-step ms (StepObservation.step_s), and tokens out."""
    trace: list = []
    engine.on_verify = lambda o: trace.append([time.perf_counter(), o.batch_size, o.gamma, o.drafted,
                                               int(o.pipelined), round(1e3 * o.verify_s, 2),
                                               round(1e3 * o.draft_s, 2), round(1e3 * o.step_s, 2),
                                               o.batch_size + sum(o.accepted_per_position)])
    try:
        out = fn()
    finally:
        engine.on_verify = None
    for row in trace[::-1]:
        row[0] = round(1e3 * (row[0] - trace[0][0]), 2)
    return out, trace


def profiled(name: str, fn):
    """fn(), under cProfile where PROFILE=1 (host time by function into $OUT/profile_<name>.txt)."""
    if os.environ.get("PROFILE") != "1":
        return fn()
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    out = prof.runcall(fn)
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(40)
    Path(OUT, f"profile_{name}.txt").write_text(buf.getvalue())
    return out


def _write(R: dict, name: str) -> int:
    from cluster.engine.worker import gemv

    R["gemv_max_rows"] = gemv.MAX_ROWS  # 1: multi-row projections (verify) on cuBLAS
    write_json(R, name)
    log("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
