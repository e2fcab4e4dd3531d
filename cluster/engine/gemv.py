"""Matrix-vector products (one token row: batch-1 decode) as one Triton kernel that
streams each weight once, with the layer's neighbours fused in.

Why: at batch 1 a decode step is weight bandwidth and little else, so what costs is the
small kernels between the weight streams. The kernel takes the RMSNorm before a projection
(prologue), SiLU(gate) * up before down_proj (prologue) and the residual add after
(epilogue), so a layer is four weight streams and few small kernels in between. On an H100
(8B shape) a step went from 721 to 274 kernels and 7.81 to 6.40 ms; the projections
themselves from 5.58 ms (cuBLAS) to 5.28 ms, against 5.01 ms of weights at copy bandwidth
(benchmarks/gpu/h100/gpu_profile*.json, scripts/gpu_profile.py).

Rounding follows the eager reference step by step (fp32 norm times weight, cast; SiLU cast,
times up, cast) up to the residual, which is added in fp32 before the output's one rounding,
as cuBLAS's addmm epilogue does on the wider steps: a verify pass then rounds as a decode
step does. (Rounding the product first, as the eager path does, while the verify's addmm did
not, changed greedy tokens between speculation and plain decoding at every gamma in the
H100 run that tried it.)
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

PRO_NONE, PRO_RMSNORM, PRO_SILU = 0, 1, 2
MAX_ROWS = 1  # one token row (batch-1 decode); more rows go to cuBLAS: with them a gamma=4
              # verify costs 1.13-1.19 decode steps. Tried for 2..8 rows: a padded 16-row
              # tensor-core tile (tl.dot, 30 autotuned configs) cost 1.97; each weight tile
              # applied to every row on the CUDA cores won at 2 rows only (6.71 against 6.94 ms)
              # and lost from 3 (4 rows 8.55 ms, 8 rows 13.6 against 7.26): the FMAs, not the
              # weight stream, bound it (H100, benchmarks/gpu/h100/gpu_gemv_rows_cuda_cores.json,
              # scripts/gpu_gemv_rows.py at commit 2d95708).


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
    if RES:  # added before the one rounding, as the addmm of wider steps (model.compile_kernels)
        out += tl.load(res_ptr + rn, mask=nmask, other=0.0).to(tl.float32)
    tl.store(y_ptr + rn, out.to(out_ty), mask=nmask)


def supported(k: int) -> bool:
    return k % 128 == 0  # some BLOCK_K divides K (the loop has no tail)


def fused_linear(x: torch.Tensor, w: torch.Tensor, bias=None, norm=None, eps: float = 0.0,
                 silu: bool = False, residual=None) -> torch.Tensor:
    """y = [residual +] linear([rms_norm | silu_mul](x)) for one row; x: [..., K or 2K],
    w: [N, K] (nn.Linear layout), contiguous."""
    lead = x.shape[:-1]
    n, k = w.shape
    assert x.numel() // x.shape[-1] == 1 and w.is_contiguous()
    x1 = x.reshape(-1).contiguous()
    y = torch.empty((n,), dtype=x.dtype, device=x.device)
    res = residual.reshape(n) if residual is not None else y
    pro = PRO_SILU if silu else PRO_RMSNORM if norm is not None else PRO_NONE
    grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
    _gemv[grid](x1, w, bias if bias is not None else w, norm if norm is not None else w, res, y, n, k, eps,
                PRO=pro, RES=residual is not None, HAS_BIAS=bias is not None)
    return y.view(*lead, n)
