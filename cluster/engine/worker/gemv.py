"""Token-row projections as Triton kernels that stream each weight once, with the layer's
neighbours fused in: _gemv for one row (batch-1 decode), _gemm_rows for 2..16 rows (a
batch-1 verify of gamma drafts, small decode batches).

Why: at a few rows a step is weight bandwidth and little else, so what costs is the small
kernels between the weight streams. The kernels take the RMSNorm before a projection
(prologue), SiLU(gate) * up before down_proj (prologue) and the residual add after
(epilogue), so a layer is four weight streams and few small kernels in between (kernel
counts and step times against cuBLAS: benchmarks/gpu/h100, gpu_profile*.json and gemm_rows/).

Rounding follows the eager reference step by step (fp32 norm times weight, cast; SiLU cast,
times up, cast) up to the residual, which is added in fp32 before the output's one rounding,
as cuBLAS's addmm epilogue does on the wider steps: a verify pass then rounds as a decode
step does, so greedy speculation picks what plain decoding picks.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

PRO_NONE, PRO_RMSNORM, PRO_SILU = 0, 1, 2
# Rows a call may have: 1 row -> _gemv; 2..MAX_ROWS -> _gemm_rows (tensor cores, the weight tile
# as the MMA's wide operand: "swap AB"); more -> cuBLAS. GEMV_MAX_ROWS=1 keeps cuBLAS for every
# multi-row call (to compare the two in one run: scripts/gpu_gemm_rows.py).
MAX_ROWS = int(os.environ.get("GEMV_MAX_ROWS", "16"))
# Splits of K for 2..MAX_ROWS rows where K > 2N (the 8B down_proj): each split's partial sums
# go to an fp32 workspace, a second kernel adds them in order with bias and residual (faster
# than unsplit and than cuBLAS there: benchmarks/gpu/h100/split_k). 0: those stay on cuBLAS.
SPLIT_K = int(os.environ.get("GEMV_SPLIT_K", "4"))
_ONE = os.environ.get("GEMV_CONFIGS") == "one"  # the CPU interpreter test: no autotuning


def _configs():
    if _ONE:
        return [triton.Config({"BLOCK_N": 16, "BLOCK_K": 128}, num_warps=4, num_stages=2)]
    return [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=st)
            for bn in (4, 8, 16) for bk in (128, 256, 512, 1024) for w in (4, 8) for st in (2, 3)
            if bn * bk <= 8192]


def _bench(fn, quantiles=None):
    """Autotuning's timer, shorter than Triton's default (25 ms warm-up, 100 ms a config): a
    projection runs tens of microseconds, so 20 ms is hundreds of runs, and a cold start times
    44 configs for every weight shape and row count (benchmarks/gpu/smoke: start-up phases)."""
    return triton.testing.do_bench(fn, warmup=5, rep=20, quantiles=quantiles)


def _prune(configs, named_args, **kw):
    k = named_args.get("k_split", named_args["K"])  # the K range one program sums
    return [c for c in configs if k % c.kwargs["BLOCK_K"] == 0]


# cache_results: the tuning is kept in Triton's cache directory (engine.compile_cache_dir), so a
# replica that starts again skips it
@triton.autotune(configs=_configs(), key=["N", "K", "PRO", "RES", "HAS_BIAS"],
                 prune_configs_by={"early_config_prune": _prune}, do_bench=_bench, cache_results=True)
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


def _rows_configs():
    if _ONE:
        return [triton.Config({"BLOCK_N": 32, "BLOCK_K": 64}, num_warps=4, num_stages=2)]
    # The winners of a 60-config sweep on an H100 for every 8B projection at 2..16 rows
    # (scripts/gpu_gemm_rows.py); few, so start-up tuning stays short.
    return [triton.Config({"BLOCK_N": bn, "BLOCK_K": bk}, num_warps=w, num_stages=st)
            for bn, bk, w, st in ((128, 128, 8, 3), (128, 128, 8, 4), (128, 128, 8, 5), (64, 256, 4, 4),
                                  (64, 128, 4, 5), (64, 256, 8, 4), (32, 256, 4, 4), (16, 256, 4, 4))]


@triton.jit
def _gemm_rows_kernel(x_ptr, w_ptr, b_ptr, nw_ptr, rstd_ptr, res_ptr, y_ptr, part_ptr, M, N, K, k_split, stride_x,
                      stride_r, PRO: tl.constexpr, RES: tl.constexpr, HAS_BIAS: tl.constexpr,
                      SPLIT: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      BLOCK_M: tl.constexpr = 16):
    """_gemv for 2..16 rows (x: [M, K], or [M, 2K] for SiLU; y, res: [M, N]). The weight tile
    [BLOCK_N, BLOCK_K] is the MMA's first operand as it lies in memory (K contiguous), the
    few rows, padded to 16, the second: y^T = W x^T. Tensor cores do the FMAs, which for
    3+ rows on the CUDA cores bounded the kernel (the reverted _gemv_rows, commit 2d95708).
    SPLIT: program (i, j) sums K range j * k_split.. into part[j] (fp32), _split_sum finishes.
    PRO 1 reads each row's rstd from _rstd, run before: computed here, every program read all of
    x before its first weight load, and at a tensor-parallel rank's widths (a wave of programs
    or two) that wait was the kernel's gap to _gemv (70B shape at TP 4: qkv 26 us against 17,
    gate_up 92 against 80; benchmarks/gpu/tp/gemm_rows)."""
    rm = tl.arange(0, BLOCK_M)  # rows past M load as 0 (no memory traffic) and are not stored
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * k_split
    mmask = rm < M
    nmask = rn < N
    out_ty = y_ptr.dtype.element_ty
    if PRO == 1:  # each row's rstd, from _rstd
        rstd = tl.load(rstd_ptr + rm, mask=mmask, other=1.0)[:, None]
    acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)
    for kb in range(0, k_split // BLOCK_K):  # k_split % BLOCK_K == 0 (configs are pruned to fit)
        rk = k0 + kb * BLOCK_K + tl.arange(0, BLOCK_K)
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
            acc = tl.dot(w, tl.trans(xv), acc, input_precision="ieee")
        else:
            acc = tl.dot(w, tl.trans(xv), acc)
    out = tl.trans(acc)  # [BLOCK_M, BLOCK_N]
    ymask = mmask[:, None] & nmask[None, :]
    if SPLIT:
        tl.store(part_ptr + (tl.program_id(1) * M + rm[:, None]) * N + rn[None, :], out, mask=ymask)
    else:
        if HAS_BIAS:
            out += tl.load(b_ptr + rn, mask=nmask, other=0.0).to(tl.float32)[None, :]
        if RES:  # before the one rounding, as _gemv and cuBLAS's addmm
            out += tl.load(res_ptr + rm[:, None] * stride_r + rn[None, :], mask=ymask, other=0.0).to(tl.float32)
        tl.store(y_ptr + rm[:, None] * N + rn[None, :], out.to(out_ty), mask=ymask)


_gemm_rows = triton.autotune(configs=_rows_configs(), key=["N", "K", "k_split", "PRO", "RES", "HAS_BIAS"],
                             prune_configs_by={"early_config_prune": _prune}, do_bench=_bench,
                             cache_results=True)(_gemm_rows_kernel)


@triton.jit
def _rstd(x_ptr, out_ptr, K, stride_x, eps, BLOCK_K: tl.constexpr):
    """out[m] = rsqrt(mean(x[m]^2) + eps) in fp32: one program a row, for _gemm_rows's norm."""
    m = tl.program_id(0)
    ss = tl.zeros((BLOCK_K,), tl.float32)
    for kb in range(0, K // BLOCK_K):
        xv = tl.load(x_ptr + m * stride_x + kb * BLOCK_K + tl.arange(0, BLOCK_K)).to(tl.float32)
        ss += xv * xv
    tl.store(out_ptr + m, tl.rsqrt(tl.sum(ss, axis=0) / K + eps))


@triton.jit
def _split_sum(part_ptr, b_ptr, res_ptr, y_ptr, M, N, S, stride_r, RES: tl.constexpr, HAS_BIAS: tl.constexpr,
               BLOCK: tl.constexpr):
    """y = sum over splits of part[s] (in split order: deterministic) + bias + residual, in
    fp32, then the one rounding."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < M * N
    rm, rn = i // N, i % N
    out = tl.zeros((BLOCK,), tl.float32)
    for s in range(0, S):
        out += tl.load(part_ptr + s * M * N + i, mask=mask, other=0.0)
    if HAS_BIAS:
        out += tl.load(b_ptr + rn, mask=mask, other=0.0).to(tl.float32)
    if RES:
        out += tl.load(res_ptr + rm * stride_r + rn, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + i, out.to(y_ptr.dtype.element_ty), mask=mask)


def _splits(n: int, k: int) -> int:
    """K splits for a multi-row projection: SPLIT_K (halved until 128-aligned) where K > 2N."""
    s = SPLIT_K if k > 2 * n else 1
    while s > 1 and k % (s * 128):
        s //= 2
    return max(s, 1)


def supported(m: int, n: int, k: int) -> bool:
    """Whether fused_linear takes m rows of x @ w.T (w: [n, k]). One row: any K some BLOCK_K
    divides (the loop has no tail). More: also K <= 2N unless split (GEMV_SPLIT_K): a long K
    over few column tiles leaves SMs idle: the 8B down_proj (K 14336, N 4096) at 5 rows took
    0.079 ms unsplit against cuBLAS's 0.055 (its SiLU kernel included)."""
    return k % 128 == 0 and (m == 1 or (m <= MAX_ROWS and (k <= 2 * n or _splits(n, k) > 1)))


def _rows(t: torch.Tensor, m: int) -> torch.Tensor:
    t = t.reshape(m, -1)
    return t if t.stride(-1) == 1 else t.contiguous()


def fused_linear(x: torch.Tensor, w: torch.Tensor, bias=None, norm=None, eps: float = 0.0,
                 silu: bool = False, residual=None, config: dict | None = None) -> torch.Tensor:
    """y = [residual +] linear([rms_norm | silu_mul](x)) for up to MAX_ROWS token rows;
    x: [..., K or 2K], w: [N, K] (nn.Linear layout), contiguous. `config`: run _gemm_rows with
    these meta-parameters instead of the tuned ones (scripts/gpu_gemm_rows.py)."""
    lead = x.shape[:-1]
    n, k = w.shape
    m = x.numel() // x.shape[-1]
    assert 1 <= m <= max(1, MAX_ROWS) and k % 128 == 0 and w.is_contiguous()
    pro = PRO_SILU if silu else PRO_RMSNORM if norm is not None else PRO_NONE
    b, nw = bias if bias is not None else w, norm if norm is not None else w
    if m == 1:
        x1 = x.reshape(-1).contiguous()
        y = torch.empty((n,), dtype=x.dtype, device=x.device)
        res = residual.reshape(n) if residual is not None else y
        grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
        _gemv[grid](x1, w, b, nw, res, y, n, k, eps, PRO=pro, RES=residual is not None, HAS_BIAS=bias is not None)
        return y.view(*lead, n)
    x2 = _rows(x, m)
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    res = _rows(residual, m) if residual is not None else y
    s = _splits(n, k)
    part = torch.empty((s, m, n), dtype=torch.float32, device=x.device) if s > 1 else y
    rstd = w
    if pro == PRO_RMSNORM:
        rstd = torch.empty((m,), dtype=torch.float32, device=x.device)
        _rstd[(m,)](x2, rstd, k, x2.stride(0), eps, BLOCK_K=next(bk for bk in (1024, 512, 256, 128) if k % bk == 0))
    args = (x2, w, b, nw, rstd, res, y, part, m, n, k, k // s, x2.stride(0), res.stride(0))
    flags = dict(PRO=pro, RES=residual is not None, HAS_BIAS=bias is not None, SPLIT=s > 1)
    if config is None:
        _gemm_rows[lambda meta: (triton.cdiv(n, meta["BLOCK_N"]), s)](*args, **flags)
    else:
        _gemm_rows_kernel[(triton.cdiv(n, config["BLOCK_N"]), s)](*args, **flags, **config)
    if s > 1:
        _split_sum[(triton.cdiv(m * n, 1024),)](part, b, res, y, m, n, s, res.stride(0), RES=flags["RES"],
                                                HAS_BIAS=flags["HAS_BIAS"], BLOCK=1024)
    return y.view(*lead, n)
