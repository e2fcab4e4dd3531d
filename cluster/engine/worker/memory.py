"""How many KV blocks a verifier gets: from memory, not from the sequence limit.

`engine.kv_cache_gb` sets the pool explicitly. Otherwise, on a GPU, the pool is what
`gpu_memory_utilization` of the card leaves after everything already there (weights, a
colocated drafter), the activations of the widest step (measured with one eager pass of
`max_batch_tokens` tokens) and the CUDA graphs' static outputs (computed from their shapes).
On a CPU the pool holds `max_num_seqs` sequences of `max_model_len` tokens, as the slot
cache did.
"""

from __future__ import annotations

import logging

import torch

from cluster.engine.scheduling.kv_cache import KVCache, block_bytes
from cluster.engine.worker.attention import AttnContext
from cluster.engine.worker.graphs import BUCKETS, bucket

log = logging.getLogger(__name__)
GIB = 2**30


def graph_output_bytes(model, max_num_seqs: int, width: int) -> int:
    """What the decode/verify graphs keep: one shared logits buffer for the largest, and each
    graph's hidden states."""
    s, size = model.shape, next(model.parameters()).element_size()
    buckets = BUCKETS[:BUCKETS.index(bucket(min(max_num_seqs, BUCKETS[-1]))) + 1]
    return (buckets[-1] * width * s.vocab_size * size
            + sum(b * w * s.hidden * size for b in buckets for w in range(1, width + 1)))


@torch.inference_mode()
def activation_bytes(model, tokens: int, block_size: int, kv_dtype: torch.dtype) -> int:
    """Peak memory of one eager pass over `tokens` tokens (one row), above what was allocated."""
    dev = next(model.parameters()).device
    s = model.shape
    scratch = KVCache(s.layers, -(-tokens // block_size) + 1, block_size, s.kv_heads, s.head_dim, kv_dtype, dev,
                      max_rows=1, max_tokens=tokens + block_size, prefix_caching=False)
    if kv_dtype.itemsize == 1:  # an e4m3 cache: any scales serve to measure memory
        scratch.scales = torch.ones((s.layers, 3))
    h = scratch.open()
    scratch.grow(h, tokens)
    scratch.sync()
    torch.cuda.synchronize(dev)
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    ctx = AttnContext.build(scratch, [h.row], [0], [tokens], dev)
    ids = torch.zeros((1, tokens), dtype=torch.int64, device=dev)
    model.logits(model(ids, ctx.positions, scratch, ctx)[:, -1])
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev) - base
    del scratch, ctx, ids
    torch.cuda.empty_cache()
    return peak


def num_kv_blocks(model, cfg, kv_dtype: torch.dtype, max_tokens: int) -> int:
    """Blocks for the target's pool (see the module docstring)."""
    s = model.shape
    per_block = block_bytes(s.layers, cfg.block_size, s.kv_heads, s.head_dim, kv_dtype)
    dev = next(model.parameters()).device
    if cfg.kv_cache_gb is not None:
        return max(1, int(cfg.kv_cache_gb * GIB // per_block))
    if dev.type != "cuda":
        return cfg.max_num_seqs * -(-max_tokens // cfg.block_size)
    if getattr(model, "group", None) is not None:  # one rank's lone pass would wait on the others' collectives
        raise ValueError("tensor_parallel_size > 1 on GPUs needs engine.kv_cache_gb (per rank) for now")
    act = activation_bytes(model, cfg.max_batch_tokens, cfg.block_size, kv_dtype)
    graphs = graph_output_bytes(model, cfg.max_num_seqs, cfg.gamma_max + 1) if cfg.cuda_graphs else 0
    free, total = torch.cuda.mem_get_info(dev)
    budget = cfg.gpu_memory_utilization * total - (total - free) - act - graphs
    blocks = int(budget // per_block)
    log.info("KV pool: %d blocks of %d tokens (%.1f GiB); card %.1f GiB, in use %.1f, activations %.2f, "
             "graph outputs %.2f", blocks, cfg.block_size, blocks * per_block / GIB, total / GIB,
             (total - free) / GIB, act / GIB, graphs / GIB)
    return blocks
