"""Attention backends behind one small interface, over the paged KV cache.

The runner fills one `AttnContext` per step; every attention layer calls
`backend(q, k, v, k_cache, v_cache, ctx, scale)` with that layer's cache
(`[blocks + 1, block_size, kv_heads, head_dim]`, see cluster.engine.scheduling.kv_cache). A step writes
its new keys/values at positions `cache_len .. cache_len + q_len` of each row (through the
row's block table) and attends causally over everything before. Prefill, decode and
multi-token verify are the same call with different q lengths.

`BACKENDS` is the one list of them (config validation reads it):
- `sdpa`: PyTorch's scaled_dot_product_attention over keys gathered through the block
  tables; any device, arbitrary masks (draft trees).
- `triton`: cluster.engine.worker.paged_attention, reading the block tables itself; CUDA graphs.
- `fa3`: FlashAttention-3's own paged interface (`page_table=`), where the installed FA3 build
  has paged KV (the fa3-fwd 0.0.3 wheel does not; it is probed at start).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from cluster.engine.sampling import device_values
from cluster.engine.scheduling.kv_cache import slot_index
from cluster.engine.worker import fp8

log = logging.getLogger(__name__)


def device_ints(xs: list[int], device) -> torch.Tensor:
    """int64 tensor on `device` without waiting for the GPU (sampling.device_values)."""
    return device_values(xs, torch.int64, device)


@dataclass
class AttnContext:
    rows: torch.Tensor        # [B] int64 block-table row of each sequence
    cache_lens: torch.Tensor  # [B] int64 tokens already cached before this step
    q_lens: torch.Tensor      # [B] int64 real (unpadded) new tokens per row
    positions: torch.Tensor   # [B, T] absolute position of every (padded) new token
    width: int                # T, padded new tokens per row
    max_kv: int               # max over rows of cache_len + T (an upper bound in CUDA graphs)
    write_src: torch.Tensor | None  # [N] flat index (b * T + t) of the real new tokens; None: all
    tables: torch.Tensor      # the cache's [rows, max_blocks] int32 block tables
    splits: int = 1           # key splits per row for the triton kernel (flash-decoding)
    sdpa_mask: torch.Tensor | None = None  # [B, 1, T, max_kv], built once per step
    tree_mask: torch.Tensor | None = None  # [B, T, T] bool: new token t sees new token j (tree verify)
    page_table: torch.Tensor | None = None  # [B, max_blocks] for FA3, gathered once per step
    lens_i32: torch.Tensor | None = None
    slots: torch.Tensor | None = None  # [B * T] flat cache index of every new token (sdpa's writes)

    @classmethod
    def build(cls, kv, rows: list[int], cache_lens: list[int], q_lens: list[int], device) -> "AttnContext":
        width = max(q_lens)
        t = lambda xs: device_ints(xs, device)  # noqa: E731  (a pageable copy would wait for the step queued before)
        rows_t, lens_t, q_t = t(rows), t(cache_lens), t(q_lens)
        pos = lens_t[:, None] + torch.arange(width, device=device)
        src = None
        if any(n < width for n in q_lens):  # index lists from the host: no sync in the layers
            src = t([b * width + i for b, n in enumerate(q_lens) for i in range(n)])
        max_kv = max(cache_lens) + width
        return cls(rows_t, lens_t, q_t, pos, width, max_kv, src, kv.tables)


@dataclass
class Segment:
    """One padded block [B, T] of a segmented pass (cluster.engine.worker.runner.Runner.forward_mixed):
    its real tokens are `start .. stop` of the pass's flat token list, and `ctx.write_src`
    (None: no padding) places them in the block."""
    ctx: AttnContext
    start: int
    stop: int

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """This segment's rows of x [N, ...] as [B, T, ...], zeros at padded positions."""
        ctx, x = self.ctx, x[self.start:self.stop]
        shape = (len(ctx.q_lens), ctx.width, *x.shape[1:])
        if ctx.write_src is None:
            return x.reshape(shape)
        return x.new_zeros((shape[0] * shape[1], *shape[2:])).index_copy_(0, ctx.write_src, x).view(shape)

    def unpad(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, ...] back to the real tokens' rows [n, ...]."""
        x = x.reshape(-1, *x.shape[2:])
        return x if self.ctx.write_src is None else x[self.ctx.write_src]


def write_kv(k, v, k_cache, v_cache, ctx: AttnContext, scale=None) -> None:
    """Scatter the step's new keys/values into their blocks (e4m3 with `scale`)."""
    if ctx.slots is None:  # once per step, shared by all layers; flat positions (a tree's are by depth)
        flat = ctx.cache_lens[:, None] + torch.arange(ctx.width, device=ctx.rows.device)
        ctx.slots = slot_index(ctx.tables, ctx.rows, flat, k_cache.shape[1]).flatten()
    for new, cache, j in ((k, k_cache, 1), (v, v_cache, 2)):
        rows = new.flatten(0, 1)
        slots = ctx.slots
        if ctx.write_src is not None:
            rows, slots = rows[ctx.write_src], slots[ctx.write_src]
        cache.view(-1, *cache.shape[2:])[slots] = rows.to(cache.dtype) if scale is None else fp8.quantize(rows, scale[j])


def gather_kv(cache: torch.Tensor, ctx: AttnContext) -> torch.Tensor:
    """[B, max_kv, Hkv, D]: each row's positions 0 .. max_kv-1 through its block table."""
    pos = torch.arange(ctx.max_kv, device=cache.device)[None, :].expand(len(ctx.rows), -1)
    return cache.view(-1, *cache.shape[2:])[slot_index(ctx.tables, ctx.rows, pos, cache.shape[1])]


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
    """PyTorch scaled_dot_product_attention over keys gathered through the block tables."""

    name = "sdpa"
    supports_tree = True  # arbitrary masks: a draft tree verifies in one row
    graphs = False        # gathers by a host-side length

    def __call__(self, q, k, v, k_cache, v_cache, ctx: AttnContext, scale=None) -> torch.Tensor:
        # q: [B, T, H, D]; k, v: [B, T, Hkv, D]
        write_kv(k, v, k_cache, v_cache, ctx, scale)
        keys = gather_kv(k_cache, ctx).transpose(1, 2).to(q.dtype)    # [B, Hkv, L, D]
        vals = gather_kv(v_cache, ctx).transpose(1, 2).to(q.dtype)
        if scale is not None:  # e4m3 cache: dequantize for a full-precision query
            keys, vals = keys * scale[1].to(q.dtype), vals * scale[2].to(q.dtype)
        if ctx.sdpa_mask is None:  # causal over each row's own prefix, shared by all layers
            ctx.sdpa_mask = sdpa_mask(ctx, q.device)
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys, vals,
            attn_mask=ctx.sdpa_mask, enable_gqa=q.shape[2] != k.shape[2],
        )
        return out.transpose(1, 2)                                 # [B, T, H, D]


class TritonBackend:
    """cluster.engine.worker.paged_attention: reads the block tables and lengths from tensors, so a
    step replays as a CUDA graph."""

    name = "triton"
    supports_tree = False  # causal only: tree drafters propose a single path here
    graphs = True

    def __init__(self):
        from cluster.engine.worker import paged_attention

        self.kernel, self.write = paged_attention.paged_attention, paged_attention.write_kv

    def __call__(self, q, k, v, k_cache, v_cache, ctx: AttnContext, scale=None) -> torch.Tensor:
        assert ctx.tree_mask is None, "the triton backend has no arbitrary masks"
        # the scales live on the host: numbers here, constants of a captured graph
        kv_scales = None if scale is None else (float(scale[1]), float(scale[2]))
        self.write(k, v, k_cache, v_cache, ctx.tables, ctx.rows, ctx.cache_lens, ctx.q_lens, kv_scales)
        return self.kernel(q, k_cache, v_cache, ctx.tables, ctx.rows, ctx.cache_lens, ctx.q_lens, ctx.splits,
                           kv_scales)


class Fa3Backend:
    """FlashAttention-3's paged KV interface: the kernel appends the step's keys/values
    through the page table itself, then attends with bottom-right causal alignment."""

    name = "fa3"
    supports_tree = False
    graphs = True

    def __init__(self, fn):
        self.fn = fn

    def __call__(self, q, k, v, k_cache, v_cache, ctx: AttnContext, scale=None) -> torch.Tensor:
        assert ctx.tree_mask is None, "fa3 has no arbitrary masks"
        assert scale is None, "fp8 KV on the fa3 paged backend is not wired; use attention: triton"
        if ctx.page_table is None:
            ctx.lens_i32, ctx.page_table = ctx.cache_lens.to(torch.int32), ctx.tables[ctx.rows]
        out = self.fn(q, k_cache, v_cache, k=k, v=v, cache_seqlens=ctx.lens_i32, page_table=ctx.page_table,
                      causal=True)
        return out[0] if isinstance(out, tuple) else out


def _load_fa3():
    for module in ("flash_attn_interface", "fa3_fwd_interface"):
        try:
            return module, __import__(module).flash_attn_with_kvcache
        except (ImportError, AttributeError):
            continue
    return None, None


def _fa3_has_paged_kv(fn, device) -> bool:
    """The fa3-fwd wheel is built without paged KV and says so when given a page table."""
    q = torch.zeros((1, 1, 8, 128), dtype=torch.bfloat16, device=device)
    cache = torch.zeros((2, 16, 8, 128), dtype=torch.bfloat16, device=device)
    try:
        fn(q, cache, cache, cache_seqlens=torch.ones(1, dtype=torch.int32, device=device),
           page_table=torch.zeros((1, 1), dtype=torch.int32, device=device), causal=True)
        return True
    except Exception as e:  # noqa: BLE001 - whatever the build says, it cannot page
        log.info("fa3 without paged KV (%s)", (str(e).splitlines() or [type(e).__name__])[0])
        return False


BACKENDS = ("auto", "sdpa", "triton", "fa3")


def make_backend(name: str, device: torch.device, dtype: torch.dtype):
    """`auto`: FA3's paged interface on Hopper when the installed build has it, else the
    triton kernel on CUDA, else sdpa."""
    if name not in BACKENDS:
        raise ValueError(f"attention backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    cuda = device.type == "cuda"
    half = dtype in (torch.bfloat16, torch.float16)
    if name in ("auto", "fa3") and cuda and half and torch.cuda.get_device_capability(device)[0] == 9:
        module, fn = _load_fa3()
        if fn is not None and _fa3_has_paged_kv(fn, device):
            log.info("attention backend: fa3 (%s, paged)", module)
            return Fa3Backend(fn)
    if name == "fa3":
        raise RuntimeError("attention backend fa3 needs a Hopper GPU, bf16/fp16 and a FlashAttention-3 build "
                           "with paged KV (flash_attn_interface); attention: triton runs everywhere on CUDA")
    if name == "triton" or (name == "auto" and cuda):
        log.info("attention backend: triton (paged)")
        return TritonBackend()
    log.info("attention backend: sdpa on %s", device)
    return SdpaBackend()
