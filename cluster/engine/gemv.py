"""Skinny matmuls (at most 16 token rows: decode and verify at small batch) as one Triton
kernel that streams each weight once, with the layer's neighbours fused in.

Why: at batch 1 a decode step is weight bandwidth and little else, and cuBLAS picks tiles
made for larger M: on the 8B shapes on an H100 it reached 25-70% of copy bandwidth per
projection (benchmarks/gpu/gpu_profile.json). The kernel also takes the RMSNorm before a
projection (prologue), SiLU(gate) * up before down_proj (prologue) and the residual add
after (epilogue), so a layer is four weight streams and few small kernels in between.

Rounding follows the eager reference step by step (fp32 norm times weight, cast; SiLU cast,
times up, cast; output cast, plus residual, cast), so only summation order differs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

PRO_NONE, PRO_RMSNORM, PRO_SILU = 0, 1, 2
MAX_ROWS = 16


def _configs():
    out = []
    for bn in (4, 8, 16):  # one row at a time: FMA and a reduction over K
        for bk in (512, 1024):
            for st in (2, 4):
                out.append(triton.Config({"BLOCK_M": 1, "BLOCK_N": bn, "BLOCK_K": bk, "DOT": False},
                                         num_warps=4, num_stages=st))
    for bn in (16, 32, 64):  # up to 16 rows: tensor cores on a padded tile
        for bk in (128, 256):
            for st in (3, 5):
                out.append(triton.Config({"BLOCK_M": 16, "BLOCK_N": bn, "BLOCK_K": bk, "DOT": True},
                                         num_warps=4, num_stages=st))
    return out


def _prune(configs, named_args, **kw):
    m = named_args["M"]
    return [c for c in configs if c.kwargs["BLOCK_M"] >= m and named_args["K"] % c.kwargs["BLOCK_K"] == 0]


@triton.autotune(configs=_configs(), key=["N", "K", "ONE_ROW", "PRO", "RES"],
                 prune_configs_by={"early_config_prune": _prune})
@triton.jit
def _gemv(x_ptr, w_ptr, b_ptr, nw_ptr, res_ptr, y_ptr, M, N, K, stride_x, stride_y, eps,
          ONE_ROW: tl.constexpr, PRO: tl.constexpr, RES: tl.constexpr, HAS_BIAS: tl.constexpr,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT: tl.constexpr):
    rm = tl.arange(0, BLOCK_M)
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mmask = rm < M
    nmask = rn < N
    out_ty = y_ptr.dtype.element_ty
    if PRO == 1:  # rstd of each row: x is a few KB, re-read from L2 by every program
        ss = tl.zeros((BLOCK_M,), tl.float32)
        for kb in range(0, K // BLOCK_K):
            rk = kb * BLOCK_K + tl.arange(0, BLOCK_K)
            xv = tl.load(x_ptr + rm[:, None] * stride_x + rk[None, :], mask=mmask[:, None], other=0.0).to(tl.float32)
            ss += tl.sum(xv * xv, axis=1)
        rstd = tl.rsqrt(ss / K + eps)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for kb in range(0, K // BLOCK_K):  # K % BLOCK_K == 0 (configs are pruned to fit)
        rk = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        xp = x_ptr + rm[:, None] * stride_x + rk[None, :]
        xv = tl.load(xp, mask=mmask[:, None], other=0.0)
        if PRO == 1:
            nw = tl.load(nw_ptr + rk).to(tl.float32)
            xv = (xv.to(tl.float32) * rstd[:, None] * nw[None, :]).to(out_ty)
        if PRO == 2:  # x holds [gate | up], 2K wide
            up = tl.load(xp + K, mask=mmask[:, None], other=0.0)
            g = xv.to(tl.float32)
            s = (g * tl.sigmoid(g)).to(out_ty)
            xv = (s.to(tl.float32) * up.to(tl.float32)).to(out_ty)
        w = tl.load(w_ptr + rn[:, None] * K + rk[None, :], mask=nmask[:, None], other=0.0)
        if DOT:
            acc += tl.dot(xv, tl.trans(w))
        else:
            acc += tl.sum(xv.to(tl.float32) * w.to(tl.float32), axis=1)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
    out = acc.to(out_ty)
    ymask = mmask[:, None] & nmask[None, :]
    if RES:
        r = tl.load(res_ptr + rm[:, None] * stride_y + rn[None, :], mask=ymask, other=0.0)
        out = (out.to(tl.float32) + r.to(tl.float32)).to(out_ty)
    tl.store(y_ptr + rm[:, None] * stride_y + rn[None, :], out, mask=ymask)


def fused_linear(x: torch.Tensor, w: torch.Tensor, bias=None, norm=None, eps: float = 0.0,
                 silu: bool = False, residual=None) -> torch.Tensor:
    """y = [residual +] linear([rms_norm | silu_mul](x)); x: [..., K or 2K] with at most
    MAX_ROWS rows, w: [N, K] (nn.Linear layout), contiguous."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    m, n, k = x2.shape[0], w.shape[0], w.shape[1]
    assert m <= MAX_ROWS and x2.stride(-1) == 1 and w.is_contiguous()
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    res = residual.reshape(m, n) if residual is not None else y
    pro = PRO_SILU if silu else PRO_RMSNORM if norm is not None else PRO_NONE
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
    _gemv[grid](x2, w, bias if bias is not None else w, norm if norm is not None else w, res, y,
                m, n, k, x2.stride(0), y.stride(0), eps,
                ONE_ROW=m == 1, PRO=pro, RES=residual is not None, HAS_BIAS=bias is not None)
    return y.view(*lead, n)
