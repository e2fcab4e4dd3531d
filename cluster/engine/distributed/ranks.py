"""Tensor-parallel ranks: rank 0 drives, ranks 1..N-1 follow, one forward pass at a time.

Rank 0 is the ordinary Engine (scheduler, drafters, sampling) whose target runner is a
`ParallelRunner`. Before each pass it broadcasts a header: a fixed-size `meta`, then one
int64 `payload` holding the pass's arguments (rows, cached lengths, token ids, draft trees'
parents) and what changed in the KV cache since the last pass (block-table entries, the slot
copies of accepted tree paths). Then every rank runs the same `Runner.forward` with the same
arguments: the same choice of CUDA graph or eager pass, the same graph captured or replayed,
the same collectives in the same order. A follower holds a mirror of the block tables (its own
KV heads' blocks, the same block ids) and no scheduler, so the engine above the runner is
unchanged and a follower's host work does not grow with the batch.

CUDA graphs hold each pass's all-reduces and its logits all-gather (NCCL captures them), so a
step is one graph replay on every rank and the header is the host's only work a step. What
rank 0 has only on its device follows the header as a device broadcast, in stream order:
a verify pass's drafts (Runner.forward's `carried`), and the drawn tokens of a plain step
launched ahead (AnnouncedGraphs: plain decoding runs a step ahead on every rank). Graphs
are captured in lockstep: rank 0 sends CAPTURE and every rank captures the same list in the
same order; a graph first needed mid-serving is captured by every rank in the same pass. A
header's `graphs` flag says whether rank 0 runs graphs at all for it (its warm-up passes are
eager), so that no rank replays while another runs eagerly.

A header is one broadcast of a fixed size (meta, then a short payload inline: a small batch's
pass); a longer payload follows in a second (`send_header`). The first header after start is
the KV geometry, cache dtype and graph sizes (`SETUP`). With an fp8 cache a CALIBRATE header
(its payload: the calibration tokens) follows: every rank runs the calibration pass on its
heads and the ranks agree on the scales (cluster.engine.worker.fp8), once, before any FORWARD.
STOP ends the followers. A dead rank makes rank 0's next header broadcast or collective fail
(cluster.engine.distributed.parallel): rank 0 raises RankFailure and the replica goes down,
rather than serving from a broken group.
"""

from __future__ import annotations

import itertools
import logging
import os
import time
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist

from cluster.engine.distributed.parallel import Group, RankFailure, free_port, init_group
from cluster.engine.scheduling.kv_cache import KVCache
from cluster.engine.worker import fp8
from cluster.engine.worker.capture import eager_on_cpu
from cluster.engine.worker.model import compile_kernels
from cluster.engine.worker.runner import Runner

log = logging.getLogger(__name__)
STOP, FORWARD, CALIBRATE, CAPTURE = 0, 1, 2, 3
META = 12     # op, rows B, tokens N (all rows, unpadded), table updates U, last_only, layers, tree section length (0: chains),
#               KV slot moves M, graphs (0: an eager pass on every rank), carried rows K (a launch ahead, below),
#               carried draft columns G (a verify pass whose drafts are still on rank 0's device),
#               on device (1: every row's tokens and cache length are, a speculative step launched ahead)
#               (CALIBRATE: op, tokens, 0...; CAPTURE: op, max batch, 0...)
SETUP = 9     # blocks, block_size, max_rows, max_tokens, fp8 cache (0 / 1), graph width (0: no graphs),
#               prefill chunk, graph prefill tokens, header payload inline (INLINE)
# A header goes as one fixed-size broadcast, meta then up to INLINE payload values (a batch-1
# verify pass's: about ten); a longer payload follows in a second. Each broadcast is a host
# round trip over gloo on rank 0's critical path (two a pass took 0.35-0.5 ms at TP 4, H100).
# Rank 0's value, sent in SETUP.
INLINE = 256
STEP_TIMEOUT_S = 120.0
DEATH_WAIT_S = 2.0  # after a failed collective, how long rank 0 looks for the follower that died


def encode(updates: torch.Tensor, rows: list[int], cache_lens: list[int], tokens: list[list[int]],
           last_only: bool, num_layers: int | None, trees: list[list[int] | None] | None = None,
           moves: list[tuple[int, int]] = (), graphs: bool = False, carried: int = 0,
           drafts: int = 0, on_device: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The header of one pass: (meta [META], payload), host int64. Draft trees travel as each
    row's node count + 1 (0: a chain) then the tree rows' parents; `moves`: rank 0's KV slot
    copies since the last pass (accepted tree paths), which every follower repeats on its
    heads before this pass. `carried` > 0: a decode step launched ahead whose first `carried`
    rows take their tokens from the device, broadcast after the header (AnnouncedGraphs);
    `drafts` > 0: a verify pass whose rows' tokens after the first are [B, drafts] draft ids
    broadcast from rank 0's device after the header (Runner.forward's `carried`); `on_device`:
    a step whose rows' tokens and cache lengths all follow so, [B, width + 1] (a speculative
    step launched ahead, GraphRunner.launch_rows: `tokens` give the width only)."""
    q_lens = [len(t) for t in tokens]
    b = len(tokens)
    flat = [x for t in tokens for x in t]  # unpadded: each rank's Runner.forward pads as rank 0's does
    tree = []
    if trees is not None and any(t is not None for t in trees):
        tree = [len(t) + 1 if t is not None else 0 for t in trees] + [p for t in trees if t is not None for p in t]
    moved = [s for s, _ in moves] + [d for _, d in moves]
    meta = torch.tensor([FORWARD, b, len(flat), updates.shape[1], int(last_only), num_layers or 0, len(tree), len(moves),
                         int(graphs), carried, drafts, int(on_device)], dtype=torch.int64)
    payload = torch.cat([torch.tensor(rows + cache_lens + q_lens + flat + tree + moved, dtype=torch.int64),
                         updates.flatten()])
    return meta, payload


def payload_len(meta: list[int]) -> int:
    if meta[0] == CALIBRATE:
        return meta[1]
    _, b, num_tokens, num_updates, _, _, num_tree, num_moves, _, _, _, _ = meta
    return 3 * b + num_tokens + num_tree + 2 * num_moves + 3 * num_updates


def send_header(group: Group, inline: int, meta: list[int] | torch.Tensor, payload: torch.Tensor | None = None) -> int:
    """Rank 0: one header (meta, payload) to every follower (receive_header); the broadcasts it took."""
    n = 0 if payload is None else payload.numel()
    first = torch.zeros(META + inline, dtype=torch.int64)
    first[:META] = torch.as_tensor(meta, dtype=torch.int64)
    if 0 < n <= inline:
        first[META:META + n] = payload
    group.broadcast_header(first)
    if n > inline:
        group.broadcast_header(payload)
    return 1 + (n > inline)


def receive_header(group: Group, inline: int) -> tuple[list[int], torch.Tensor]:
    """A follower: the next header rank 0 sent (send_header), as (meta, payload)."""
    first = group.broadcast_header(torch.empty(META + inline, dtype=torch.int64))
    meta = first[:META].tolist()
    n = payload_len(meta) if meta[0] in (FORWARD, CALIBRATE) else 0
    if n <= inline:
        return meta, first[META:META + n]
    return meta, group.broadcast_header(torch.empty(n, dtype=torch.int64))


def decode_trees(section: list[int], b: int) -> list[list[int] | None]:
    """Each row's parents (None: a chain) from a header's tree section (see encode)."""
    trees, at = [], b
    for n in section[:b]:
        trees.append(section[at:at + n - 1] if n else None)
        at += max(n - 1, 0)
    return trees


def run_step(runner: Runner, group: Group, meta: list[int], payload: torch.Tensor) -> None:
    """A follower's pass from its header: the KV changes rank 0 made, then the Runner.forward
    rank 0 runs, with the same arguments (its logits stay on rank 0: only rank 0 samples); a
    launch ahead takes its carried rows' tokens from rank 0's broadcast, as rank 0's does."""
    _, b, num_tokens, num_updates, last_only, num_layers, num_tree, num_moves, graphs, carried, drafts, on_device = meta
    head, updates = payload[:len(payload) - 3 * num_updates].tolist(), payload[len(payload) - 3 * num_updates:]
    rows, lens, q_lens = head[:b], head[b:2 * b], head[2 * b:3 * b]
    at = 3 * b + num_tokens
    ids, tree, moves = head[3 * b:at], head[at:at + num_tree], head[at + num_tree:]
    if num_moves:
        runner.kv.copy_slots(moves[:num_moves], moves[num_moves:])
    if num_updates:
        runner.kv.apply_updates(updates.view(3, num_updates))
    ends = list(itertools.accumulate(q_lens))
    tokens = [ids[e - q:e] for e, q in zip(ends, q_lens)]
    if carried:  # the header's table changes are in (above): a follower keeps no others
        runner.graphs.launch(rows, lens, tokens, group.broadcast_tokens(carried))
        return
    if on_device:
        width = q_lens[0]
        both = group.broadcast_tokens((b, width + 1))
        runner.graphs.launch_rows(rows, width, both[:, :width], both[:, width])
        return
    kept = runner.graphs
    runner.graphs = kept if graphs else None
    try:
        runner.forward(rows, lens, tokens, bool(last_only), num_layers or None,
                       decode_trees(tree, b) if num_tree else None,
                       carried=group.broadcast_tokens((b, drafts)) if drafts else None)
    finally:
        runner.graphs = kept


class ParallelRunner(Runner):
    """Rank 0's target runner: every pass is announced to the followers, then run here."""

    # the pass header describes one padded block: with mixed_prefill the engine runs this
    # runner's prefill and verify as separate steps
    can_mix = False

    def __init__(self, model, kv: KVCache, attention: str, group: Group, graph_width: int = 0,
                 prefill_chunk: int = 0, graph_tokens: int = 0):
        super().__init__(model, kv, attention, graph_width, prefill_chunk, graph_tokens)
        self.group = group
        if self.graphs is not None:  # plain decoding launched ahead, every launch announced
            from cluster.engine.worker.pipeline import DecodePipeline

            self.ahead = DecodePipeline(AnnouncedGraphs(self))
        kv.moved = []  # tree paths' KV copies, for the followers (encode)
        width = graph_width if self.graphs is not None else 0  # the followers capture as this rank does
        self.inline = INLINE
        self.broadcasts = {1: 0, 2: 0}  # headers by the broadcasts each took
        with self._failures():
            group.broadcast_header(torch.tensor([kv.scratch_block, kv.block_size, kv.max_rows, kv.max_tokens,
                                                 int(kv.k.dtype == fp8.FP8), width, prefill_chunk, graph_tokens,
                                                 self.inline]))

    def _send(self, meta, payload=None) -> None:
        self.broadcasts[send_header(self.group, self.inline, meta, payload)] += 1

    def calibrate(self, token_ids: list[int]) -> None:
        """As Runner.calibrate, on every rank: each gets the same scales (cluster.engine.worker.fp8)."""
        with self._failures():
            self._send([CALIBRATE, len(token_ids)] + [0] * (META - 2), torch.tensor(token_ids, dtype=torch.int64))
            super().calibrate(token_ids)

    @torch.inference_mode()
    def forward(self, rows, cache_lens, tokens, last_only, num_layers=None, trees=None, hidden=False, aux=False,
                carried=None):
        """As Runner.forward, on every rank; `aux`: rank 0's capture of the aux layers' inputs
        (the residual stream, whole on every rank after each all-reduce: no collective);
        `carried` drafts go from rank 0's device to every rank's after the header, so a verify
        pass waits for no host round trip here either."""
        with self._failures():
            self.announce(rows, cache_lens, tokens, last_only, num_layers, trees, self.graphs is not None,
                          drafts=0 if carried is None else carried.shape[1])
            if carried is not None:
                carried = self.group.broadcast_tokens(carried)
            return super().forward(rows, cache_lens, tokens, last_only, num_layers, trees, hidden, aux, carried)

    def announce(self, rows, cache_lens, tokens, last_only, num_layers=None, trees=None, graphs=True,
                 carried: int = 0, drafts: int = 0, on_device: bool = False) -> None:
        """The next pass's header to the followers, and the table changes it carries applied here."""
        updates = self.kv.take_updates()
        meta, payload = encode(updates, rows, cache_lens, tokens, last_only, num_layers, trees, self.kv.moved,
                               graphs, carried, drafts, on_device)
        self.kv.moved.clear()
        self._send(meta, payload)
        if updates.shape[1]:
            self.kv.apply_updates(updates)

    def capture_graphs(self, max_batch: int) -> None:
        """Every rank captures the same graphs in the same order (their collectives pair up)."""
        with self._failures():
            self._send([CAPTURE, max_batch] + [0] * (META - 2))
            super().capture_graphs(max_batch)

    def forward_mixed(self, verify, prefill, trees=None):
        raise NotImplementedError("a tensor-parallel pass is one padded block (can_mix is False)")

    @torch.inference_mode()
    def decode(self, rows, cache_lens, tokens: torch.Tensor) -> torch.Tensor:
        return self.forward(rows, cache_lens, [[t] for t in tokens.tolist()], last_only=True)

    def close(self) -> None:
        """Stop the followers (where they still listen), free the graphs and leave the group
        with them (each rank does both: GraphRunner.release says why), then wait for them to exit."""
        stopped = False
        try:
            if all(p.is_alive() for p in self.group.procs):
                self._send([STOP] + [0] * (META - 1))
                stopped = True
        except (RuntimeError, dist.DistError):
            pass
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        if stopped and self.graphs is not None:  # a dead peer's group is abandoned, graphs and all
            self.graphs.release()
        self.group.close()
        for p in self.group.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()

    @contextmanager
    def _failures(self):
        try:
            yield
        except (RuntimeError, dist.DistError) as e:
            collective = isinstance(e, dist.DistError) or "gloo" in str(e).lower()
            # a peer's closed socket can reach us before its death is seen: wait a moment to name it
            dead = self._dead(wait_s=DEATH_WAIT_S if collective else 0.0)
            if not dead and not collective:
                raise  # not the group's failure
            raise RankFailure(f"tensor-parallel group of {self.group.size} failed"
                              f"{': ' + ', '.join(dead) + ' gone' if dead else ''} ({e})") from e

    def _dead(self, wait_s: float) -> list[str]:
        """The followers that have ended, waiting up to wait_s for one to be seen."""
        deadline = time.monotonic() + wait_s
        while True:
            dead = [f"rank {r} (exit code {p.exitcode})" for r, p in enumerate(self.group.procs, 1)
                    if not p.is_alive()]
            if dead or time.monotonic() >= deadline:
                return dead
            time.sleep(0.02)


class AnnouncedGraphs:
    """Rank 0's CUDA graphs as the launch-ahead pipeline (cluster.engine.worker.pipeline) drives
    them, each pass announced to the followers first, so plain decoding runs a step ahead under
    tensor parallelism too: a launch's header goes out before the host knows the step's tokens,
    and its carried rows' tokens (drawn on rank 0's GPU) follow as a device broadcast, which
    each follower's replay reads where rank 0's does. A follower's host thus prepares step n+1
    while the GPUs run step n, as rank 0's does."""

    def __init__(self, runner: "ParallelRunner"):
        self.runner, self.inner = runner, runner.graphs
        self.capture, self.max_batch, self.device = self.inner.capture, self.inner.max_batch, self.inner.device

    def eligible(self, batch: int, width: int, last_only: bool = False) -> bool:
        return self.inner.eligible(batch, width, last_only)

    def sync_tables(self) -> None:
        """Nothing here: the table changes travel with the next announced pass (announce)."""

    def forward(self, rows, cache_lens, tokens, num_layers=None, carried=None):
        assert carried is None and num_layers is None
        with self.runner._failures():
            self.runner.announce(rows, cache_lens, tokens, last_only=False)
            return self.inner.forward(rows, cache_lens, tokens)

    def launch(self, rows, cache_lens, tokens, carried: torch.Tensor) -> torch.Tensor:
        with self.runner._failures():
            self.runner.announce(rows, cache_lens, tokens, last_only=False, carried=carried.shape[0])
            return self.inner.launch(rows, cache_lens, tokens, self.runner.group.broadcast_tokens(carried))

    def launch_rows(self, rows, width: int, ids: torch.Tensor, lens: torch.Tensor):
        """GraphRunner.launch_rows on every rank: one broadcast of the rows' tokens and lengths."""
        with self.runner._failures():
            b = len(rows)
            self.runner.announce(rows, [0] * b, [[0] * width] * b, last_only=False, on_device=True)
            both = self.runner.group.broadcast_tokens(torch.cat([ids, lens[:, None]], 1))
            return self.inner.launch_rows(rows, width, both[:, :width], both[:, width])


def spawn(rank: int, size: int, addr: str, port: int, target: str, cfg, step_timeout_s: float):
    """The launcher without Ray (`generate --local`, tests): a spawned child process of this
    one. A launcher returns a handle with multiprocessing.Process's pid, is_alive(),
    exitcode, join(timeout) and terminate(); under Serve the followers are Ray actors in
    the replica's placement group instead (cluster.serve.followers)."""
    ctx = torch.multiprocessing.get_context("spawn")
    p = ctx.Process(target=follow, args=(rank, size, port, target, cfg, step_timeout_s, addr),
                    name=f"tp-rank-{rank}", daemon=True)
    p.start()
    return p


def start_ranks(target: str, cfg, step_timeout_s: float = STEP_TIMEOUT_S, launch=spawn,
                addr: str = "127.0.0.1") -> Group:
    """Start ranks 1..N-1 of `cfg.tensor_parallel_size` for the target model directory with
    `launch` and join them as rank 0 (this process). `addr`: this host's address as the
    followers reach it (the rendezvous listens on every interface)."""
    size = cfg.tensor_parallel_size
    port = free_port()
    procs = [launch(r, size, addr, port, str(target), cfg, step_timeout_s) for r in range(1, size)]
    try:
        group = init_group(0, size, addr, port, cfg.device, step_timeout_s, cfg.tp_one_shot_kb, getattr(torch, cfg.dtype))
    except BaseException:
        for p in procs:
            p.terminate()
        raise
    group.procs = procs
    return group


def follow(rank: int, size: int, port: int, target: str, cfg, step_timeout_s: float,
           addr: str = "127.0.0.1") -> Runner:
    """A follower rank's whole life: join, load its shard, mirror rank 0's passes until STOP.
    Returns its runner as STOP left it (its KV scales and graphs, for a caller that checks them)."""
    from cluster.engine.worker.loader import load_model

    torch.set_num_threads(max(1, torch.get_num_threads() // size))  # on a CPU the ranks share the host's cores
    group = init_group(rank, size, addr, port, cfg.device, step_timeout_s, cfg.tp_one_shot_kb,
                       getattr(torch, cfg.dtype))
    try:
        if cfg.compile and group.device.type == "cuda":  # the kernels rank 0's passes run (fused GEMV, compiled pieces)
            compile_kernels(cfg.compile_cache_dir)
        model = load_model(target, getattr(torch, cfg.dtype), group.device, group)  # float32, bfloat16, ...
        s = model.shape
        setup = group.broadcast_header(torch.zeros(SETUP, dtype=torch.int64)).tolist()
        blocks, block_size, max_rows, max_tokens, is_fp8, graph_width, prefill_chunk, graph_tokens, inline = setup
        dtype = fp8.FP8 if is_fp8 else next(model.parameters()).dtype
        kv = KVCache(s.layers, blocks, block_size, s.kv_heads, s.head_dim, dtype, group.device,
                     max_rows, max_tokens, prefix_caching=False)
        # rank 0 captures on a CPU only under the tests' stand-in (cluster.engine.worker.capture)
        stand_in = eager_on_cpu() if graph_width and group.device.type == "cpu" else nullcontext()
        with stand_in:
            runner = Runner(model, kv, cfg.attention, graph_width, prefill_chunk, graph_tokens)
        with torch.inference_mode():
            while True:
                m, payload = receive_header(group, inline)
                if m[0] == STOP:
                    break
                if m[0] == CAPTURE:
                    runner.graphs.capture_all(m[1])
                    continue
                if m[0] == CALIBRATE:
                    runner.calibrate(payload.tolist())
                else:
                    run_step(runner, group, m, payload)
        if runner.graphs is not None:  # after STOP only: a failed step may have left a kernel waiting on a peer
            runner.graphs.release()
    except BaseException:
        # Say why, then end this rank at once: leaving the group after a failure can wait forever
        # on a collective the others never finish, and the error with it (a TP 2 follower went
        # silent so, benchmarks/gpu/tp/ahead/tp2_hang.log). Rank 0 sees this rank gone (RankFailure).
        log.exception("rank %d of %d failed; ending this rank", rank, size)
        logging.shutdown()
        os._exit(1)
    group.close()
    return runner
