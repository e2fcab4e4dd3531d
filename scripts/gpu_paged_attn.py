"""The paged-attention kernel (cluster/engine/worker/paged_attention.py) on a Hopper GPU: correctness
against SDPA, a sweep of its block configs, and its time against the FA3 slot-cache path it
replaces (the fa3-fwd wheel's flash_attn_with_kvcache with cache_batch_idx, which has no paged
KV), at the shapes of Llama-3.1-8B (32 q heads, 8 kv heads, head dim 128), bf16.

    bash scripts/gpu_py.sh gpu_paged_attn.py     # writes $OUT/gpu_paged_attn.json
    PARTS=prefill bash scripts/gpu_py.sh gpu_paged_attn.py   # prompt chunks only (prefill_sweep)

The gate (issue 23): the verify step's attention, q = 5 tokens, 8k context, batch 64, at most
1.2x the FA3 slot path.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.nn.functional as F

from cluster.bench.harness import cuda_time
from cluster.engine.worker.paged_attention import num_splits, paged_attention
from cluster.bench.harness import OUT

H, HKV, D, BS = 32, 8, 128, 16
DEV = "cuda"


def paged_inputs(B: int, ctx: int, T: int, seed: int = 0):
    """A pool with every sequence's blocks scattered at random, as a busy pool has them."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    per = -(-(ctx + T) // BS)
    blocks = B * per
    kc = torch.randn((blocks + 1, BS, HKV, D), dtype=torch.bfloat16, device=DEV, generator=g)
    vc = torch.randn_like(kc)
    perm = torch.randperm(blocks, device=DEV, generator=g).to(torch.int32)
    tables = torch.full((B + 1, per), blocks, dtype=torch.int32, device=DEV)
    tables[:B] = perm.view(B, per)
    q = torch.randn((B, T, H, D), dtype=torch.bfloat16, device=DEV, generator=g)
    rows = torch.arange(B, device=DEV)
    lens = torch.full((B,), ctx, dtype=torch.int64, device=DEV)
    qlens = torch.full((B,), T, dtype=torch.int64, device=DEV)
    return q, kc, vc, tables, rows, lens, qlens


def reference(q, kc, vc, tables, rows, lens, qlens) -> torch.Tensor:
    B, T = q.shape[:2]
    L = int(lens[0]) + T
    pos = torch.arange(L, device=DEV)
    idx = tables[rows][:, pos // BS].long() * BS + pos % BS                      # [B, L]
    k = kc.view(-1, HKV, D)[idx].transpose(1, 2)
    v = vc.view(-1, HKV, D)[idx].transpose(1, 2)
    mask = pos[None, :] <= (lens[:1, None] + torch.arange(T, device=DEV))[0][:, None]
    return F.scaled_dot_product_attention(q.transpose(1, 2), k, v, attn_mask=mask, enable_gqa=True).transpose(1, 2)


def fa3_slot_time(B: int, ctx: int, T: int) -> float | None:
    try:
        from fa3_fwd_interface import flash_attn_with_kvcache, get_scheduler_metadata
    except ImportError:
        try:
            from flash_attn_interface import flash_attn_with_kvcache, get_scheduler_metadata
        except ImportError:
            return None
    kc = torch.randn((B + 1, ctx + 16, HKV, D), dtype=torch.bfloat16, device=DEV)
    vc = torch.randn_like(kc)
    q = torch.randn((B, T, H, D), dtype=torch.bfloat16, device=DEV)
    k = torch.randn((B, T, HKV, D), dtype=torch.bfloat16, device=DEV)
    lens = torch.full((B,), ctx, dtype=torch.int32, device=DEV)
    idx = torch.arange(B, dtype=torch.int32, device=DEV)
    meta = get_scheduler_metadata(B, T, kc.shape[1], H, HKV, D, lens, q.dtype, max_seqlen_k_new=T, causal=True)
    t = cuda_time(lambda: flash_attn_with_kvcache(q, kc, vc, k=k, v=k, cache_seqlens=lens, cache_batch_idx=idx,
                                                  causal=True, scheduler_metadata=meta))
    kc = vc = None  # freed before the next shape
    return t


def prefill_sweep(R: dict) -> None:
    """PARTS=prefill: prompt chunks as the 8B prefill passes run them (4 rows of 512 tokens after
    0 and 512 cached): the kernel's block configs, BLOCK_M included, each checked against SDPA,
    beside FA3's dense varlen over the same new tokens (nothing cached: what a fresh prompt's
    attention costs at FA3's speed)."""
    from triton.runtime.errors import OutOfResources

    for B, ctx, T in ((4, 0, 512), (4, 512, 512)):
        args = paged_inputs(B, ctx, T)
        ref = reference(*args).float()
        rows = []
        for bm in (64, 128):
            for bn in (64, 128):
                for warps in (4, 8):
                    for stages in (2, 3):
                        cfg = (bn, warps, stages, bm)
                        try:
                            out = paged_attention(*args, 1, config=cfg)
                        except OutOfResources:
                            continue
                        err = ((out.float() - ref).norm() / ref.norm()).item()
                        rows.append({"config": cfg, "ms": 1e3 * cuda_time(lambda: paged_attention(*args, 1, config=cfg)),
                                     "relative_error": err})
        default = 1e3 * cuda_time(lambda: paged_attention(*args, 1))
        line = {"batch": B, "ctx": ctx, "q": T, "default_ms": default, "best": min(rows, key=lambda r: r["ms"]),
                "configs": rows}
        if ctx == 0:
            try:
                from fa3_fwd_interface import flash_attn_varlen_func
            except ImportError:
                flash_attn_varlen_func = None
            if flash_attn_varlen_func is not None:
                q = args[0].reshape(B * T, H, D)
                k = torch.randn((B * T, HKV, D), dtype=q.dtype, device=DEV)
                cu = torch.arange(0, B * T + 1, T, dtype=torch.int32, device=DEV)
                line["fa3_varlen_ms"] = 1e3 * cuda_time(
                    lambda: flash_attn_varlen_func(q, k, k, cu, cu, T, T, causal=True))
        R.setdefault("prefill_sweep", []).append(line)
        print({k: v for k, v in line.items() if k != "configs"}, flush=True)


def main() -> int:
    t0 = time.time()
    R: dict = {"device": torch.cuda.get_device_name(), "shape": {"heads": H, "kv_heads": HKV, "head_dim": D,
                                                                  "block_size": BS}}
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if os.environ.get("PARTS") == "prefill":
        prefill_sweep(R)
        os.makedirs(OUT, exist_ok=True)
        with open(os.path.join(OUT, "gpu_paged_attn.json"), "w") as f:
            json.dump(R, f, indent=1)
        return 0
    # correctness first, on every width the engine uses (decode, verify, prefill chunk)
    errs = {}
    for B, ctx, T in ((3, 700, 1), (5, 1500, 5), (2, 300, 9), (1, 2000, 512)):
        args = paged_inputs(B, ctx, T, seed=B)
        ref = reference(*args)
        splits = num_splits(B, HKV, -(-T * (H // HKV) // 64), ctx + T, sms) if T <= 16 else 1
        out = paged_attention(*args, splits)
        errs[f"b{B}_ctx{ctx}_q{T}_s{splits}"] = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    R["relative_error"] = errs
    print("relative error vs SDPA:", errs, flush=True)
    if not all(e < 2e-2 for e in errs.values()):
        print("WRONG RESULTS")
        return 1
    # block-config sweep at the gate shape and at batch 1
    sweep = []
    for B, ctx, T in ((64, 8192, 5), (1, 1024, 1), (1, 1024, 5), (64, 8192, 1)):
        args = paged_inputs(B, ctx, T)
        splits = num_splits(B, HKV, -(-T * (H // HKV) // 64), ctx + T, sms)
        for cfg in [(32, 4, 2), (64, 4, 2), (64, 4, 3), (64, 8, 2), (128, 4, 2), (128, 8, 2), (128, 8, 3)]:
            for s in sorted({1, splits, max(1, splits // 2), min(16, 2 * splits)}):
                t = cuda_time(lambda: paged_attention(*args, s, config=cfg))
                sweep.append({"batch": B, "ctx": ctx, "q": T, "config": cfg, "splits": s, "ms": 1e3 * t})
        del args
        best = min((x for x in sweep if x["batch"] == B and x["ctx"] == ctx and x["q"] == T), key=lambda x: x["ms"])
        fa3 = fa3_slot_time(B, ctx, T)
        line = {"batch": B, "ctx": ctx, "q": T, "best": best, "default_ms": next(
            x["ms"] for x in sweep if x["batch"] == B and x["ctx"] == ctx and x["q"] == T and x["config"] == (64, 4, 2)
            and x["splits"] == splits), "fa3_slot_ms": fa3 and 1e3 * fa3}
        line["best_over_fa3"] = line["best"]["ms"] / line["fa3_slot_ms"] if fa3 else None
        R.setdefault("summary", []).append(line)
        print(f"[{time.time() - t0:5.1f}s]", line, flush=True)
    # prefill chunks: 512 new tokens after 0 and 8k cached ones
    for ctx in (0, 8192):
        args = paged_inputs(1, ctx, 512)
        R.setdefault("prefill", []).append({"ctx": ctx, "q": 512, "ms": 1e3 * cuda_time(lambda: paged_attention(*args, 1))})
        print("prefill:", R["prefill"][-1], flush=True)
    R["sweep"] = sweep
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "gpu_paged_attn.json"), "w") as f:
        json.dump(R, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
