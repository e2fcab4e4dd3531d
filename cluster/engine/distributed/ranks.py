"""Tensor-parallel ranks: rank 0 drives, ranks 1..N-1 follow, one forward pass at a time.

Rank 0 is the ordinary Engine (scheduler, drafters, sampling) whose target runner is a
`ParallelRunner`: before each pass it broadcasts a header, a fixed-size `meta` then one int64
`payload` (the rows, cached lengths, token ids, which new tokens are real, draft trees'
parents, the KV slot copies of accepted tree paths and the block-table changes since the
last pass), and then runs the pass as every rank does (`run_step`). A
follower holds a mirror of the KV block tables (its own KV heads' blocks, the same block ids)
and no scheduler: per pass it receives the header, applies the table changes and runs the same
tensor ops on its shard, joining rank 0's all-reduces and the logits gather. So the engine
above the runner is unchanged and a follower's host work does not grow with the batch.

The first header after start is the KV geometry and cache dtype (`SETUP`). With an fp8 cache
a CALIBRATE header (its payload: the calibration tokens) follows: every rank runs the
calibration pass on its heads and the ranks agree on the scales (cluster.engine.worker.fp8), once,
before any FORWARD. STOP ends the followers. A dead
or stalled rank makes rank 0's next collective fail (cluster.engine.distributed.parallel): rank 0 raises
RankFailure and the replica goes down, rather than serving from a broken group.
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager

import torch
import torch.distributed as dist

from cluster.engine.distributed.parallel import Group, RankFailure, free_port, init_group
from cluster.engine.scheduling.kv_cache import KVCache
from cluster.engine.worker import fp8
from cluster.engine.worker.attention import AttnContext
from cluster.engine.worker.runner import Runner
from cluster.engine.worker.tree import tree_layout

log = logging.getLogger(__name__)
STOP, FORWARD, CALIBRATE = 0, 1, 2
META = 10     # op, rows B, width T, table updates U, max_kv, real-token index length (-1: all), last_only, layers,
#               tree section length (0: chains), KV slot moves M
#               (CALIBRATE: op, tokens, 0...)
SETUP = 5     # blocks, block_size, max_rows, max_tokens, fp8 cache (0 / 1)
STEP_TIMEOUT_S = 120.0
DEATH_WAIT_S = 2.0  # after a failed collective, how long rank 0 looks for the follower that died


def encode(updates: torch.Tensor, rows: list[int], cache_lens: list[int], tokens: list[list[int]],
           last_only: bool, num_layers: int | None, trees: list[list[int] | None] | None = None,
           moves: list[tuple[int, int]] = ()) -> tuple[torch.Tensor, torch.Tensor]:
    """The header of one pass: (meta [META], payload), host int64, built as AttnContext.build
    builds a single process's context. Draft trees travel as each row's node count + 1 (0: a
    chain) then the tree rows' parents; `moves`: rank 0's KV slot copies since the last pass
    (accepted tree paths), which every follower repeats on its heads before this pass."""
    q_lens = [len(t) for t in tokens]
    b, width = len(tokens), max(q_lens)
    ids = torch.zeros((b, width), dtype=torch.int64)
    for i, t in enumerate(tokens):
        ids[i, : len(t)] = torch.tensor(t)
    src = [i * width + j for i, n in enumerate(q_lens) for j in range(n)] if min(q_lens) < width else []
    max_kv = max(c + width for c in cache_lens)
    tree = []
    if trees is not None and any(t is not None for t in trees):
        tree = [len(t) + 1 if t is not None else 0 for t in trees] + [p for t in trees if t is not None for p in t]
    moved = [s for s, _ in moves] + [d for _, d in moves]
    meta = torch.tensor([FORWARD, b, width, updates.shape[1], max_kv, len(src) if src else -1, int(last_only),
                         num_layers or 0, len(tree), len(moves)], dtype=torch.int64)
    payload = torch.cat([torch.tensor(rows + cache_lens + q_lens, dtype=torch.int64), ids.flatten(),
                         torch.tensor(src + tree + moved, dtype=torch.int64), updates.flatten()])
    return meta, payload


def payload_len(meta: list[int]) -> int:
    if meta[0] == CALIBRATE:
        return meta[1]
    _, b, width, num_updates, _, num_src, _, _, num_tree, num_moves = meta
    return 3 * b + b * width + max(num_src, 0) + num_tree + 2 * num_moves + 3 * num_updates


def decode_trees(section: list[int], b: int) -> list[list[int] | None]:
    """Each row's parents (None: a chain) from a header's tree section (see encode)."""
    trees, at = [], b
    for n in section[:b]:
        trees.append(section[at:at + n - 1] if n else None)
        at += max(n - 1, 0)
    return trees


def run_step(runner: Runner, meta: list[int], payload: torch.Tensor, hidden: bool, aux: bool = False):
    """One pass from its header, the same on every rank: rank 0 gets Runner.forward's result,
    followers None (or (None, h)). `aux` is rank 0's alone: the residual stream is whole and
    the same on every rank after each all-reduce, so capturing it there costs no collective
    and the followers' pass stays as it is."""
    _, b, width, num_updates, max_kv, num_src, last_only, num_layers, num_tree, num_moves = meta
    rows, lens, q_lens, ids, src, tree, moves, updates = payload.split(
        [b, b, b, b * width, max(num_src, 0), num_tree, 2 * num_moves, 3 * num_updates])
    if num_moves and runner.kv.moved is None:  # a follower repeats rank 0's copies (rank 0 made them)
        runner.kv.copy_slots(moves[:num_moves].tolist(), moves[num_moves:].tolist())
    if num_updates:
        runner.kv.apply_updates(updates.view(3, num_updates))
    dev = runner.device
    rows, lens, q_lens = rows.to(dev), lens.to(dev), q_lens.to(dev)
    mask = None
    if num_tree:  # rotary positions by depth, as Runner.forward sets them for a tree
        depth, mask = tree_layout(decode_trees(tree.tolist(), b), width, dev)
    else:
        depth = torch.arange(width, device=dev)
    ctx = AttnContext(rows, lens, q_lens, lens[:, None] + depth, width, max_kv, src.to(dev) if num_src >= 0 else None,
                      runner.kv.tables)
    ctx.tree_mask = mask
    ctx.splits = runner._splits(b, width, max_kv)
    return runner.run(ids.view(b, width).to(dev), ctx, bool(last_only), num_layers or None, hidden, aux)


class ParallelRunner(Runner):
    """Rank 0's target runner: every pass is announced to the followers, then run here."""

    # the pass header describes one padded block: with mixed_prefill the engine runs this
    # runner's prefill and verify as separate steps
    can_mix = False

    def __init__(self, model, kv: KVCache, attention: str, group: Group):
        super().__init__(model, kv, attention)  # no CUDA graphs: their collectives are not captured yet
        self.group = group
        kv.moved = []  # tree paths' KV copies, for the followers (encode)
        with self._failures():
            group.broadcast_header(torch.tensor([kv.scratch_block, kv.block_size, kv.max_rows, kv.max_tokens,
                                                 int(kv.k.dtype == fp8.FP8)]))

    def calibrate(self, token_ids: list[int]) -> None:
        """As Runner.calibrate, on every rank: each gets the same scales (cluster.engine.worker.fp8)."""
        with self._failures():
            self.group.broadcast_header(torch.tensor([CALIBRATE, len(token_ids)] + [0] * (META - 2)))
            self.group.broadcast_header(torch.tensor(token_ids, dtype=torch.int64))
            super().calibrate(token_ids)

    @torch.inference_mode()
    def forward(self, rows, cache_lens, tokens, last_only, num_layers=None, trees=None, hidden=False, aux=False):
        """As Runner.forward; `aux`: rank 0's capture of the aux layers' inputs (the residual
        stream, replicated on every rank), as one process captures them."""
        meta, payload = encode(self.kv.take_updates(), rows, cache_lens, tokens, last_only, num_layers, trees,
                               self.kv.moved)
        self.kv.moved.clear()
        with self._failures():
            self.group.broadcast_header(meta)
            self.group.broadcast_header(payload)
            return run_step(self, meta.tolist(), payload, hidden, aux)

    def forward_mixed(self, verify, prefill, trees=None):
        raise NotImplementedError("a tensor-parallel pass is one padded block (can_mix is False)")

    @torch.inference_mode()
    def decode(self, rows, cache_lens, tokens: torch.Tensor) -> torch.Tensor:
        return self.forward(rows, cache_lens, [[t] for t in tokens.tolist()], last_only=True)

    def close(self) -> None:
        """Stop the followers (where they still listen) and leave the group."""
        try:
            if all(p.is_alive() for p in self.group.procs):
                self.group.broadcast_header(torch.tensor([STOP] + [0] * (META - 1)))
        except (RuntimeError, dist.DistError):
            pass
        for p in self.group.procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
        self.group.close()

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
        group = init_group(0, size, addr, port, cfg.device, step_timeout_s)
    except BaseException:
        for p in procs:
            p.terminate()
        raise
    group.procs = procs
    return group


def follow(rank: int, size: int, port: int, target: str, cfg, step_timeout_s: float,
           addr: str = "127.0.0.1") -> KVCache:
    """A follower rank's whole life: join, load its shard, mirror rank 0's passes until STOP.
    Returns its KV cache as STOP left it (its scales, for a caller that checks them)."""
    from cluster.engine.worker.loader import load_model

    torch.set_num_threads(max(1, torch.get_num_threads() // size))  # on a CPU the ranks share the host's cores
    group = init_group(rank, size, addr, port, cfg.device, step_timeout_s)
    try:
        model = load_model(target, getattr(torch, cfg.dtype), group.device, group)  # float32, bfloat16, ...
        s = model.shape
        setup = group.broadcast_header(torch.zeros(SETUP, dtype=torch.int64)).tolist()
        blocks, block_size, max_rows, max_tokens, is_fp8 = setup
        dtype = fp8.FP8 if is_fp8 else next(model.parameters()).dtype
        kv = KVCache(s.layers, blocks, block_size, s.kv_heads, s.head_dim, dtype, group.device,
                     max_rows, max_tokens, prefix_caching=False)
        runner = Runner(model, kv, cfg.attention)
        meta = torch.zeros(META, dtype=torch.int64)
        with torch.inference_mode():
            while True:
                m = group.broadcast_header(meta).tolist()
                if m[0] == STOP:
                    break
                payload = group.broadcast_header(torch.empty(payload_len(m), dtype=torch.int64))
                if m[0] == CALIBRATE:
                    runner.calibrate(payload.tolist())
                else:
                    run_step(runner, m, payload, hidden=False)
    finally:
        group.close()
    return kv
