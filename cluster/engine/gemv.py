"""Skinny matmuls (at most MAX_ROWS = 16 token rows: batch-1 decode, speculative verify,
small-batch decode) as Triton kernels that stream each weight once, with the layer's
neighbours fused in.

Why: at batch 1 a decode step is weight bandwidth and little else, so what costs is the
small kernels between the weight streams. The kernels take the RMSNorm before a projection
(prologue), SiLU(gate) * up before down_proj (prologue) and the residual add after
(epilogue), so a layer is four weight streams and few small kernels in between. On an H100
(8B shape) a step went from 721 to 274 kernels and 7.81 to 6.40 ms; the projections
themselves from 5.58 ms (cuBLAS) to 5.28 ms, against 5.01 ms of weights at copy bandwidth
(benchmarks/gpu/h100/gpu_profile*.json, scripts/gpu_profile.py).

One row runs `_gemv` (FMAs; tuned and measured for decode). 2..16 rows run `_gemv_rows`: the
rows padded to one 16-row tensor-core tile, so a verify pass (gamma + 1 rows) streams each
weight once with the same fused neighbours as a decode step; the aim is a verify that costs
about one decode step. Its speed is for scripts/gpu_profile.py and scripts/gpu_bench.py to
measure: the padded 16-row tile tried before (git df6482e^) cost a gamma=4 verify 1.86
decode steps, against 1.14 through cuBLAS.

Rounding follows the eager reference step by step (fp32 norm times weight, cast; SiLU cast,
times up, cast; output cast, plus residual, cast), so only summation order differs.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

PRO_NONE, PRO_RMSNORM, PRO_SILU = 0, 1, 2
# rows a call may have; 1 row -> _gemv, 2..16 -> _gemv_rows (one padded tile). GEMV_MAX_ROWS=1
# sends multi-row calls back to cuBLAS (to compare the two in one benchmark script)
MAX_ROWS = int(os.environ.get("GEMV_MAX_ROWS", "16"))
# GEMV_CONFIGS=one: a single config per kernel (no autotuning), for the CPU interpreter test,
# where every config would otherwise be run (tests/engine/test_gemv.py).
_ONE = os.environ.get("GEMV_CONFIGS") == "one"


def _configs():
    if _ONE:
        return [triton.Config({"BLOCK_N": 16, "BLOCK_K": 128}, num_warps=4, num_stages=2)]
    return [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=st)
            for bn in (4, 8, 16) for bk in (128, 256, 512, 1024) for w in (4, 8) for st in (2, 3)
            if bn * bk <= 8192]


def _rows_configs():
    # tl.dot needs every dim >= 16. Weight tiles of 4-8K elements (8-16 KB bf16) per stage keep
    # the search short: smaller ones put few bytes in flight, larger ones leave few programs.
    if _ONE:
        return [triton.Config({"BLOCK_N": 16, "BLOCK_K": 64}, num_warps=4, num_stages=3)]
    return [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=st)
            for bn in (16, 32, 64) for bk in (64, 128, 256) for w in (4, 8) for st in (3, 4, 5)
            if 4096 <= bn * bk <= 8192]


def _prune(configs, named_args, **kw):
    return [c for c in configs if named_args["K"] % c.kwargs["BLOCK_K"] == 0]


@triton.autotune(configs=_configs(), key=["N", "K", "PRO", "RES", "HAS_BIAS"],
                 prune_configs_by={"early_config_prune": _prune})
@triton.jit
def _gemv(x_ptr, w_ptr, b_ptr, nw_ptr, res_ptr, y_ptr, N, K, eps,
          PRO: tl.constexpr, RES: tl.constexpr, HAS_BIAS: tl.constexpr,
          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = rn < N
    out_ty = y_ptr.dtype.element_ty
    if PRO == 1:  # rstd of the row: x is a few KB, re-read from L2 by every program
        ss = tl.zeros((BLOCK_K,), tl.float32)
        for kb in range(0, K // BLOCK_K):
            xv = tl.load(x_ptr + kb * BLOCK_K + tl.arange(0, BLOCK_K)).to(tl.float32)
            ss += xv * xv
        rstd = tl.rsqrt(tl.sum(ss, axis=0) / K + eps)
    # A 2-D accumulator, reduced once at the end: the loop is loads and FMAs only.
    acc = tl.zeros((BLOCK_N, BLOCK_K), tl.float32)
    for kb in range(0, K // BLOCK_K):  # K % BLOCK_K == 0 (configs are pruned to fit)
        rk = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        xv = tl.load(x_ptr + rk)
        if PRO == 1:
            nw = tl.load(nw_ptr + rk).to(tl.float32)
            xv = (xv.to(tl.float32) * rstd * nw).to(out_ty)
        if PRO == 2:  # x holds [gate | up], 2K wide
            up = tl.load(x_ptr + K + rk)
            g = xv.to(tl.float32)
            s = (g * tl.sigmoid(g)).to(out_ty)
            xv = (s.to(tl.float32) * up.to(tl.float32)).to(out_ty)
        w = tl.load(w_ptr + rn[:, None] * K + rk[None, :], mask=nmask[:, None], other=0.0,
                    eviction_policy="evict_first")  # streamed once: keep L2 for x
        acc += w.to(tl.float32) * xv.to(tl.float32)[None, :]
    out = tl.sum(acc, axis=1)
    if HAS_BIAS:
        out += tl.load(b_ptr + rn, mask=nmask, other=0.0).to(tl.float32)
    out = out.to(out_ty)
    if RES:
        r = tl.load(res_ptr + rn, mask=nmask, other=0.0)
        out = (out.to(tl.float32) + r.to(tl.float32)).to(out_ty)
    tl.store(y_ptr + rn, out, mask=nmask)


# M is not in the key: rows are padded to one 16-row tile, so one tuning per shape serves
# every row count (each new key costs a tuning pass before a CUDA graph capture)
@triton.autotune(configs=_rows_configs(), key=["N", "K", "PRO", "RES", "HAS_BIAS"],
                 prune_configs_by={"early_config_prune": _prune})
@triton.jit
def _gemv_rows(x_ptr, w_ptr, b_ptr, nw_ptr, res_ptr, y_ptr, M, N, K, stride_x, stride_r, eps,
               PRO: tl.constexpr, RES: tl.constexpr, HAS_BIAS: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr = 16):
    rm = tl.arange(0, BLOCK_M)  # rows past M are masked to 0 (no memory traffic) and not stored
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mmask = rm < M
    nmask = rn < N
    out_ty = y_ptr.dtype.element_ty
    if PRO == 1:  # rstd of each row, as in _gemv
        ss = tl.zeros((BLOCK_M, BLOCK_K), tl.float32)
        for kb in range(0, K // BLOCK_K):
            rk = kb * BLOCK_K + tl.arange(0, BLOCK_K)
            xv = tl.load(x_ptr + rm[:, None] * stride_x + rk[None, :], mask=mmask[:, None],
                         other=0.0).to(tl.float32)
            ss += xv * xv
        rstd = tl.rsqrt(tl.sum(ss, axis=1) / K + eps)[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for kb in range(0, K // BLOCK_K):  # K % BLOCK_K == 0 (configs are pruned to fit)
        rk = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        xp = x_ptr + rm[:, None] * stride_x + rk[None, :]
        xv = tl.load(xp, mask=mmask[:, None], other=0.0)
        if PRO == 1:
            nw = tl.load(nw_ptr + rk).to(tl.float32)[None, :]
            xv = (xv.to(tl.float32) * rstd * nw).to(out_ty)
        if PRO == 2:  # x holds [gate | up], 2K wide
            up = tl.load(xp + K, mask=mmask[:, None], other=0.0)
            g = xv.to(tl.float32)
            s = (g * tl.sigmoid(g)).to(out_ty)
            xv = (s.to(tl.float32) * up.to(tl.float32)).to(out_ty)
        w = tl.load(w_ptr + rn[:, None] * K + rk[None, :], mask=nmask[:, None], other=0.0,
                    eviction_policy="evict_first")  # streamed once: keep L2 for x
        if out_ty == tl.float32:  # fp32 models: exact products, as cuBLAS without TF32
            acc = tl.dot(xv, tl.trans(w), acc, input_precision="ieee")
        else:
            acc = tl.dot(xv, tl.trans(w), acc)
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
    out = acc.to(out_ty)
    ymask = mmask[:, None] & nmask[None, :]
    if RES:
        r = tl.load(res_ptr + rm[:, None] * stride_r + rn[None, :], mask=ymask, other=0.0)
        out = (out.to(tl.float32) + r.to(tl.float32)).to(out_ty)
    tl.store(y_ptr + rm[:, None] * N + rn[None, :], out, mask=ymask)


def supported(k: int) -> bool:
    return k % 128 == 0  # some BLOCK_K divides K (the loop has no tail)


def _rows(t: torch.Tensor, m: int) -> torch.Tensor:
    t = t.reshape(m, -1)
    return t if t.stride(-1) == 1 else t.contiguous()


def fused_linear(x: torch.Tensor, w: torch.Tensor, bias=None, norm=None, eps: float = 0.0,
                 silu: bool = False, residual=None) -> torch.Tensor:
    """y = [residual +] linear([rms_norm | silu_mul](x)); x: [..., K or 2K] with at most
    MAX_ROWS rows, w: [N, K] (nn.Linear layout), contiguous."""
    lead = x.shape[:-1]
    n, k = w.shape
    m = x.numel() // x.shape[-1]
    assert 1 <= m <= MAX_ROWS and w.is_contiguous()
    pro = PRO_SILU if silu else PRO_RMSNORM if norm is not None else PRO_NONE
    b, nw = bias if bias is not None else w, norm if norm is not None else w
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
    if m == 1:
        x1 = x.reshape(-1).contiguous()
        y = torch.empty((n,), dtype=x.dtype, device=x.device)
        res = residual.reshape(n) if residual is not None else y
        _gemv[grid](x1, w, b, nw, res, y, n, k, eps,
                    PRO=pro, RES=residual is not None, HAS_BIAS=bias is not None)
    else:
        x2 = _rows(x, m)
        y = torch.empty((m, n), dtype=x.dtype, device=x.device)
        res = _rows(residual, m) if residual is not None else y
        _gemv_rows[grid](x2, w, b, nw, res, y, m, n, k, x2.stride(0), res.stride(0), eps,
                         PRO=pro, RES=residual is not None, HAS_BIAS=bias is not None)
    return y.view(*lead, n)
