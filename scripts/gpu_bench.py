"""Hopper speed of the verifier engine on an 8B-shaped Llama (random bf16 weights).

    bash scripts/gpu_bench.sh      # on the GPU machine; writes $OUT/gpu_bench.json

1. batch-1 plain decoding (engine loop, CUDA graphs, FA3) against the bandwidth ceiling;
2. a verify pass over gamma=4 drafts against a one-token decode step (graph replays);
3. early-exit self-speculation: measured acceptance, speedup, and the ideal
   E[N] * t_target / (t_target + gamma * t_draft) from the measured parts;
4. FA3 against SDPA on the verify step's attention at 8k context, batch 64;
5. a concurrency sweep, plain decoding against the goodput controller.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from cluster.bench.synthetic import copy_bandwidth, cuda_time, NullTokenizer, random_llama
from cluster.engine.attention import AttnContext, SdpaBackend, make_backend
from cluster.engine.engine import Engine
from cluster.engine.sampling import SamplingParams
from cluster.engine.scheduler import EngineConfig
from cluster.engine.selfdraft import EarlyExitDrafter
from cluster.engine.sequence import SpecParams
from cluster.policy import SpeculationPolicyConfig, make_controller

OUT = os.environ.get("OUT", ".")
T0 = time.time()


def log(*a):
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def prompt(n=512, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(1, 128000, (n,), generator=g).tolist()


def decode_rate(engine, spec, drafter=None, new=256, n=1) -> dict:
    ps = [prompt(seed=i) for i in range(n)]
    res = engine.generate(ps, SamplingParams(max_tokens=new, ignore_eos=True), spec, drafter)
    toks = sum(len(r["token_ids"]) - 1 for r in res)  # after the first token: decode only
    secs = max((r["timing"]["total_ms"] - r["timing"]["ttft_ms"]) / 1e3 for r in res)
    d = sum(r["spec"]["drafted"] for r in res)
    a = sum(r["spec"]["accepted"] for r in res)
    vs = sum(r["spec"]["verify_steps"] for r in res)
    return {"tokens_per_s": toks / secs, "acceptance_rate": a / d if d else 0.0,
            "mean_accepted_len": (a + vs) / vs if vs else 1.0}


def main() -> int:
    R: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    bw = copy_bandwidth()
    model = random_llama()
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    ceiling = bw / param_bytes
    R.update(copy_bandwidth_TBps=bw / 1e12, param_bytes=param_bytes, ceiling_tokens_per_s=ceiling)
    log(f"bandwidth {bw/1e12:.2f} TB/s, ceiling {ceiling:.1f} tok/s")
    cfg = EngineConfig(max_num_seqs=64, max_model_len=1024, max_batch_tokens=4096, prefill_chunk=512,
                       prefix_cache_blocks=0, gamma=4, gamma_max=8, device="cuda", dtype="bfloat16",
                       compile=os.environ.get("COMPILE", "1") == "1")
    engine = Engine(model, NullTokenizer(), cfg, identity="llama8b-random")
    R["backend"] = engine.backend
    R["compiled_kernels"] = cfg.compile
    decode_rate(engine, SpecParams("off"), new=16)  # capture graphs, warm up
    plain = decode_rate(engine, SpecParams("off"))
    R["plain_batch1"] = {**plain, "fraction_of_ceiling": plain["tokens_per_s"] / ceiling}
    log("plain batch 1:", R["plain_batch1"])

    run = engine.runner
    slot = engine.kv.allocate()
    run.forward([slot], [0], [prompt()], last_only=True)
    t_dec = cuda_time(lambda: run.forward([slot], [512], [[5]], last_only=False))
    t_ver = cuda_time(lambda: run.forward([slot], [512], [[5, 6, 7, 8, 9]], last_only=False))
    R["verify_gamma4_over_decode"] = {"decode_ms": 1e3 * t_dec, "verify5_ms": 1e3 * t_ver, "ratio": t_ver / t_dec}
    log("verify/decode:", R["verify_gamma4_over_decode"])

    R["self_draft"] = {}
    for layers in (4, 16, 28):
        t_draft = cuda_time(lambda: run.forward([slot], [512], [[5]], last_only=False, num_layers=layers))
        engine.drafters["early-exit"] = EarlyExitDrafter(engine, layers)
        decode_rate(engine, SpecParams("fixed", 4), "early-exit", new=16)  # capture this exit's graphs
        for gamma in (2, 4):
            spec = decode_rate(engine, SpecParams("fixed", gamma), "early-exit")
            ideal_tps = spec["mean_accepted_len"] / (t_dec + gamma * t_draft)
            R["self_draft"][f"L{layers}_g{gamma}"] = {
                **spec, "draft_step_ms": 1e3 * t_draft, "speedup": spec["tokens_per_s"] / plain["tokens_per_s"],
                "ideal_tokens_per_s": ideal_tps, "fraction_of_ideal": spec["tokens_per_s"] / ideal_tps}
            log(f"self-draft L{layers} g{gamma}:", R["self_draft"][f"L{layers}_g{gamma}"])
    engine.kv.free(slot)

    # attention only: the verify step (q = 5) at 8k context, batch 64
    s = model.shape
    B, T, ctx_len = 64, 5, 8192
    kc = torch.randn((B + 1, ctx_len + 16, s.kv_heads, s.head_dim), dtype=torch.bfloat16, device="cuda")
    vc = torch.randn_like(kc)
    q = torch.randn((B, T, s.heads, s.head_dim), dtype=torch.bfloat16, device="cuda")
    k = torch.randn((B, T, s.kv_heads, s.head_dim), dtype=torch.bfloat16, device="cuda")
    actx = AttnContext.build(list(range(B)), [ctx_len - T] * B, [T] * B, "cuda")
    fa3 = make_backend("fa3", torch.device("cuda"), torch.bfloat16)
    t_fa3 = cuda_time(lambda: fa3(q, k, k, kc, vc, actx))
    t_sdpa = cuda_time(lambda: SdpaBackend()(q, k, k, kc, vc, actx))
    R["verify_attention_8k_b64"] = {"fa3_ms": 1e3 * t_fa3, "sdpa_ms": 1e3 * t_sdpa, "sdpa_over_fa3": t_sdpa / t_fa3}
    log("attention 8k b64:", R["verify_attention_8k_b64"])

    engine.drafters["early-exit"] = EarlyExitDrafter(engine, 16)
    engine.default_drafter = engine.planner.default = "early-exit"
    sweep = []
    for c in (1, 4, 16, 64):
        if time.time() - T0 > 420:
            log("time budget reached; sweep stops at", c)
            break
        off = decode_rate(engine, SpecParams("off"), new=128, n=c)
        engine.controller = make_controller(SpeculationPolicyConfig(mode="goodput"))
        decode_rate(engine, SpecParams("auto"), new=32, n=c)  # let the controller measure
        auto = decode_rate(engine, SpecParams("auto"), new=128, n=c)
        gamma = engine.controller.snapshot().get("gamma")
        engine.controller = None
        sweep.append({"concurrency": c, "off_tokens_per_s": off["tokens_per_s"],
                      "goodput_tokens_per_s": auto["tokens_per_s"], "goodput_gamma": gamma,
                      "ratio": auto["tokens_per_s"] / off["tokens_per_s"]})
        log("sweep:", sweep[-1])
    R["concurrency_sweep"] = sweep
    with open(os.path.join(OUT, "gpu_bench.json"), "w") as f:
        json.dump(R, f, indent=2)
    log("done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
