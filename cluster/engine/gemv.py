"""Matrix-vector products (one token row: batch-1 decode; a few rows: a verify pass, a small
batch) as one Triton kernel that streams each weight once, with the layer's neighbours fused in.

Why: at batch 1 a decode step is weight bandwidth and little else, so what costs is the
small kernels between the weight streams. The kernel takes the RMSNorm before a projection
(prologue), SiLU(gate) * up before down_proj (prologue) and the residual add after
(epilogue), so a layer is four weight streams and few small kernels in between. On an H100
(8B shape) a step went from 721 to 274 kernels and 7.81 to 6.40 ms; the projections
themselves from 5.58 ms (cuBLAS) to 5.28 ms, against 5.01 ms of weights at copy bandwidth
(benchmarks/gpu/h100/gpu_profile*.json, scripts/gpu_profile.py).

Rounding follows the eager reference step by step (fp32 norm times weight, cast; SiLU cast,
times up, cast; output cast, plus residual, cast), so only summation order differs.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

PRO_NONE, PRO_RMSNORM, PRO_SILU = 0, 1, 2
# Token rows a projection takes here; more go to cuBLAS. One row is the batch-1 decode; 2..9
# are a batch-1 verify (gamma + 1) or a small decode batch, which on cuBLAS (and unfused
# norm, SiLU and residual kernels) cost 1.15-1.19 decode steps for gamma 4 (H100, 8B
# shape). Those rows go to _gemv_rows: the same weight stream, each weight tile applied to
# every row on the CUDA cores. (A padded 16-row tensor-core tile, tl.dot, cost 1.97.)
MAX_ROWS = int(os.environ.get("GEMV_MAX_ROWS", "8"))


def _configs():
    if os.environ.get("GEMV_CONFIGS") == "one":  # the CPU interpreter test: no autotuning
        return [triton.Config({"BLOCK_N": 16, "BLOCK_K": 128}, num_warps=4, num_stages=2)]
    return [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=st)
            for bn in (4, 8, 16) for bk in (128, 256, 512, 1024) for w in (4, 8) for st in (2, 3)
            if bn * bk <= 8192]


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


def _row_configs():
    if os.environ.get("GEMV_CONFIGS") == "one":
        return [triton.Config({"BLOCK_N": 16, "BLOCK_K": 128}, num_warps=4, num_stages=2)]
    return [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=2)
            for bn in (4, 8, 16) for bk in (128, 256, 512) for w in (4, 8)]


def _prune_rows(configs, named_args, **kw):
    # the accumulator holds ROWS x BLOCK_N x BLOCK_K floats: keep it in registers
    fit = [c for c in configs if named_args["K"] % c.kwargs["BLOCK_K"] == 0
           and kw["ROWS"] * c.kwargs["BLOCK_N"] * c.kwargs["BLOCK_K"] <= 16384]
    return fit or configs[:1]


@triton.autotune(configs=_row_configs(), key=["N", "K", "PRO", "RES", "HAS_BIAS", "ROWS"],
                 prune_configs_by={"early_config_prune": _prune_rows})
@triton.jit
def _gemv_rows(x_ptr, w_ptr, b_ptr, nw_ptr, res_ptr, y_ptr, M, N, K, eps,
               PRO: tl.constexpr, RES: tl.constexpr, HAS_BIAS: tl.constexpr, ROWS: tl.constexpr,
               BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """_gemv for M <= ROWS rows (x: [M, K], or [M, 2K] for SiLU; y, res: [M, N])."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    nmask = rn < N
    rm = tl.arange(0, ROWS)
    mmask = rm < M
    out_ty = y_ptr.dtype.element_ty
    xs = 2 * K if PRO == 2 else K  # row stride of x
    if PRO == 1:
        ss = tl.zeros((ROWS, BLOCK_K), tl.float32)
        for kb in range(0, K // BLOCK_K):
            rk = kb * BLOCK_K + tl.arange(0, BLOCK_K)
            xv = tl.load(x_ptr + rm[:, None] * xs + rk[None, :], mask=mmask[:, None], other=0.0).to(tl.float32)
            ss += xv * xv
        rstd = tl.rsqrt(tl.sum(ss, axis=1) / K + eps)
    acc = tl.zeros((ROWS, BLOCK_N, BLOCK_K), tl.float32)
    for kb in range(0, K // BLOCK_K):
        rk = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        xv = tl.load(x_ptr + rm[:, None] * xs + rk[None, :], mask=mmask[:, None], other=0.0)
        if PRO == 1:
            nw = tl.load(nw_ptr + rk).to(tl.float32)
            xv = (xv.to(tl.float32) * rstd[:, None] * nw[None, :]).to(out_ty)
        if PRO == 2:
            up = tl.load(x_ptr + rm[:, None] * xs + K + rk[None, :], mask=mmask[:, None], other=0.0)
            g = xv.to(tl.float32)
            s = (g * tl.sigmoid(g)).to(out_ty)
            xv = (s.to(tl.float32) * up.to(tl.float32)).to(out_ty)
        w = tl.load(w_ptr + rn[:, None] * K + rk[None, :], mask=nmask[:, None], other=0.0,
                    eviction_policy="evict_first")
        acc += w.to(tl.float32)[None, :, :] * xv.to(tl.float32)[:, None, :]
    out = tl.sum(acc, axis=2)  # [ROWS, BLOCK_N]
    if HAS_BIAS:
        out += tl.load(b_ptr + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
    out = out.to(out_ty)
    omask = mmask[:, None] & nmask[None, :]
    if RES:
        r = tl.load(res_ptr + rm[:, None] * N + rn[None, :], mask=omask, other=0.0)
        out = (out.to(tl.float32) + r.to(tl.float32)).to(out_ty)
    tl.store(y_ptr + rm[:, None] * N + rn[None, :], out, mask=omask)


def supported(k: int) -> bool:
    return k % 128 == 0  # some BLOCK_K divides K (the loop has no tail)


def fused_linear(x: torch.Tensor, w: torch.Tensor, bias=None, norm=None, eps: float = 0.0,
                 silu: bool = False, residual=None) -> torch.Tensor:
    """y = [residual +] linear([rms_norm | silu_mul](x)) for up to MAX_ROWS token rows;
    x: [..., K or 2K], w: [N, K] (nn.Linear layout), contiguous."""
    lead = x.shape[:-1]
    n, k = w.shape
    m = x.numel() // x.shape[-1]
    assert 1 <= m <= max(1, MAX_ROWS) and w.is_contiguous()
    x1 = x.reshape(m, -1).contiguous()
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    res = residual.reshape(m, n).contiguous() if residual is not None else y
    pro = PRO_SILU if silu else PRO_RMSNORM if norm is not None else PRO_NONE
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
    args = (x1, w, bias if bias is not None else w, norm if norm is not None else w, res, y)
    flags = dict(PRO=pro, RES=residual is not None, HAS_BIAS=bias is not None)
    if m == 1:
        _gemv[grid](*args, n, k, eps, **flags)
    else:  # rows padded to a power of two: one compiled kernel (and tuning) per bucket
        _gemv_rows[grid](*args, m, n, k, eps, ROWS=triton.next_power_of_2(m), **flags)
    return y.view(*lead, n)
