"""Where a batch-1 decode step of the 8B-shaped Llama spends its time (GPU machine).

    python3 scripts/gpu_profile.py      # writes $OUT/gpu_profile.json

1. the Triton GEMV against the eager composition (every config), and each projection
   alone (cuBLAS and Triton) against the copy bandwidth;
2. the kernels of one eager decode step (torch.profiler), grouped by name;
3. the CUDA-graph decode step as the engine runs it.
2 and 3 for each batch size in ROWS (default 1; ROWS=1,64,256 for the engine under load), each
row at 512 tokens of context.
4. PREFILL=1: prefill passes of 4 prompt chunks (512 tokens each, or three of 512 and one of
   128) after 0 and 512 cached tokens: kernels, eager and graph time, and the FLOPs bound.
   PARTS=prefill runs 4 alone (no GEMV tables, no decode steps).
"""

from __future__ import annotations

import json
import os
from collections import defaultdict

import torch
import torch.nn.functional as F

from cluster.bench.harness import copy_bandwidth, cuda_time
from cluster.bench.synthetic import NullTokenizer, random_llama
from cluster.engine.config import EngineConfig
from cluster.engine.engine import Engine
from cluster.bench.harness import OUT



SHAPES = {"qkv": (4096, 6144), "o": (4096, 4096), "gate_up": (4096, 28672), "down": (14336, 4096),
          "lm_head": (4096, 128256)}


def gemv_correct() -> dict:
    """Every Triton GEMV config against the eager composition, all fusions."""
    import triton
    from cluster.engine.worker import gemv
    from cluster.engine.worker.model import linear

    worst = {}
    k, n = 4096, 1024
    g = torch.Generator(device="cuda").manual_seed(0)
    for pro in ("none", "norm", "silu", "bias"):
        x = torch.randn((1, 2 * k if pro == "silu" else k), device="cuda", generator=g).bfloat16()
        w = (0.02 * torch.randn((n, k), device="cuda", generator=g)).bfloat16()
        nw = (1 + 0.1 * torch.randn((k,), device="cuda", generator=g)).bfloat16()
        b = torch.randn((n,), device="cuda", generator=g).bfloat16()
        r = torch.randn((1, n), device="cuda", generator=g).bfloat16()
        kw = dict(bias=b if pro == "bias" else None, norm=nw if pro == "norm" else None,
                  eps=1e-5, silu=pro == "silu", residual=r)
        ref = linear(x, w, **kw).float().reshape(-1)
        for c in gemv._configs():
            y = torch.empty((n,), dtype=torch.bfloat16, device="cuda")
            gemv._gemv.fn[(triton.cdiv(n, c.kwargs["BLOCK_N"]),)](
                x.reshape(-1), w, b, nw, r.reshape(-1), y, n, k, 1e-5, PRO={"norm": 1, "silu": 2}.get(pro, 0),
                RES=True, HAS_BIAS=pro == "bias", num_warps=c.num_warps, num_stages=c.num_stages, **c.kwargs)
            err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
            worst[pro] = max(worst.get(pro, 0.0), err)
    print("gemv worst relative error per case:", worst, flush=True)
    assert max(worst.values()) < 2e-2, worst
    return worst


def gemv_table(bw: float) -> dict:
    from cluster.engine.worker.gemv import fused_linear

    out = {}
    for name, (k, n) in SHAPES.items():
        w = torch.randn((n, k), dtype=torch.bfloat16, device="cuda")
        row = {}
        for m in (1,):
            x = torch.randn((m, k), dtype=torch.bfloat16, device="cuda")
            fused_linear(x, w)  # autotune
            # a fresh weight copy per timing would defeat L2; 4 weights in turn keep it cold
            ws = [w] + [torch.randn_like(w) for _ in range(3)] if n * k < 200e6 else [w]
            it = iter(range(10**9))
            t_cublas = cuda_time(lambda: F.linear(x, ws[next(it) % len(ws)]), 40)
            t_triton = cuda_time(lambda: fused_linear(x, ws[next(it) % len(ws)]), 40)
            byts = w.numel() * 2
            row[f"m{m}"] = {"cublas_us": 1e6 * t_cublas, "triton_us": 1e6 * t_triton,
                            "cublas_of_bw": byts / t_cublas / bw, "triton_of_bw": byts / t_triton / bw}
            ws = None  # freed before the next shape
        out[name] = row
        print(name, row, flush=True)
    return out


def kernel_table(prof) -> list[dict]:
    """A profile's CUDA kernels grouped by name, the costliest first."""
    groups = defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            g = groups[e.name[:90]]
            g[0] += 1
            g[1] += e.device_time
    return sorted(({"kernel": k, "count": c, "us": t} for k, (c, t) in groups.items()), key=lambda r: -r["us"])


def kernel_breakdown(engine, n: int = 1, ctx: int = 512) -> dict:
    """One decode step of `n` rows at `ctx` tokens of context each: its kernels, eager (the
    profiler sees each one), grouped by name; then the same step as the CUDA-graph replay the
    engine runs."""
    run = engine.runner
    handles = [engine.kv.open() for _ in range(n)]
    for h in handles:
        engine.kv.grow(h, ctx + 1)
    slots = [h.row for h in handles]
    for i in range(0, n, 8):  # prefill 8 rows a pass: 4,096 tokens, the engine's max_batch_tokens
        part = slots[i:i + 8]
        run.forward(part, [0] * len(part), [list(range(1, ctx + 1))] * len(part), last_only=True)
    step = lambda: run.forward(slots, [ctx] * n, [[5]] * n, last_only=False)  # noqa: E731
    graphs, run.graphs = run.graphs, None
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    run.graphs = graphs
    rows = kernel_table(prof)
    total = sum(r["us"] for r in rows)
    print(f"decode step of {n} rows at {ctx} tokens:", flush=True)
    for r in rows[:25]:
        print(f"{r['us']:9.1f} us {r['count']:5d}x  {r['kernel']}", flush=True)
    t_graph = cuda_time(step, 50)
    for h in handles:
        engine.kv.close(h)
    return {"rows": n, "context": ctx, "kernels_us_total": total, "kernel_count": sum(r["count"] for r in rows),
            "top": rows[:40], "graph_step_ms": 1e3 * t_graph}


def prefill_breakdown(engine, widths: list[int], cached: int) -> dict:
    """One prefill pass of rows of `widths` new tokens after `cached` tokens each: its kernels
    (eager, grouped by name), the eager pass's time from the host (CUDA events around the
    call, so host gaps count) and the CUDA-graph replay's where a graph serves it."""
    run = engine.runner
    handles = [engine.kv.open() for _ in widths]
    for h in handles:
        engine.kv.grow(h, cached + max(widths) + 1)
    rows = [h.row for h in handles]
    if cached:
        run.forward(rows, [0] * len(rows), [list(range(1, cached + 1))] * len(rows), last_only=True)
    tokens = [list(range(7, 7 + w)) for w in widths]
    step = lambda: run.forward(rows, [cached] * len(rows), tokens, last_only=True)  # noqa: E731
    graphs, run.graphs = run.graphs, None
    t_eager = cuda_time(step, 10)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    run.graphs = graphs
    top = kernel_table(prof)
    eligible = graphs is not None and graphs.eligible(len(widths), max(widths), True)
    t_graph = cuda_time(step, 10) if eligible else None
    for h in handles:
        engine.kv.close(h)
    m = engine.model
    flops = 2 * (sum(p.numel() for p in m.parameters()) - m.embed_tokens.weight.numel()) * sum(widths)  # matmuls
    out = {"widths": widths, "cached": cached, "eager_ms": 1e3 * t_eager, "kernels_us_total": sum(r["us"] for r in top),
           "kernel_count": sum(r["count"] for r in top), "graph_ms": None if t_graph is None else 1e3 * t_graph,
           "param_flops_tflop": flops / 1e12, "top": top[:25]}
    print(f"prefill {widths} after {cached}: eager {out['eager_ms']:.1f} ms, kernels {out['kernels_us_total'] / 1e3:.1f} ms,"
          f" graph {out['graph_ms']}", flush=True)
    for r in top[:12]:
        print(f"{r['us']:9.1f} us {r['count']:5d}x  {r['kernel']}", flush=True)
    return out


def main():
    bw = copy_bandwidth()
    R = {"device": torch.cuda.get_device_name(), "copy_bandwidth_TBps": bw / 1e12}
    only_prefill = os.environ.get("PARTS") == "prefill"
    if not only_prefill:
        R["gemv_max_rel_err"] = gemv_correct()
        R["gemv"] = gemv_table(bw)
    model = random_llama()
    sizes = [] if only_prefill else [int(x) for x in os.environ.get("ROWS", "1").split(",")]  # e.g. ROWS=1,64,256
    cfg = EngineConfig(max_num_seqs=max([8, *sizes]), max_model_len=2048, max_batch_tokens=2048, prefill_chunk=512,
                       gamma=4, gamma_max=8, device="cuda", dtype="bfloat16",
                       compile=os.environ.get("COMPILE", "1") == "1")
    engine = Engine(model, NullTokenizer(), cfg, identity="llama8b-random")
    for n in sizes:  # batch 1 keeps its old key; other sizes get their own
        b = R["breakdown" if n == 1 else f"breakdown_{n}"] = kernel_breakdown(engine, n)
        print(n, "rows: graph step ms", b["graph_step_ms"], "kernels", b["kernel_count"], "kernel us",
              b["kernels_us_total"], flush=True)
    if only_prefill or os.environ.get("PREFILL") == "1":
        R["prefill"] = [prefill_breakdown(engine, w, c) for c in (0, 512) for w in ([512] * 4, [512] * 3 + [128])]
    with open(os.path.join(OUT, "gpu_profile.json"), "w") as f:
        json.dump(R, f, indent=2)


if __name__ == "__main__":
    main()
