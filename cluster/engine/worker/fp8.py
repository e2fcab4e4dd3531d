"""FP8 (e4m3) KV cache with per-tensor scales: `engine.kv_cache_dtype: fp8`.

Keys and values are stored as e4m3 with one fp32 scale per layer for keys and one for
values (x ~ x8 * scale), halving the cache's bytes: twice the tokens per GPU and half the
attention reads at long context. The attention backends store keys/values in e4m3 and dequantize
them on load for a full-precision query (the triton kernel as it reads each block).

The scales are calibrated once at start-up, like vLLM's `calculate_kv_scales`: one prefill
of a fixed text records each layer's absolute maxima of q, k and v, and a scale maps that
maximum to vLLM's constants (200 for q and k, 100 for v) of e4m3's 448, leaving headroom
for larger activations at serving time; anything past 448 saturates (clamped before the
cast, never NaN). Speculation stays lossless relative to the quantized target: draft and
verify read the same cache, so greedy speculative output equals greedy plain output with
the same fp8 cache. It is the target's cache only: a draft model keeps its own cache in its
weights' dtype (small, and its rounding only moves acceptance).

Under tensor parallelism every rank runs the calibration pass on its own heads (rank 0
announces it, cluster.engine.distributed.ranks) and the ranks take the maximum of their amaxes, so every
rank holds the same scales, those of the whole layer as one process computes them. vLLM's
`calc_kv_scales` takes each rank's amax of its own shard with no collective, so its ranks
quantize with different scales; a checkpoint's kv scales, by contrast, are per layer and the
same on every rank, which is what this matches.
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)
FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448
TARGET_AMAX = (200.0, 200.0, 100.0)  # q, k, v: vLLM's Q/K/V_SCALE_CONSTANT

# Calibration input: code and prose, the two kinds of text the demo models serve.
CALIBRATION_TEXT = '''def merge_sorted(a: list[int], b: list[int]) -> list[int]:
    """Merge two sorted lists into one sorted list."""
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i]); i += 1
        else:
            out.append(b[j]); j += 1
    return out + a[i:] + b[j:]

class LRUCache:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self.items = {}

Speculative decoding drafts a few tokens with a small model and checks them all in one pass
of the large model; the accepted prefix is exactly what the large model would have written.
'''


def quantize(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale in e4m3, saturating at +-448 (a plain cast may give NaN past it)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


class _Observer:
    """Stand-in attention backend for calibration: causal attention over the pass's own
    tokens (one sequence from position 0 needs no cache), recording each layer's amax."""

    name = "observe"
    supports_tree = False

    def __init__(self):
        self.amax: list[torch.Tensor] = []

    def __call__(self, q, k, v, k_cache, v_cache, ctx, scale=None):
        self.amax.append(torch.stack([t.detach().abs().amax().float() for t in (q, k, v)]))
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                             is_causal=True, enable_gqa=q.shape[2] != k.shape[2])
        return out.transpose(1, 2)


@torch.inference_mode()
def calibrate(model, token_ids: list[int]) -> torch.Tensor:
    """Scales [layers, 3 (q, k, v)] fp32, on the host. A tensor-parallel rank's model
    (model.group set) must run this with the same tokens as every other rank."""
    s, dev = model.shape, next(model.parameters()).device
    ids = torch.tensor([token_ids[: s.max_positions]], device=dev)
    observer, saved = _Observer(), model.backend
    model.backend = observer
    try:
        no_cache = SimpleNamespace(k=[None] * s.layers, v=[None] * s.layers, scales=None)
        model(ids, torch.arange(ids.shape[1], device=dev)[None], no_cache, None)
    finally:
        model.backend = saved
    amax = torch.stack(observer.amax)                                   # [layers, 3]
    if model.group is not None:  # this rank's heads -> all heads: every rank the same scales
        model.group.all_max(amax)
    scales = amax.clamp(min=1e-6) / torch.tensor(TARGET_AMAX, device=dev)
    log.info("fp8 KV scales from %d calibration tokens: q %.3g-%.3g, k %.3g-%.3g, v %.3g-%.3g",
             ids.shape[1], *(f(scales[:, j]).item() for j in range(3) for f in (torch.min, torch.max)))
    return scales.float().cpu()


def calibration_tokens(tokenizer) -> list[int]:
    return tokenizer.encode(CALIBRATION_TEXT)  # a Hugging Face tokenizer adds its BOS here
