"""CUDA graphs for the EAGLE-3 head's one-token steps.

A draft step is one layer over one token a row: launches, not math, so each batch bucket's
step is captured once and replayed with the rows' table indices, lengths, draft tokens and
hidden inputs copied into its static buffers (as cluster.engine.worker.graphs does for the model
drafter's steps). Padding rows use the KV cache's scratch row. Capture and replay go through
cluster.engine.worker.capture (CUDA graphs, or the CPU tests' eager stand-in).
"""

from __future__ import annotations

import torch

from cluster.engine.worker.attention import AttnContext
from cluster.engine.worker.graphs import BUCKETS, bucket


class _Step:
    def __init__(self, head, kv, batch: int, capture, pool):
        dev, s = kv.k.device, head.shape
        self.host = capture.host(2 * batch)
        self.copied = capture.event()  # the last copy out of `host` is done
        self.inputs = torch.zeros((2 * batch,), dtype=torch.int64, device=dev)
        self.rows, self.lens = self.inputs[:batch], self.inputs[batch:]
        self.ids = torch.zeros((batch, 1), dtype=torch.int64, device=dev)
        self.x = torch.zeros((batch, 1, head.cfg.hidden), dtype=kv.k.dtype, device=dev)
        self.rows.fill_(kv.scratch_row)

        splits = 1
        if head.backend.name == "triton":
            from cluster.engine.worker.paged_attention import num_splits

            splits = num_splits(batch, s.kv_heads, -(-(s.heads // s.kv_heads) // 64), kv.max_tokens)

        def body():
            pos = self.lens[:, None]
            ctx = AttnContext(self.rows, self.lens, torch.ones_like(self.lens), pos, 1, kv.max_tokens,
                              None, kv.tables, splits=splits, slots=kv.slots(self.rows, pos).flatten())
            return (head(self.ids, self.x, pos, kv, ctx),)

        self.graph, (self.out,) = capture.capture(body, pool)


class HeadGraphs:
    def __init__(self, head, kv, capture):
        self.head, self.kv, self.capture = head, kv, capture
        self.steps: dict[int, _Step] = {}
        self.pool = capture.pool()

    @torch.inference_mode()
    def capture_all(self, max_batch: int) -> None:
        """Every batch bucket's step, before serving (a capture costs a step's worth many times)."""
        for bk in BUCKETS[:BUCKETS.index(bucket(min(max_batch, BUCKETS[-1]))) + 1]:
            if bk not in self.steps:
                self.steps[bk] = _Step(self.head, self.kv, bk, self.capture, self.pool)

    @torch.inference_mode()
    def step(self, rows: list[int], cache_lens: list[int], ids: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """ids [B, 1] and x [B, 1, D] on the device -> the head's outputs [B, 1, D] (a copy)."""
        b, bk = len(rows), bucket(len(rows))
        g = self.steps.get(bk)
        if g is None:
            g = self.steps[bk] = _Step(self.head, self.kv, bk, self.capture, self.pool)
        g.copied.synchronize()
        host = g.host.numpy()
        host[:] = 0
        host[:bk] = self.kv.scratch_row
        host[:b], host[bk:bk + b] = rows, cache_lens
        g.inputs.copy_(g.host, non_blocking=True)
        g.copied.record()
        g.ids[:b].copy_(ids)
        g.x[:b].copy_(x)
        g.graph.replay()
        return g.out[:b].clone()
