"""Attention over a paged KV cache in Triton: decode, verify and prefill rows in one kernel.

Each program takes BLOCK_M query rows of one sequence and one KV head: with grouped-query
attention the G query heads that share a KV head are packed as rows (row m = token m // G,
head m % G), so a KV block read from memory serves all of them. Keys are found through the
sequence's block table (`tables[row, pos // block_size]`), and a query token t sees keys
0 .. cache_len + t. Long contexts split their keys over SPLITS programs (flash-decoding);
a second kernel merges the partial results by their log-sum-exp. An fp8 (e4m3) cache is
dequantized on load with its per-layer scales. `write_kv` puts a step's new keys and values
into their blocks in one kernel per layer, finding each slot through the block table itself
(index_put through precomputed slots took eight kernels a layer: a small draft model's pass
is mostly kernel launches).

Runs on CUDA, and on CPU through Triton's interpreter (the tests compare it with SDPA).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@triton.jit
def _attend(Q, K, V, Out, Tables, Rows, CacheLens, QLens, PartO, PartL,
            sm_scale, k_scale, v_scale,
            s_qb, s_qt, s_qh, s_kb, s_ks, s_kh, s_ob, s_ot, s_oh, s_tr,
            s_pb, s_ph, s_ps, s_pm, s_lb, s_lh, s_ls,
            HKV: tl.constexpr, G: tl.constexpr, BS: tl.constexpr, D: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr, FP8: tl.constexpr):
    pid_m, pid_bh, pid_s = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    b, hkv = pid_bh // HKV, pid_bh % HKV
    row = tl.load(Rows + b)
    cache_len = tl.load(CacheLens + b).to(tl.int32)
    q_len = tl.load(QLens + b).to(tl.int32)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    t = offs_m // G
    head = hkv * G + offs_m % G
    m_ok = t < q_len
    offs_d = tl.arange(0, D)
    q = tl.load(Q + b * s_qb + t[:, None] * s_qt + head[:, None] * s_qh + offs_d[None, :],
                mask=m_ok[:, None], other=0.0)
    # keys this tile can see (causal), and this split's share of them, in whole BLOCK_Ns
    last_t = tl.minimum(pid_m * BLOCK_M + BLOCK_M - 1, q_len * G - 1) // G
    hi = cache_len + last_t + 1
    chunk = tl.cdiv(tl.cdiv(cache_len + q_len, SPLITS), BLOCK_N) * BLOCK_N
    lo = pid_s * chunk
    hi = tl.minimum(hi, lo + chunk)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    table = Tables + row * s_tr
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hi
        blk = tl.load(table + offs_n // BS, mask=n_ok, other=0).to(tl.int64)
        at = blk * s_kb + (offs_n % BS) * s_ks + hkv * s_kh
        k = tl.load(K + at[:, None] + offs_d[None, :], mask=n_ok[:, None], other=0.0)
        v = tl.load(V + at[:, None] + offs_d[None, :], mask=n_ok[:, None], other=0.0)
        if FP8:
            k = (k.to(tl.float32) * k_scale).to(q.dtype)
            v = (v.to(tl.float32) * v_scale).to(q.dtype)
        qk = tl.dot(q, tl.trans(k)) * sm_scale
        seen = (offs_n[None, :] <= cache_len + t[:, None]) & n_ok[None, :]
        qk = tl.where(seen, qk, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(qk, 1))
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that saw nothing yet
        p = tl.exp(qk - m_ref[:, None])
        alpha = tl.exp(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    l_safe = tl.where(l_i > 0, l_i, 1.0)
    out = acc / l_safe[:, None]
    if SPLITS == 1:
        tl.store(Out + b * s_ob + t[:, None] * s_ot + head[:, None] * s_oh + offs_d[None, :],
                 out.to(Out.dtype.element_ty), mask=m_ok[:, None])
    else:
        lse = tl.where(l_i > 0, m_i + tl.log(l_safe), float("-inf"))
        tl.store(PartO + b * s_pb + hkv * s_ph + pid_s * s_ps + offs_m[:, None] * s_pm + offs_d[None, :], out,
                 mask=m_ok[:, None])
        tl.store(PartL + b * s_lb + hkv * s_lh + pid_s * s_ls + offs_m, lse, mask=m_ok)


@triton.jit
def _merge(Out, PartO, PartL, QLens, s_ob, s_ot, s_oh, s_pb, s_ph, s_ps, s_pm, s_lb, s_lh, s_ls,
           HKV: tl.constexpr, G: tl.constexpr, D: tl.constexpr, BLOCK_M: tl.constexpr, SPLITS: tl.constexpr):
    pid_m, pid_bh = tl.program_id(0), tl.program_id(1)
    b, hkv = pid_bh // HKV, pid_bh % HKV
    q_len = tl.load(QLens + b).to(tl.int32)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m // G < q_len
    offs_d = tl.arange(0, D)
    lse_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    for s in range(SPLITS):
        lse = tl.load(PartL + b * s_lb + hkv * s_lh + s * s_ls + offs_m, mask=m_ok, other=float("-inf"))
        lse_max = tl.maximum(lse_max, lse)
    ref = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    total = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    for s in range(SPLITS):
        lse = tl.load(PartL + b * s_lb + hkv * s_lh + s * s_ls + offs_m, mask=m_ok, other=float("-inf"))
        w = tl.exp(lse - ref)
        part = tl.load(PartO + b * s_pb + hkv * s_ph + s * s_ps + offs_m[:, None] * s_pm + offs_d[None, :],
                       mask=m_ok[:, None], other=0.0)
        acc += w[:, None] * part
        total += w
    out = acc / tl.where(total > 0, total, 1.0)[:, None]
    t, head = offs_m // G, hkv * G + offs_m % G
    tl.store(Out + b * s_ob + t[:, None] * s_ot + head[:, None] * s_oh + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=m_ok[:, None])


@triton.jit
def _write(K, V, KC, VC, Tables, Rows, CacheLens, QLens, k_scale, v_scale,
           s_kb, s_kt, s_kh, s_vb, s_vt, s_vh, s_cb, s_cs, s_tr, max_blocks,
           T: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BS: tl.constexpr, FP8: tl.constexpr):
    pid = tl.program_id(0)
    b, t = pid // T, pid % T
    if t < tl.load(QLens + b):
        pos = tl.load(CacheLens + b) + t
        # a padded graph row may run past its table's width: the last entry (scratch) takes it
        col = tl.minimum(pos // BS, max_blocks - 1)
        blk = tl.load(Tables + tl.load(Rows + b) * s_tr + col).to(tl.int64)
        offs = tl.arange(0, HKV * D)
        head, d = offs // D, offs % D
        dst = blk * s_cb + (pos % BS) * s_cs + offs
        k = tl.load(K + b * s_kb + t * s_kt + head * s_kh + d)
        v = tl.load(V + b * s_vb + t * s_vt + head * s_vh + d)
        if FP8:  # e4m3, saturating at +-448 as cluster.engine.worker.fp8.quantize
            k = tl.clamp(k.to(tl.float32) / k_scale, -448.0, 448.0)
            v = tl.clamp(v.to(tl.float32) / v_scale, -448.0, 448.0)
        tl.store(KC + dst, k.to(KC.dtype.element_ty))
        tl.store(VC + dst, v.to(VC.dtype.element_ty))


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
             rows: torch.Tensor, cache_lens: torch.Tensor, q_lens: torch.Tensor,
             kv_scales: tuple[float, float] | None = None) -> None:
    """k, v [B, T, Hkv, D] (each with D contiguous): row b's first q_lens[b] tokens go to positions
    cache_lens[b] .. of table row rows[b] of one layer's caches [blocks, block_size, Hkv, D]."""
    B, T, HKV, D = k.shape
    assert k.stride(3) == v.stride(3) == 1 and k_cache.is_contiguous()
    fp8 = kv_scales is not None
    k_scale, v_scale = kv_scales if fp8 else (1.0, 1.0)
    _write[(B * T,)](k, v, k_cache, v_cache, tables, rows, cache_lens, q_lens, k_scale, v_scale,
                     *k.stride()[:3], *v.stride()[:3], k_cache.stride(0), k_cache.stride(1), tables.stride(0),
                     tables.shape[1], T=T, HKV=HKV, D=D, BS=k_cache.shape[1], FP8=fp8, num_warps=1)


# (BLOCK_N, warps, stages): the fastest of a sweep on an H100 at 8B shapes, 8k context, batch 64
# (benchmarks/gpu/h100/paged_attn): 128-key blocks for verify and prefill rows, 64 for one token
CONFIG, CONFIG_ONE_TOKEN = (128, 4, 2), (64, 4, 2)


@functools.lru_cache(maxsize=8)
def _multiprocessors(device: int) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def num_splits(batch: int, kv_heads: int, m_tiles: int, max_kv: int, sms: int | None = None) -> int:
    """Enough programs to fill the GPU twice over, each with at least 256 keys to read
    (`sms`: the GPU's multiprocessors; by default the current device's)."""
    if sms is None:
        sms = _multiprocessors(torch.cuda.current_device()) if torch.cuda.is_available() else 132
    programs = batch * kv_heads * m_tiles
    return max(1, min(16, (2 * sms) // max(programs, 1), max_kv // 256))


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
                    rows: torch.Tensor, cache_lens: torch.Tensor, q_lens: torch.Tensor, splits: int,
                    kv_scales: tuple[float, float] | None = None, out: torch.Tensor | None = None,
                    config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """q [B, T, H, D]; caches [blocks, block_size, Hkv, D] (one layer); tables [R, max_blocks]
    int32; rows, cache_lens, q_lens [B]. The keys of this step's tokens must already be in
    the cache. `kv_scales`: the layer's (k, v) scales of an e4m3 cache, as numbers (constants
    of a captured CUDA graph). `config`: (BLOCK_N, warps, stages[, BLOCK_M]) instead of the
    defaults (scripts/gpu_paged_attn.py sweeps them).
    Returns [B, T, H, D] in q's dtype (rows past q_lens[b] are left as they were)."""
    B, T, H, D = q.shape
    _, BS, HKV, _ = k_cache.shape
    G = H // HKV
    out = torch.empty_like(q) if out is None else out
    M = T * G
    BLOCK_M = max(16, min(64, triton.next_power_of_2(M)))
    BLOCK_N, warps, stages, *m = config or (CONFIG if BLOCK_M > 16 else CONFIG_ONE_TOKEN)
    BLOCK_M = m[0] if m else BLOCK_M
    m_tiles = triton.cdiv(M, BLOCK_M)
    fp8 = kv_scales is not None
    k_scale, v_scale = kv_scales if fp8 else (1.0, 1.0)
    if splits > 1:
        part_o = torch.empty((B, HKV, splits, M, D), dtype=torch.float32, device=q.device)
        part_l = torch.empty((B, HKV, splits, M), dtype=torch.float32, device=q.device)
    else:
        part_o = part_l = out  # unused
    po = part_o.stride() if splits > 1 else (0, 0, 0, 0, 0)
    pl = part_l.stride() if splits > 1 else (0, 0, 0, 0)
    _attend[(m_tiles, B * HKV, splits)](
        q, k_cache, v_cache, out, tables, rows, cache_lens, q_lens, part_o, part_l,
        D ** -0.5, k_scale, v_scale,
        q.stride(0), q.stride(1), q.stride(2), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        out.stride(0), out.stride(1), out.stride(2), tables.stride(0),
        po[0], po[1], po[2], po[3], pl[0], pl[1], pl[2],
        HKV=HKV, G=G, BS=BS, D=D, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, SPLITS=splits, FP8=fp8,
        num_warps=warps, num_stages=stages)
    if splits > 1:
        _merge[(m_tiles, B * HKV)](
            out, part_o, part_l, q_lens, out.stride(0), out.stride(1), out.stride(2),
            po[0], po[1], po[2], po[3], pl[0], pl[1], pl[2],
            HKV=HKV, G=G, D=D, BLOCK_M=BLOCK_M, SPLITS=splits, num_warps=4)
    return out
