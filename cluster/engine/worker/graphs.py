"""CUDA graphs for the decode, verify and prefill steps (batch buckets x row widths).

A step of B rows of T tokens each (T = gamma + 1; 1 is plain decoding) replays a graph
captured for (bucket(B), T). Its inputs are the tokens and each row's block-table row and
length: the cache positions are found in the graph through the tables, so nothing but those
is copied per step. Padding rows use the scratch row (every entry the scratch block), so they
never touch a sequence's KV; rows shorter than T write a few positions past their length, into
their own blocks or the scratch block, where nothing reads them (cluster.engine.scheduling.kv_cache).
Only backends that read lengths from tensors are captured (not SDPA, which gathers by a
host-side length).

Prefill chunks wider than a verify row replay graphs of widths in steps of 1.5x up to the
chunk size, with hidden states only (the caller takes logits at each row's last token: all B*T
would be gigabytes). Eagerly, a pass is ~130 launches of compiled pieces whose Python guards
cost more than the GPU work of a short prompt, and every running row waits on a prefill step
(graph against eager prefill times: benchmarks/gpu/h100, `prefill_ms`).
"""

from __future__ import annotations

import logging
import time

import torch

from cluster.engine.worker.attention import AttnContext

log = logging.getLogger(__name__)
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 192, 256)


def bucket(batch: int) -> int:
    return next(x for x in BUCKETS if x >= batch)


class _Graph:
    def __init__(self, model, kv, batch: int, width: int, capture, pool, num_layers: int | None,
                 logits: torch.Tensor | None, aux: torch.Tensor | None = None):
        """logits: the buffer every graph writes its [batch, width, V] logits into (in the
        weights' dtype); None: hidden states only (a prefill width). aux: the one buffer
        every graph writes its [batch, width, A] aux hidden states into (model.aux_layers).
        capture: cluster.engine.worker.capture's CUDA graphs or eager stand-in."""
        dev = kv.k.device
        # ids, rows and lens in one buffer: a step's inputs are one copy from pinned memory
        n = batch * width
        self.host = capture.host(n + 2 * batch)
        self.copied = capture.event()  # the last copy out of `host` is done
        self.inputs = torch.zeros((n + 2 * batch,), dtype=torch.int64, device=dev)
        self.ids = self.inputs[:n].view(batch, width)
        self.rows, self.lens = self.inputs[n:n + batch], self.inputs[n + batch:]
        self.rows.fill_(kv.scratch_row)
        V = model.shape.vocab_size
        out = None if logits is None else logits[: n * V].view(batch, width, V)
        A = model.shape.hidden * len(model.aux_layers)
        # an EAGLE-3 drafter's aux hidden states are outputs of every full-model graph
        self.aux = None if aux is None or num_layers is not None else aux[: n * A].view(batch, width, A)

        def body():
            taken: list = []
            h = model(self.ids, *self._ctx(model, kv, width), num_layers, aux=taken if self.aux is not None else None)
            if out is not None:
                y = model.logits(h, fp32=False)  # None on a tensor-parallel follower: rank 0 samples
                if y is not None:
                    out.copy_(y)
            if self.aux is not None:
                self.aux.copy_(taken[0])
            return h, out

        # hidden: kept for drafters that read the target's hidden states (Medusa)
        self.graph, (self.hidden, self.out) = capture.capture(body, pool)

    def _ctx(self, model, kv, width: int):
        return step_context(model, kv, self.rows, self.lens, width)


def step_context(model, kv, rows: torch.Tensor, lens: torch.Tensor, width: int):
    """(positions, kv, AttnContext) of a captured step of `width` tokens a row after `lens`
    cached ones, from device tensors only (a graph replays it with new values in them)."""
    from cluster.engine.worker.paged_attention import num_splits

    pos = lens[:, None] + torch.arange(width, device=lens.device)
    s = model.shape
    ctx = AttnContext(rows, lens, torch.full_like(lens, width), pos, width, kv.max_tokens, None, kv.tables)
    if width <= 16:  # the context's length is not known at capture: split for the longest
        ctx.splits = num_splits(rows.shape[0], s.kv_heads, -(-width * (s.heads // s.kv_heads) // 64), kv.max_tokens)
    return pos, kv, ctx


class _Chain:
    """A greedy drafter's chain after its catch-up pass: k - 1 one-token steps in one graph,
    each feeding the last step's argmax at the next position (lens + step), so the k drafts
    cost one launch. A small drafter's step is ~50 us of GPU work and its host side (inputs,
    launch, argmax, a write into the drafts) several times that, each step after the last:
    the GPU waited on the host. Inputs: `first` ([batch] ids, on the device), table rows and
    lengths (the cache before `first`); out: [batch, k] drafts, `first` in column 0."""

    def __init__(self, model, kv, batch: int, k: int, capture, pool):
        dev = kv.k.device
        self.host = capture.host(2 * batch)  # as _Graph's, without ids: table rows, then lengths
        self.copied = capture.event()
        self.inputs = torch.zeros((2 * batch,), dtype=torch.int64, device=dev)
        self.rows, self.lens = self.inputs[:batch], self.inputs[batch:]
        self.rows.fill_(kv.scratch_row)
        self.first = torch.zeros((batch,), dtype=torch.int64, device=dev)

        def body():
            ids, out = self.first, [self.first]
            for step in range(k - 1):  # each step a one-token pass as a _Graph of width 1 runs it
                h = model(ids[:, None], *step_context(model, kv, self.rows, self.lens + step, 1))
                ids = model.logits(h, fp32=False)[:, 0].argmax(-1)
                out.append(ids)
            return (torch.stack(out, 1),)

        self.graph, (self.out,) = capture.capture(body, pool)


class GraphRunner:
    def __init__(self, model, kv, capture, max_width: int, prefill_chunk: int = 0, max_tokens: int = 0,
                 dense_to: int = 0):
        """capture: cluster.engine.worker.capture.for_device's (CUDA graphs, or the CPU stand-in)."""
        self.model, self.kv, self.capture, self.max_width = model, kv, capture, max_width
        # Hidden-only widths: every width up to `dense_to` (a drafter's catch-up after a verify
        # step: a few tokens a row), then steps of 1.5x from 16 below the chunk size, then the
        # chunk size (a row padded to its width writes past its length; the spare capacity is a
        # chunk). Padding is compute where prompts are many: powers of two cost 8 prompts of 94
        # tokens 45 ms against 39 ms eagerly (H100, 8B shape).
        widths = (16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048)
        self.prefill_widths = list(range(max_width + 1, dense_to + 1))
        self.prefill_widths += [w for w in widths if max(max_width, dense_to) < w < prefill_chunk]
        if prefill_chunk > max(max_width, dense_to):
            self.prefill_widths.append(prefill_chunk)
        self.max_tokens = max_tokens
        self.graphs: dict[tuple[int, int, int | None], _Graph] = {}
        self.pool = capture.pool()
        # One logits buffer for every graph: one replays at a time and its caller reads the
        # logits before the next, so a buffer per graph (fp32 [B, T, V] each, ~15 GB over the
        # graphs of an 8B engine at batch 256) would only hold memory the KV pool can use.
        self.logits: torch.Tensor | None = None
        # One aux buffer too (an EAGLE-3 drafter's), sized for the widest graph at once: every
        # graph keeping its own would hold up to 3x its hidden states' memory each.
        self.aux: torch.Tensor | None = None
        if model.aux_layers:
            w = next(model.parameters())
            rows = max(BUCKETS[-1] * max_width, max_tokens)
            self.aux = torch.empty(rows * model.shape.hidden * len(model.aux_layers), dtype=w.dtype, device=w.device)
        self.max_batch_seen = 1
        self.max_batch, self.device = BUCKETS[-1], kv.k.device

    @torch.inference_mode()
    def capture_all(self, max_batch: int) -> None:
        """Capture every graph a step of up to `max_batch` rows can replay (full model), before
        serving: a capture costs up to 50x a replay (~150 ms, 8B shape on an H100), and lazily
        it lands in a step every stream waits on. vLLM captures at start-up for the same reason."""
        t0, before = time.perf_counter(), len(self.graphs)
        self.max_batch_seen = max(self.max_batch_seen, min(max_batch, BUCKETS[-1]))
        for bk in BUCKETS[:BUCKETS.index(bucket(min(max_batch, BUCKETS[-1]))) + 1]:
            for width in [*range(1, self.max_width + 1), *self.prefill_widths]:
                key = (bk, width, None)
                if key not in self.graphs and (width <= self.max_width or bk * width <= self.max_tokens):
                    self.graphs[key] = self._capture(bk, width, None)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        log.info("captured %d CUDA graphs (batch up to %d) in %.1f s", len(self.graphs) - before, max_batch,
                 time.perf_counter() - t0)

    @torch.inference_mode()
    def capture_chains(self, max_batch: int, max_k: int) -> None:
        """Every chain graph (`chain`) of 2..max_k drafts for batches up to max_batch, before
        serving, as capture_all does for passes."""
        t0, before = time.perf_counter(), len(self.graphs)
        for bk in BUCKETS[:BUCKETS.index(bucket(min(max_batch, BUCKETS[-1]))) + 1]:
            for k in range(2, max_k + 1):
                if (bk, -k, None) not in self.graphs:
                    self._chain(bk, k)
        log.info("captured %d chain graphs (batch up to %d, up to %d drafts) in %.1f s", len(self.graphs) - before,
                 max_batch, max_k, time.perf_counter() - t0)

    def _chain(self, batch: int, k: int) -> "_Chain":
        # a chain's key: its length, negative, where a pass's has its width
        g = self.graphs[(batch, -k, None)] = _Chain(self.model, self.kv, batch, k, self.capture, self.pool)
        return g

    def _capture(self, batch: int, width: int, num_layers: int | None) -> _Graph:
        logits = self._logits(batch, width) if width <= self.max_width else None
        return _Graph(self.model, self.kv, batch, width, self.capture, self.pool, num_layers, logits, self.aux)

    def _logits(self, batch: int, width: int) -> torch.Tensor:
        """The shared logits buffer, made for the largest graph on first use (capture_all
        captures the largest batch's graphs, so it is sized once)."""
        need = batch * width * self.model.shape.vocab_size
        if self.logits is None or self.logits.numel() < need:
            w = next(self.model.parameters())
            self.logits = torch.empty(max(need, bucket(self.max_batch_seen) * self.max_width * self.model.shape.vocab_size),
                                      dtype=w.dtype, device=w.device)
        return self.logits

    def eligible(self, batch: int, width: int, last_only: bool = False) -> bool:
        """A graph serves this step: verify widths always; prefill widths (hidden states
        only, so `last_only` steps) up to max_tokens padded tokens."""
        if batch > BUCKETS[-1]:
            return False
        if width <= self.max_width:
            return True
        w = self._width(width)
        return last_only and w is not None and bucket(batch) * w <= self.max_tokens

    def _width(self, width: int) -> int | None:
        if width <= self.max_width:
            return width
        return next((w for w in self.prefill_widths if w >= width), None)

    @torch.inference_mode()
    def forward(self, rows: list[int], cache_lens: list[int], tokens: list[list[int]],
                num_layers: int | None = None, carried: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """[B, T, V] logits, [B, T, D] hidden states and [B, T, A] aux hidden states (None
        without model.aux_layers): static buffers, read them before the next replay; T = the
        longest row (a prefill width: its graph's T, and logits None). `num_layers` < all:
        an early-exit pass. `carried`: as Runner.forward's, copied in on the device."""
        b, width = len(tokens), self._width(max(map(len, tokens)))
        g = self._prepare(rows, cache_lens, tokens, width, num_layers)
        if carried is not None:
            g.ids[:b, 1:1 + carried.shape[1]].copy_(carried.clamp(min=0))
        g.graph.replay()
        return (None if g.out is None else g.out[:b]), g.hidden[:b], (None if g.aux is None else g.aux[:b])

    def release(self) -> None:
        """Free every captured graph, once the GPU is done with them: a tensor-parallel rank
        does this before it leaves its process group, since NCCL's communicator teardown waits
        forever while a graph that captured its collectives lives (pytorch/pytorch#115388; every
        TP run with graphs hung in close). No graph replays after this."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        for g in self.graphs.values():
            g.graph.reset()

    def sync_tables(self) -> None:
        """The block tables' changes onto the device before a replay reads them."""
        self.kv.sync()

    def decode(self, rows: list[int], cache_lens: list[int], tokens: torch.Tensor) -> torch.Tensor:
        """A one-token step whose tokens ([B] int64) are already on the device: [B, V] logits
        (a static buffer), with no host round trip (a drafter's chain)."""
        return self.launch(rows, cache_lens, [()] * len(rows), tokens)[:, 0]

    @torch.inference_mode()
    def chain(self, rows: list[int], cache_lens: list[int], first: torch.Tensor, k: int,
              lens: torch.Tensor | None = None) -> torch.Tensor:
        """A greedy chain of k drafts a row from `first` ([B] int64 on the device, fed at each
        row's cache length): [B, k] (a static buffer), one replay (_Chain). `lens` ([B] int64
        on the device): the cache lengths, where the host does not know them (cache_lens then
        placeholders)."""
        bk = bucket(len(rows))
        g = self.graphs.get((bk, -k, None))
        if g is None:
            log.info("capturing CUDA graph for a chain of %d drafts at batch %d", k, bk)
            g = self._chain(bk, k)
        g.copied.synchronize()
        fill_inputs(g.host.numpy(), [()] * len(rows), rows, cache_lens, 0, bk, self.kv.scratch_row)  # no ids
        g.inputs.copy_(g.host, non_blocking=True)
        g.copied.record()
        g.first[:len(rows)].copy_(first)
        if lens is not None:
            g.lens[:len(rows)].copy_(lens)
        g.graph.replay()
        return g.out[:len(rows)]

    def _prepare(self, rows, cache_lens, tokens, width: int, num_layers: int | None) -> _Graph:
        """The graph for this step, its inputs copied in (rows' tokens, table rows, lengths)."""
        bk = bucket(len(tokens))
        key = (bk, width, num_layers)
        g = self.graphs.get(key)
        if g is None:
            log.info("capturing CUDA graph for batch %d x width %d (layers %s)", bk, width, num_layers or "all")
            g = self.graphs[key] = self._capture(bk, width, num_layers)
        g.copied.synchronize()
        fill_inputs(g.host.numpy(), tokens, rows, cache_lens, width, bk, self.kv.scratch_row)
        g.inputs.copy_(g.host, non_blocking=True)
        g.copied.record()
        return g

    @torch.inference_mode()
    def launch(self, rows: list[int], cache_lens: list[int], tokens: list[list[int]],
               carried: torch.Tensor) -> torch.Tensor:
        """A one-token step whose first k rows take their tokens from `carried` ([k] int64 on
        the device: a step's tokens before the host has read them) and the rest from
        `tokens` (the first k entries are placeholders): no host round trip for the carried
        rows. Returns its [B, 1, V] logits (a static buffer, as forward's)."""
        g = self._prepare(rows, cache_lens, tokens, 1, None)
        g.ids[:carried.shape[0], 0].copy_(carried)
        g.graph.replay()
        return g.out[:len(rows)]


    @torch.inference_mode()
    def launch_rows(self, rows: list[int], width: int, ids: torch.Tensor, lens: torch.Tensor
                    ) -> tuple[torch.Tensor | None, torch.Tensor]:
        """A step whose every row's tokens ([B, width] int64) and cache length ([B]) are on
        the device, results of the step before that the host has not read (a speculative
        step launched ahead, cluster.engine.spec.ahead): ([B, width, V] logits, None for a
        prefill width; [B, width, D] hidden states), static buffers as forward's."""
        b = len(rows)
        g = self._prepare(rows, [0] * b, [[0] * width] * b, width, None)
        g.ids[:b].copy_(ids)
        g.lens[:b].copy_(lens)
        g.graph.replay()
        return (None if g.out is None else g.out[:b]), g.hidden[:b]


def fill_inputs(host, tokens, rows, cache_lens, width: int, bk: int, scratch_row: int) -> None:
    """A graph's one input buffer (numpy int64 view of its pinned memory): ids [bk, width]
    (rows' tokens, 0 past each), then table rows [bk] (padding rows: the scratch row), then
    lengths [bk]. The ids go in as one flat list: a numpy slice assignment a row cost ~0.7 us
    each, most of this at 256 rows."""
    b, n = len(tokens), bk * width
    host[:] = 0
    host[n:n + bk] = scratch_row
    if b:
        host[:b * width] = [x for t in tokens for x in (t if len(t) == width else list(t) + [0] * (width - len(t)))]
    host[n:n + b] = rows
    host[n + bk:n + bk + b] = cache_lens
