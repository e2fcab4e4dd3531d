"""Rotary embedding of q and k, and SiLU(gate) * up, as Triton kernels for passes of more token
rows than cluster.engine.worker.gemv fuses into its projections (prefill chunks, wide batches).

torch.compile's kernels for both ran at several times their bytes' time at prefill sizes: with
dynamic shapes each element's head and column come from run-time divisions, and rotary's output
was copied again to make q contiguous (benchmarks/gpu/h100/prefill). Here a program takes one
token row (rotary: all of its q and k heads) or a block of one row's columns (SiLU), so indices
are a row offset plus a range, and rotary writes q and k straight into their own tensors.
Liger Kernel has both for training, but its SwiGLU takes gate and up as two tensors of one
stride (the fused gate_up projection here would be copied apart first) and its rotary rotates
in place.

Rounding follows the eager reference (cluster.engine.worker.model.rope and silu_mul): rotary in
fp32 with one cast; SiLU cast, times up, cast, as gemv's prologue does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rope(QKV, Q, K, Cos, Sin, s_row, s_cos,
          HQ: tl.constexpr, HK: tl.constexpr, PQ: tl.constexpr, PK: tl.constexpr, HALF: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, HALF)[None, :]
    cos = tl.load(Cos + r * s_cos + d)
    sin = tl.load(Sin + r * s_cos + d)
    # q heads, then k heads (HQ onwards in the row)
    h = tl.arange(0, PQ)[:, None]
    ok = h < HQ
    src = QKV + r * s_row + h * (2 * HALF) + d
    x1 = tl.load(src, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=ok, other=0.0).to(tl.float32)
    dst = Q + r * (HQ * 2 * HALF) + h * (2 * HALF) + d
    tl.store(dst, (x1 * cos - x2 * sin).to(Q.dtype.element_ty), mask=ok)
    tl.store(dst + HALF, (x2 * cos + x1 * sin).to(Q.dtype.element_ty), mask=ok)
    h = tl.arange(0, PK)[:, None]
    ok = h < HK
    src = QKV + r * s_row + (HQ + h) * (2 * HALF) + d
    x1 = tl.load(src, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF, mask=ok, other=0.0).to(tl.float32)
    dst = K + r * (HK * 2 * HALF) + h * (2 * HALF) + d
    tl.store(dst, (x1 * cos - x2 * sin).to(K.dtype.element_ty), mask=ok)
    tl.store(dst + HALF, (x2 * cos + x1 * sin).to(K.dtype.element_ty), mask=ok)


def rope_qk(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """As cluster.engine.worker.model.rope_qk: qkv [..., heads + 2 kv_heads, D] contiguous,
    cos and sin [..., 1, D/2] fp32, one row per token row of qkv. Returns (q [..., heads, D],
    k [..., kv_heads, D]), new contiguous tensors."""
    *lead, width, D = qkv.shape
    assert width == heads + 2 * kv_heads and qkv.is_contiguous()
    rows = qkv.numel() // (width * D)
    cos, sin = cos.reshape(rows, D // 2), sin.reshape(rows, D // 2)
    q = qkv.new_empty((*lead, heads, D))
    k = qkv.new_empty((*lead, kv_heads, D))
    if rows:
        _rope[(rows,)](qkv, q, k, cos, sin, width * D, cos.stride(0),
                       HQ=heads, HK=kv_heads, PQ=triton.next_power_of_2(heads),
                       PK=triton.next_power_of_2(kv_heads), HALF=D // 2, num_warps=4)
    return q, k


@triton.jit
def _silu_mul(X, Y, n, s_x, s_y, BLOCK: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = c < n
    g = tl.load(X + r * s_x + c, mask=ok, other=0.0).to(tl.float32)
    u = tl.load(X + r * s_x + n + c, mask=ok, other=0.0)
    s = (g * tl.sigmoid(g)).to(u.dtype)
    tl.store(Y + r * s_y + c, (s.to(tl.float32) * u.to(tl.float32)).to(Y.dtype.element_ty), mask=ok)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """As cluster.engine.worker.model.silu_mul: [..., 2n] (gate, then up; rows contiguous) -> [..., n]."""
    *lead, n2 = gate_up.shape
    n = n2 // 2
    x = gate_up.reshape(-1, n2)
    assert x.stride(-1) == 1
    y = gate_up.new_empty((x.shape[0], n))
    if x.shape[0]:
        block = min(1024, triton.next_power_of_2(n))
        _silu_mul[(x.shape[0], triton.cdiv(n, block))](x, y, n, x.stride(0), y.stride(0), BLOCK=block, num_warps=4)
    return y.view(*lead, n)
