"""Attention backends behind one small interface.

The runner fills one `AttnContext` per step; every attention layer calls
`backend(q, k, v, k_cache, v_cache, ctx)`. KV lives in per-sequence slots
(`[num_slots, capacity, kv_heads, head_dim]`) because the fa3-fwd wheel has no paged KV:
a step writes its new keys/values at `cache_len .. cache_len + q_len` of each slot and
attends causally over the slot's prefix. Prefill, decode and multi-token verify are the
same call with different q lengths.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from cluster.engine import fp8

log = logging.getLogger(__name__)


@dataclass
class AttnContext:
    slots: torch.Tensor       # [B] int64 slot of each row
    cache_lens: torch.Tensor  # [B] int64 tokens already cached before this step
    q_lens: torch.Tensor      # [B] int64 real (unpadded) new tokens per row
    positions: torch.Tensor   # [B, T] absolute position of every (padded) new token
    valid: torch.Tensor       # [B, T] bool, False on padding
    width: int                # T, padded new tokens per row
    max_kv: int               # max over rows of cache_len + T
    write_src: torch.Tensor   # [N] flat index (b * T + t) of each real new token
    write_rows: torch.Tensor  # [N] its slot
    write_cols: torch.Tensor  # [N] its position in the slot
    slots_i32: torch.Tensor | None = None      # [B] int32 copies for FA3, made once per step
    cache_lens_i32: torch.Tensor | None = None  # (not once per layer)
    sdpa_mask: torch.Tensor | None = None  # [B, 1, T, max_kv], built once per step
    tree_mask: torch.Tensor | None = None  # [B, T, T] bool: new token t sees new token j (tree verify)
    fa3_meta: torch.Tensor | None = None   # FA3 scheduler metadata (splits per row), once per step

    @classmethod
    def build(cls, slots: list[int], cache_lens: list[int], q_lens: list[int], device) -> "AttnContext":
        width = max(q_lens)
        t = lambda xs: torch.tensor(xs, dtype=torch.int64, device=device)  # noqa: E731
        slots_t, lens_t, q_t = t(slots), t(cache_lens), t(q_lens)
        ar = torch.arange(width, device=device)
        # scatter indices from host lists: no device->host sync inside the layers
        src = [b * width + i for b, n in enumerate(q_lens) for i in range(n)]
        rows = [s for s, n in zip(slots, q_lens) for _ in range(n)]
        cols = [c + i for c, n in zip(cache_lens, q_lens) for i in range(n)]
        return cls(slots_t, lens_t, q_t, lens_t[:, None] + ar, ar[None, :] < q_t[:, None],
                   width, max(c + width for c in cache_lens), t(src), t(rows), t(cols),
                   slots_t.to(torch.int32), lens_t.to(torch.int32))


def write_kv(k, v, k_cache, v_cache, ctx: AttnContext, scale=None) -> None:
    """Scatter the real (unpadded) new keys/values into their slots (e4m3 with `scale`)."""
    for new, cache, j in ((k, k_cache, 1), (v, v_cache, 2)):
        rows = new.flatten(0, 1)[ctx.write_src]
        cache[ctx.write_rows, ctx.write_cols] = (rows.to(cache.dtype) if scale is None
                                                 else fp8.quantize(rows, scale[j, 0, 0]))


def sdpa_mask(ctx: AttnContext, device) -> torch.Tensor:
    """[B, 1, T, max_kv] bool. Causal by position, or, with a tree mask, the cached prefix
    plus the new tokens the tree lets each one see (its ancestors and itself): tree nodes
    share positions (cache_len + depth), so position alone cannot tell branches apart."""
    kv_pos = torch.arange(ctx.max_kv, device=device)
    if ctx.tree_mask is None:
        return (kv_pos[None, None, :] <= ctx.positions[:, :, None])[:, None]
    rel = kv_pos[None, :] - ctx.cache_lens[:, None]                       # [B, L] index among new tokens
    new = (rel >= 0) & (rel < ctx.width)
    idx = rel.clamp(0, ctx.width - 1)[:, None, :].expand(-1, ctx.width, -1)
    seen = ctx.tree_mask.gather(2, idx) & new[:, None, :]                  # [B, T, L]
    return (seen | (rel < 0)[:, None, :])[:, None]


class SdpaBackend:
    """PyTorch scaled_dot_product_attention over the gathered slot prefix (CPU, any GPU)."""

    name = "sdpa"
    supports_tree = True  # arbitrary masks: a draft tree verifies in one row

    def __call__(self, q, k, v, k_cache, v_cache, ctx: AttnContext, scale=None) -> torch.Tensor:
        # q: [B, T, H, D]; k, v: [B, T, Hkv, D]; caches: [S, cap, Hkv, D]
        write_kv(k, v, k_cache, v_cache, ctx, scale)
        keys = k_cache[ctx.slots, : ctx.max_kv].transpose(1, 2).to(q.dtype)    # [B, Hkv, L, D]
        vals = v_cache[ctx.slots, : ctx.max_kv].transpose(1, 2).to(q.dtype)
        if scale is not None:  # e4m3 cache: dequantize for a full-precision query
            keys, vals = keys * scale[1, 0, 0].to(q.dtype), vals * scale[2, 0, 0].to(q.dtype)
        if ctx.sdpa_mask is None:  # causal over each row's own prefix, shared by all layers
            ctx.sdpa_mask = sdpa_mask(ctx, q.device)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys, vals,
            attn_mask=ctx.sdpa_mask, enable_gqa=q.shape[2] != k.shape[2],
        )
        return out.transpose(1, 2)                                 # [B, T, H, D]


class Fa3Backend:
    """FlashAttention-3 forward (Hopper; bf16, or e4m3 over an fp8 cache) with `cache_batch_idx` over slots.

    The kernel appends each row's T new keys/values at `cache_len` itself (one kernel, not
    a scatter per layer), then attends over `cache_len + T` keys with bottom-right causal
    alignment, so a real query t sees exactly keys 0..cache_len+t. A row shorter than T
    (padding) writes a few keys past its length, which no query reads before the row's next
    step overwrites them; slots keep `T` spare positions past max_model_len for this (see
    KVCache.capacity), and padded rows' outputs are dropped.
    """

    name = "fa3"
    supports_tree = False  # causal only: tree drafters propose a single path here

    def __init__(self, fn, meta_fn=None):
        self.fn, self.meta_fn = fn, meta_fn

    def __call__(self, q, k, v, k_cache, v_cache, ctx: AttnContext, scale=None) -> torch.Tensor:
        assert ctx.tree_mask is None, "fa3 has no arbitrary masks"
        descale = {}
        if scale is not None:  # e4m3 cache: q, k, v all in e4m3, the scales as FA3's descales
            q, k, v = fp8.KERNELS["quantize_qkv"](q, k, v, scale)
            b = q.shape[0]
            descale = dict(q_descale=scale[0, :b], k_descale=scale[1, :b], v_descale=scale[2, :b])
        if ctx.fa3_meta is None and self.meta_fn is not None:
            # How to split each row's keys, computed once for all layers instead of a
            # prepare kernel per layer: 14.7 -> 13.2 us per decode layer on an H100
            # (benchmarks/gpu/h100/gpu_attn_tune.json). Its arguments mirror the call below.
            b, t, h, d = q.shape
            ctx.fa3_meta = self.meta_fn(b, t, k_cache.shape[1], h, k_cache.shape[2], d, ctx.cache_lens_i32,
                                        q.dtype, max_seqlen_k_new=t, causal=True)
        out = self.fn(q, k_cache, v_cache, k=k, v=v, cache_seqlens=ctx.cache_lens_i32,
                      cache_batch_idx=ctx.slots_i32, causal=True, scheduler_metadata=ctx.fa3_meta, **descale)
        return out[0] if isinstance(out, tuple) else out


def _load_fa3():
    for module in ("flash_attn_interface", "fa3_fwd_interface"):
        try:
            mod = __import__(module)
            return module, mod.flash_attn_with_kvcache, getattr(mod, "get_scheduler_metadata", None)
        except (ImportError, AttributeError):
            continue
    return None, None, None


def make_backend(name: str, device: torch.device, dtype: torch.dtype):
    """`auto` picks fa3 on Hopper with bf16 when a FA3 build imports, else sdpa."""
    if name not in ("auto", "fa3", "sdpa"):
        raise ValueError(f"attention backend must be auto, fa3 or sdpa, got {name!r}")
    if name in ("auto", "fa3"):
        hopper = device.type == "cuda" and torch.cuda.get_device_capability(device)[0] == 9
        module, fn, meta_fn = _load_fa3() if hopper else (None, None, None)
        if fn is not None and dtype in (torch.bfloat16, torch.float16):
            log.info("attention backend: fa3 (%s)", module)
            return Fa3Backend(fn, meta_fn)
        if name == "fa3":
            raise RuntimeError("attention backend fa3 needs a Hopper GPU, bf16/fp16 and "
                               "flash_attn_interface or fa3_fwd_interface (pip install 'spec-cluster[hopper]')")
    log.info("attention backend: sdpa on %s", device)
    return SdpaBackend()
