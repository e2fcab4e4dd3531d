"""Runs one padded forward pass over a batch of sequences (block-table rows of a paged KV
cache); target and draft model share it."""

from __future__ import annotations

import time

import torch

from cluster.engine.scheduling.kv_cache import KVCache
from cluster.engine.worker import fp8
from cluster.engine.worker.attention import AttnContext, Segment, device_ints, make_backend
from cluster.engine.worker.capture import for_device as capture_for
from cluster.engine.worker.model import CausalLM
from cluster.engine.worker.tree import tree_layout


# A prefill pass of at least RAGGED_TOKENS real tokens whose rows padded to the widest would
# compute RAGGED times them or more runs as segments of similar widths instead, eagerly
# (Runner._forward_ragged): at that size its GPU work hides the host's launches, which a CUDA
# graph exists to save, and a graph pads its rows too (to the batch's bucket as well).
RAGGED, RAGGED_TOKENS = 1.25, 512


def ragged(q_lens: list[int]) -> bool:
    """Prompt chunks (wider than a verify row) worth running as segments (RAGGED)."""
    n = sum(q_lens)
    return max(q_lens) > 16 and n >= RAGGED_TOKENS and len(q_lens) * max(q_lens) > RAGGED * n


class Runner:
    can_mix = True  # forward_mixed: a verify and a prefill segment in one pass
    carries_drafts = True  # forward's `carried`: drafts still on the device feed a verify pass

    def __init__(self, model: CausalLM, kv: KVCache, attention: str = "auto", graph_width: int = 0,
                 prefill_chunk: int = 0, max_tokens: int = 0, dense_to: int = 0):
        self.model = model
        self.kv = kv
        p = next(model.parameters())
        self.device = p.device
        if model.backend is None:
            model.backend = make_backend(attention, p.device, p.dtype)
        self.graphs = None
        # the launch-ahead mode (cluster.engine.worker.pipeline): plain decode steps replay
        # a step early on the graphs; the engine picks the steps that may
        self.ahead = None
        self.warmup: dict | None = None  # what warm_up took, once it ran
        capture = capture_for(self.device, model.backend) if graph_width else None
        if capture is not None:  # decode/verify steps up to graph_width tokens a row
            from cluster.engine.worker.graphs import GraphRunner
            from cluster.engine.worker.pipeline import DecodePipeline

            self.graphs = GraphRunner(model, kv, capture, graph_width, prefill_chunk, max_tokens, dense_to)
            self.ahead = DecodePipeline(self.graphs)

    def calibrate(self, token_ids: list[int]) -> None:
        """An fp8 cache's scales from one pass over `token_ids` (cluster.engine.worker.fp8), before
        any pass writes the cache or a graph captures the scales."""
        self.kv.scales = fp8.calibrate(self.model, token_ids)

    def padded_width(self, width: int) -> int:
        """The width a row of `width` tokens is padded to in a last-only pass (a graph's)."""
        w = self.graphs._width(width) if self.graphs is not None else None
        return w or width

    @torch.inference_mode()
    def forward(self, rows: list[int], cache_lens: list[int], tokens: list[list[int]],
                last_only: bool, num_layers: int | None = None, trees: list[list[int] | None] | None = None,
                hidden: bool = False, aux: bool = False, carried: torch.Tensor | None = None):
        """Append `tokens[b]` to the sequence in table row `rows[b]` (after `cache_lens[b]`
        cached tokens; its blocks must hold them).

        Returns fp32 logits: [B, V] for each row's last token, or [B, T, V] for every
        (padded) position when `last_only` is False; with `hidden`, (logits, hidden states)
        at the same positions; with `aux` as well, (logits, hidden, aux hidden states
        [B, T, A] at every (padded) position whatever `last_only`, None without
        model.aux_layers): the inputs of those layers side by side (an EAGLE-3 drafter's). `trees[b]`,
        where not None, makes row b a draft tree ([root] + nodes, see cluster.engine.worker.tree)
        instead of a chain. `carried` [B, G] int64 on the device: the tokens after each row's
        first (drafts the host has not read, PendingDrafts), -1 past a row's own; `tokens`
        then give each row's first token and its width.
        """
        q_lens = [len(t) for t in tokens]
        tree = trees is not None and any(t is not None for t in trees)
        self.kv.sync()
        if last_only and not tree and num_layers is None and ragged(q_lens):
            return self._forward_ragged(rows, cache_lens, tokens, hidden, aux)
        if self.graphs is not None and not tree and self.graphs.eligible(len(tokens), max(q_lens), last_only):
            logits, h, a = self.graphs.forward(rows, cache_lens, tokens, num_layers, carried)
            if last_only:
                last = torch.arange(len(tokens), device=self.device), device_ints(q_lens, self.device) - 1
                h = h[last]
                logits = self.model.logits(h) if logits is None else logits[last]  # None: a prefill graph
            return (logits, h, a) if aux else (logits, h) if hidden else logits
        ctx = AttnContext.build(self.kv, rows, cache_lens, q_lens, self.device)
        ctx.splits = self._splits(len(rows), ctx.width, ctx.max_kv)
        if tree:  # rotary positions by depth; the keys are still written at flat positions
            depth, ctx.tree_mask = tree_layout(trees, ctx.width, self.device)
            ctx.positions = ctx.cache_lens[:, None] + depth
        assert ctx.max_kv <= self.kv.max_tokens, "past the block table's width"
        w = ctx.width  # one host tensor from padded lists: a tensor a row cost ~4 us each
        ids = device_ints([t if len(t) == w else list(t) + [0] * (w - len(t)) for t in tokens], self.device)
        if carried is not None:
            ids[:, 1:1 + carried.shape[1]] = carried.clamp(min=0)  # 0 past a row's tokens, as the padding
        return self.run(ids, ctx, last_only, num_layers, hidden, aux)

    def run(self, ids: torch.Tensor, ctx: AttnContext, last_only: bool, num_layers: int | None, hidden: bool,
            aux: bool = False):
        """The eager pass over token ids [B, T] on the device, as `forward` returns it (the
        part tensor-parallel ranks share, cluster.engine.distributed.ranks)."""
        taken: list = []
        h = self.model(ids, ctx.positions, self.kv, ctx, num_layers, aux=taken if aux else None)
        a = taken[0] if taken else None
        if last_only:
            h = h[torch.arange(ids.shape[0], device=self.device), ctx.q_lens - 1]
        logits = self.model.logits(h)
        return (logits, h, a) if aux else (logits, h) if hidden else logits

    def _forward_ragged(self, rows, cache_lens, tokens, hidden: bool, aux: bool):
        """forward(last_only=True) over prompt chunks of unequal widths, as segments of similar
        widths (a row joins one while it is at most 1.5x the segment's narrowest): projections
        and MLP run over the real tokens only, attention per segment. A 128-token chunk beside
        512-token ones padded to 512 did 4x its work in every matmul."""
        order = sorted(range(len(tokens)), key=lambda b: len(tokens[b]))
        groups: list[list[int]] = []
        for b in order:
            if not groups or len(tokens[b]) > 1.5 * len(tokens[groups[-1][0]]):
                groups.append([])
            groups[-1].append(b)
        segs, h, a_flat = self._segmented([([rows[b] for b in g], [cache_lens[b] for b in g], [tokens[b] for b in g],
                                             None) for g in groups], aux)
        # each row's last token, back in the caller's order
        ends = torch.cat([seg.start + torch.cumsum(seg.ctx.q_lens, 0) - 1 for seg in segs])
        back = torch.empty(len(order), dtype=torch.int64)
        back[torch.tensor(order)] = torch.arange(len(order))  # the groups hold `order` in turn
        h_last = h[ends[device_ints(back, self.device)]]
        logits = self.model.logits(h_last)
        if not aux:
            return (logits, h_last) if hidden else logits
        a = None
        if a_flat is not None:  # [B, T, A] at every (padded) position, as forward gives it
            a = a_flat.new_zeros((len(tokens), max(map(len, tokens)), a_flat.shape[-1]))
            for g, seg in zip(groups, segs):
                part = seg.pad(a_flat)
                a[torch.tensor(g, device=self.device), : part.shape[1]] = part
        return logits, h_last, a

    def _segmented(self, parts: list[tuple], aux: bool):
        """One eager pass over segments (rows, cache_lens, tokens, trees | None), each padded only
        to its own width (cluster.engine.worker.model.forward_segments): (the segments, hidden
        [N, D] of their real tokens back to back, aux [N, A] | None)."""
        segs, ids, start = [], [], 0
        for rows, cache_lens, tokens, trees in parts:
            q_lens = [len(t) for t in tokens]
            ctx = AttnContext.build(self.kv, rows, cache_lens, q_lens, self.device)
            ctx.splits = self._splits(len(rows), ctx.width, ctx.max_kv)
            if trees is not None and any(t is not None for t in trees):
                depth, ctx.tree_mask = tree_layout(trees, ctx.width, self.device)
                ctx.positions = ctx.cache_lens[:, None] + depth
            assert ctx.max_kv <= self.kv.max_tokens, "past the block table's width"
            segs.append(Segment(ctx, start, start + sum(q_lens)))
            start += sum(q_lens)
            for t in tokens:
                ids += t
        positions = torch.cat([seg.unpad(seg.ctx.positions) for seg in segs])
        taken: list = []
        h = self.model.forward_segments(device_ints(ids, self.device), positions, self.kv,
                                        segs, aux=taken if aux else None)
        return segs, h, (taken[0] if taken else None)

    @torch.inference_mode()
    def forward_mixed(self, verify: tuple, prefill: tuple, trees: list[list[int] | None] | None = None):
        """One eager pass over verify rows and prefill chunks, each a segment (rows, cache_lens,
        tokens) padded only to its own width: the weights are read once for both, and a
        256-token chunk does not pad 5-token verify rows (cluster.engine.worker.model.forward_segments).
        `trees` as forward's, for the verify rows. Returns ((logits [B1, T1, V], hidden
        [B1, T1, D], aux [B1, T1, A] | None) as forward(last_only=False, hidden=True, aux=True)
        gives them, and (logits [B2, V], hidden [B2, D]) at each chunk's last token with aux
        [B2, T2, A] | None at all its positions). No CUDA graph covers it."""
        self.kv.sync()
        segs, h, a = self._segmented([(*verify, trees), (*prefill, None)], aux=True)
        v, p = segs  # v starts at 0: its rows of the logits below are its own tokens' rows
        last = p.start + torch.cumsum(p.ctx.q_lens, 0) - 1
        logits = self.model.logits(torch.cat([h[v.start:v.stop], h[last]]))
        n = v.stop - v.start
        out_v = (v.pad(logits), v.pad(h), None if a is None else v.pad(a))
        out_p = (logits[n:], h[last], None if a is None else p.pad(a))
        return out_v, out_p

    def _splits(self, batch: int, width: int, max_kv: int) -> int:
        """Key splits per row for the paged triton kernel (flash-decoding); 1 for prefill."""
        if self.model.backend.name != "triton" or width > 16:
            return 1
        from cluster.engine.worker.paged_attention import num_splits

        s = self.model.shape
        tiles = -(-width * (s.heads // s.kv_heads) // 64)
        return num_splits(batch, s.kv_heads, tiles, max_kv)

    @torch.inference_mode()
    def decode(self, rows: list[int], cache_lens: list[int], tokens: torch.Tensor) -> torch.Tensor:
        """One token a row whose ids ([B] int64) are already on the device, as a drafter's
        greedy chain feeds its own argmax back: fp32 logits [B, V], no host round trip."""
        self.kv.sync()
        if self.graphs is not None and self.graphs.eligible(len(rows), 1):
            return self.graphs.decode(rows, cache_lens, tokens)
        ctx = AttnContext.build(self.kv, rows, cache_lens, [1] * len(rows), self.device)
        ctx.splits = self._splits(len(rows), 1, ctx.max_kv)
        h = self.model(tokens[:, None], ctx.positions, self.kv, ctx)
        return self.model.logits(h[:, 0])

    def chain(self, rows: list[int], cache_lens: list[int], first: torch.Tensor, k: int) -> torch.Tensor | None:
        """A greedy chain of k drafts a row in one CUDA graph (GraphRunner.chain): [B, k]; None
        where graphs do not serve it (the caller steps with `decode`)."""
        if self.graphs is None or not self.graphs.eligible(len(rows), 1):
            return None
        self.kv.sync()
        return self.graphs.chain(rows, cache_lens, first, k)

    @torch.inference_mode()
    def warm_up(self, mixed: bool = False) -> None:
        """Run every kernel variant a step can need once, before serving: dynamo specialises
        the compiled pieces on sizes 0 and 1 of each dimension, and Triton tunes the GEMV per
        weight shape, seconds each on first use, and every stream waits on such a step.
        Eager passes (graphs are captured from the same pieces) of 1 and 2 rows of 1 and 2
        tokens, all logits or the last row's, on the scratch row; then every CUDA graph of up
        to a full batch (GraphRunner.capture_all). `mixed`: a mixed pass too (its pieces run on
        [N, hidden], shapes the compiled kernels have not seen otherwise)."""
        if self.warmup is not None:  # once: a drafter built (and warmed) before its engine
            return
        t0 = time.perf_counter()
        graphs, self.graphs = self.graphs, None
        scratch = self.kv.scratch_row
        try:
            for b in (1, 2):
                for t in (1, 2):
                    for last_only in (True, False):
                        self.forward([scratch] * b, [0] * b, [[0] * t] * b, last_only=last_only)
            if self.kv.max_tokens >= 2 * RAGGED_TOKENS:  # a ragged prefill: pieces over [N, hidden]
                self.forward([scratch] * 2, [0, 0], [[0] * (RAGGED_TOKENS - 112), [0] * 112], last_only=True)
            if mixed:
                self.forward_mixed(([scratch], [0], [[0, 0]]), ([scratch] * 2, [0, 0], [[0] * 3, [0]]))
        finally:
            self.graphs = graphs
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        t1 = time.perf_counter()
        if graphs is not None:
            self.capture_graphs(self.kv.max_rows)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        # seconds compiling and tuning kernels (eager passes), then capturing graphs
        self.warmup = {"kernels_s": t1 - t0, "graphs_s": time.perf_counter() - t1,
                       "graphs": len(graphs.graphs) if graphs is not None else 0}

    def capture_graphs(self, max_batch: int) -> None:
        """Every CUDA graph a step of up to `max_batch` rows replays (GraphRunner.capture_all)."""
        self.graphs.capture_all(max_batch)
