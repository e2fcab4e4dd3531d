"""CUDA graphs for the EAGLE-3 head: catch-up passes and draft steps.

The head is one layer: at batch 1 a pass is launches, not math (an eager catch-up pass at the
8B shape took ~2 ms on an H100 against ~0.2 ms of GPU work), so both passes the drafter makes
every step replay graphs:

- catch-up (every width up to `max_width`, the longest verify row): the target's aux hidden
  states of the newly accepted positions go through fc inside the graph; out: the head's
  output at each row's last new position.
- draft step (one token a row): the pass, the draft logits and their argmax in target ids, so
  a greedy chain reads nothing back until its end.

Each (batch bucket, width) is captured once and replayed with the rows' table indices,
lengths and real widths copied into its static buffers (one copy from pinned memory, as
cluster.engine.worker.graphs does); padding rows use the KV cache's scratch row. Of a row
shorter than the width, the triton kernel writes only its real tokens' keys; a backend that
writes the padded ones puts them past the row's tokens (or in the scratch block), where
nothing reads them before a later pass overwrites them. Logits and aux inputs live in one buffer each, shared by every graph: one
replays at a time and its caller reads its outputs before the next. Capture and replay go
through cluster.engine.worker.capture (CUDA graphs, or the CPU tests' eager stand-in).
"""

from __future__ import annotations

import torch

from cluster.engine.worker.attention import AttnContext
from cluster.engine.worker.graphs import BUCKETS, bucket

# Catch-up graphs for batches up to this many rows: past it the eager pass's launches are shared
# by many rows, and every (bucket, width) captured adds to the start (~0.2 s each, 8B shape)
CATCH_UP_ROWS = 64


class _Pass:
    def __init__(self, owner: "HeadGraphs", batch: int, width: int):
        """width 0: a draft step (x in, logits and argmax out); else a catch-up pass of that width."""
        head, kv, capture = owner.head, owner.kv, owner.capture
        dev, s, T = kv.k.device, head.shape, max(width, 1)
        self.batch, self.width = batch, T
        self.host = capture.host(batch * T + 3 * batch)
        self.copied = capture.event()  # the last copy out of `host` is done
        self.inputs = torch.zeros((batch * T + 3 * batch,), dtype=torch.int64, device=dev)
        self.ids = self.inputs[: batch * T].view(batch, T)
        self.rows, self.lens, self.q_lens = self.inputs[batch * T:].view(3, batch)
        self.rows.fill_(kv.scratch_row)
        self.q_lens.fill_(1)
        if width:
            A = owner.aux_width
            self.aux = owner.aux[: batch * T * A].view(batch, T, A)
        else:
            self.x = torch.zeros((batch, 1, head.cfg.hidden), dtype=kv.k.dtype, device=dev)
        logits = owner.logits[:batch]

        splits = 1
        if head.backend.name == "triton":
            from cluster.engine.worker.paged_attention import num_splits

            splits = num_splits(batch, s.kv_heads, -(-T * (s.heads // s.kv_heads) // 64), kv.max_tokens)

        def body():
            # padded positions past a row's tokens are computed and dropped: keep them in the rotary table
            pos = (self.lens[:, None] + torch.arange(T, device=dev)).clamp(max=head.cfg.max_positions - 1)
            ctx = AttnContext(self.rows, self.lens, self.q_lens, pos, T, kv.max_tokens, None, kv.tables,
                              splits=splits, slots=kv.slots(self.rows, pos).flatten())
            x = head.combine(self.aux).to(kv.k.dtype) if width else self.x
            h = head(self.ids, x, pos, kv, ctx)
            last = h[torch.arange(batch, device=dev), self.q_lens - 1]  # [B, D]
            if width:
                return last, None, None
            logits.copy_(head.logits(last))
            return last, logits, head.target_ids(logits.argmax(-1))

        self.graph, (self.out, self.logits, self.tok) = capture.capture(body, owner.pool)

    def fill(self, rows: list[int], cache_lens: list[int], q_lens: list[int], ids: list[list[int]] | None,
             scratch_row: int) -> None:
        """The step's host inputs (ids [B][q_len], or None: the caller copies them on the device)."""
        self.copied.synchronize()
        b, bk, T = len(rows), self.batch, self.width
        host = self.host.numpy()
        n = bk * T
        if ids is not None:
            host[:n] = 0
            flat = host[:n].reshape(bk, T)
            for j, t in enumerate(ids):
                flat[j, : len(t)] = t
        host[n:n + bk] = scratch_row
        host[n + bk:] = 0
        host[n + 2 * bk:] = 1
        host[n:n + b], host[n + bk:n + bk + b], host[n + 2 * bk:n + 2 * bk + b] = rows, cache_lens, q_lens
        if ids is None:  # only rows, lens and widths: the ids stay as the device wrote them
            self.inputs[n:].copy_(self.host[n:], non_blocking=True)
        else:
            self.inputs.copy_(self.host, non_blocking=True)
        self.copied.record()


class HeadGraphs:
    def __init__(self, head, kv, capture, max_width: int):
        """max_width: the widest catch-up pass replayed (a verify row: gamma_max + 1); wider ones run eagerly."""
        self.head, self.kv, self.capture, self.max_width = head, kv, capture, max_width
        self.steps: dict[int, _Pass] = {}
        self.catch_ups: dict[tuple[int, int], _Pass] = {}
        self.pool = capture.pool()
        p = next(head.parameters())
        top = bucket(min(kv.max_rows, BUCKETS[-1]))
        self.max_batch = top
        self.logits = torch.empty((top, head.cfg.draft_vocab), dtype=torch.float32, device=p.device)
        A = len(head.cfg.aux_layers) * head.cfg.target_hidden
        self.aux = torch.zeros((top * max_width * A,), dtype=p.dtype, device=p.device)
        self.aux_width = A

    def _graph(self, batch: int, width: int) -> _Pass:
        bk = bucket(batch)
        graphs, key = (self.catch_ups, (bk, width)) if width else (self.steps, bk)
        g = graphs.get(key)
        if g is None:
            g = graphs[key] = _Pass(self, bk, width)
        return g

    @torch.inference_mode()
    def capture_all(self, max_batch: int) -> None:
        """Every bucket's draft step and catch-up widths, before serving (a capture costs a step's worth many times)."""
        for bk in BUCKETS[:BUCKETS.index(bucket(min(max_batch, self.max_batch))) + 1]:
            for width in range(self.max_width + 1 if bk <= CATCH_UP_ROWS else 1):
                self._graph(bk, width)

    def fits(self, batch: int, catch_up_width: int = 0) -> bool:
        """A graph serves a draft step of `batch` rows, or a catch-up pass of that many rows this wide."""
        if catch_up_width:
            return batch <= min(self.max_batch, CATCH_UP_ROWS) and catch_up_width <= self.max_width
        return batch <= self.max_batch

    @torch.inference_mode()
    def catch_up(self, rows: list[int], cache_lens: list[int], ids: list[list[int]], aux: list[torch.Tensor]) -> torch.Tensor:
        """Row b's len(ids[b]) new positions (their next tokens `ids[b]`, the target's aux states
        `aux[b]` [n, A]) after cache_lens[b] -> the head's output at each row's last one [B, D] (a copy)."""
        q_lens = [len(t) for t in ids]
        g = self._graph(len(rows), max(q_lens))
        g.fill(rows, cache_lens, q_lens, ids, self.kv.scratch_row)
        for j, a in enumerate(aux):
            g.aux[j, : len(a)].copy_(a, non_blocking=True)
        g.graph.replay()
        return g.out[: len(rows)].clone()

    @torch.inference_mode()
    def step(self, rows: list[int], cache_lens: list[int], ids: torch.Tensor, x: torch.Tensor):
        """A draft step: ids [B] (target ids) and x [B, D] on the device -> (out [B, D], fp32 logits
        [B, draft_vocab], argmax target ids [B]): static buffers, read them before the next replay."""
        b = len(rows)
        g = self._graph(b, 0)
        g.fill(rows, cache_lens, [1] * b, None, self.kv.scratch_row)
        g.ids[:b, 0].copy_(ids)
        g.x[:b, 0].copy_(x)
        g.graph.replay()
        return g.out[:b], g.logits[:b], g.tok[:b]
