"""Which part of each weight a tensor-parallel rank holds, and reading only that part.

Megatron's split, as vLLM's ColumnParallelLinear / RowParallelLinear / QKVParallelLinear do it:
- q/k/v and gate/up are split by output features: rank r computes its own heads and its
  slice of the MLP's intermediate features without talking to the others;
- o_proj and down_proj are split by input features: each rank's product is a partial sum, and
  one all-reduce per block adds them up (cluster.engine.worker.model);
- KV heads are split like the q heads they serve; with fewer KV heads than ranks, each rank
  holds the one KV head its q heads share (replicated N / kv_heads times);
- the embedding and the LM head are split over the vocabulary in equal slices, the last one
  padded with zero rows; norms are replicated.
Each rank reads its slices straight from the safetensors files (`get_slice`), so no rank
ever holds the whole model.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch


def check(shape, size: int) -> None:
    """Refuse a shape that does not split over `size` ranks, naming what does not divide."""
    kv = shape.kv_heads
    if shape.heads % size:
        raise ValueError(f"{shape.heads} attention heads do not split over tensor_parallel_size {size}")
    if (kv % size) if kv >= size else (size % kv):
        raise ValueError(f"{kv} KV heads neither split over nor replicate evenly on tensor_parallel_size {size}")
    if shape.intermediate % size:
        raise ValueError(f"intermediate size {shape.intermediate} does not split over tensor_parallel_size {size}")


def local_shape(shape, size: int):
    """One rank's shape: its heads, KV heads and MLP features; the vocabulary stays whole,
    since rank 0 returns full-vocabulary logits (cluster.engine.distributed.parallel.Group.gather_vocab)."""
    check(shape, size)
    return replace(shape, heads=shape.heads // size, kv_heads=max(1, shape.kv_heads // size),
                   intermediate=shape.intermediate // size)


def vocab_rows(vocab_size: int, rank: int, size: int) -> tuple[int, int]:
    """(first token id, rows) of a rank's vocabulary slice; every rank holds the same number."""
    rows = -(-vocab_size // size)
    return rank * rows, rows


def kv_heads_of(shape, rank: int, size: int) -> tuple[int, int]:
    """(first KV head, count) a rank holds: its q heads' KV heads."""
    if shape.kv_heads >= size:
        n = shape.kv_heads // size
        return rank * n, n
    return rank // (size // shape.kv_heads), 1


def weight_slice(name: str, shape, rank: int, size: int) -> tuple[int, int, int] | None:
    """(dim, start, stop) of the HF weight `name` that `rank` holds; None: all of it."""
    d, inter = shape.head_dim, shape.intermediate // size
    q = shape.heads // size
    kv0, kvn = kv_heads_of(shape, rank, size)
    if name.endswith(("q_proj.weight", "q_proj.bias")):
        return 0, rank * q * d, (rank + 1) * q * d
    if name.endswith(("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")):
        return 0, kv0 * d, (kv0 + kvn) * d
    if name.endswith("o_proj.weight"):
        return 1, rank * q * d, (rank + 1) * q * d
    if name.endswith(("gate_proj.weight", "up_proj.weight")):
        return 0, rank * inter, (rank + 1) * inter
    if name.endswith("down_proj.weight"):
        return 1, rank * inter, (rank + 1) * inter
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        start, rows = vocab_rows(shape.vocab_size, rank, size)
        return 0, start, start + rows
    return None


def take(src, dims: list[int], part: tuple[int, int, int] | None) -> torch.Tensor:
    """`part` of `src` (a tensor or a safetensors slice, read lazily), zero-padded where the
    slice runs past the end (the last vocabulary slice)."""
    if part is None:
        return src[:]
    dim, start, stop = part
    end = min(stop, dims[dim])
    t = src[start:end] if dim == 0 else src[:, start:end]
    if end < stop:
        pad = list(t.shape)
        pad[dim] = stop - end
        t = torch.cat([t, torch.zeros(pad, dtype=t.dtype)], dim=dim)
    return t


def read_shards(files: list[Path], shape, rank: int, size: int) -> dict[str, torch.Tensor]:
    """This rank's slices of every weight in the safetensors `files` (HF names)."""
    from safetensors import safe_open

    out = {}
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                src = f.get_slice(name)
                out[name] = take(src, src.get_shape(), weight_slice(name, shape, rank, size))
    return out
