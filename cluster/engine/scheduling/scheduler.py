"""Admission, KV blocks and the choice of what runs next.

Prefill chunks go first (they bound time to first token); otherwise every running sequence
takes one verify row of gamma+1 tokens. With mixed_prefill both share one step and one pass
(Runner.forward_mixed: each a segment padded only to its own width, so a 256-token chunk does
not pad 5-token verify rows and the weights are read once): the verify rows first, with their
full gammas, the chunks within what they leave of the budget; where the rows would take it
all the step prefills only, so prompts are never starved. A step
is measured in verify tokens (sum of gamma+1 over rows plus prefill tokens) under
`max_batch_tokens`: that is speculation-aware batching, so a batch with long drafts holds
fewer sequences than one decoding plainly.

Blocks are taken as tokens arrive: before a step each row's table grows to hold what the
step writes (its chunk, or gamma+1 tokens plus one spare for a decode step launched ahead;
two speculative steps' worth where they launch ahead), and after it shrinks back to what the
accepted tokens need, so rejected drafts give their blocks back. When the pool runs dry the newest running sequence is preempted: its blocks go
back (its full blocks stay cached, so coming back often costs little) and it waits at the
head of the queue to be recomputed. Its tokens so far are kept, so preemption never changes
what it emits.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from cluster.engine.config import EngineConfig
from cluster.engine.scheduling.kv_cache import KVCache
from cluster.engine.scheduling.sequence import Sequence, Status


Rows = list[tuple[Sequence, int]]  # (sequence, gamma) verify rows, or (sequence, length) chunks


class QueueFull(RuntimeError):
    """The admission queue is at its bound; the caller should answer RESOURCE_EXHAUSTED."""


class Scheduler:
    def __init__(self, cfg: EngineConfig, kv: KVCache, mixed: bool | None = None):
        self.cfg = cfg
        self.kv = kv
        # prompt chunks and verify rows in one step (cfg.mixed_prefill, where the runner can)
        self.mixed = cfg.mixed_prefill if mixed is None else mixed
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.preemptions = 0
        self.prefix_hit_tokens = 0
        # positions a verify row needs past its cache for speculative steps launched ahead (two
        # steps in flight: cluster.engine.spec.ahead); set by an engine that runs them
        self.ahead_room = 0

    def add(self, seq: Sequence) -> None:
        # free batch places count as room: a burst that arrives before the next step admits
        # anything must not be refused while the batch is empty (max_num_seqs + max_waiting
        # requests are held, whatever the timing)
        free = max(0, self.cfg.max_num_seqs - len(self.running))
        if len(self.waiting) >= self.cfg.max_waiting + free:
            raise QueueFull(f"admission queue full ({self.cfg.max_waiting} waiting)")
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.running:
            self.running.remove(seq)
        self._free(seq)
        seq.status = Status.FINISHED

    def _free(self, seq: Sequence) -> None:
        if seq.kv is not None:
            self.kv.close(seq.kv)
            seq.kv = None

    def preempt(self, seq: Sequence) -> None:
        """Give the sequence's blocks back; it is recomputed when blocks allow."""
        self.running.remove(seq)
        self._free(seq)
        seq.num_cached, seq.reserve = 0, 0
        seq.status = Status.WAITING
        seq.stats.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(seq)

    def _room(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow seq's blocks to `num_tokens` positions, preempting running sequences newer
        than it, newest first, as needed. False: not even that frees enough."""
        while (need := self.kv.blocks_needed(seq.kv, num_tokens)) > self.kv.pool.num_free:
            newer = self.running[self.running.index(seq) + 1:]
            if not newer:
                return False
            self.preempt(newer[-1])
        if need:
            self.kv.grow(seq.kv, num_tokens)
        return True

    def _admit(self) -> None:
        """Waiting sequences take a row and their cached prefix while the batch has room and
        the pool has blocks for their first chunk (admission never preempts)."""
        while self.waiting and len(self.running) < self.cfg.max_num_seqs:
            seq = self.waiting[0]
            h = self.kv.open()
            if h is None:
                return
            hit = self.kv.match_prefix(h, seq.token_ids)
            first = min(hit + self.cfg.prefill_chunk, seq.prefill_target) + 1
            if self.kv.blocks_needed(h, first) > self.kv.pool.num_free:
                self.kv.close(h)
                return
            self.waiting.popleft()
            seq.kv, seq.num_cached, seq.status = h, hit, Status.RUNNING
            if not seq.num_output:  # a first admission, not a return from preemption
                seq.stats.prefix_hit_tokens = hit
                self.prefix_hit_tokens += hit
            self.running.append(seq)

    def schedule(self, gammas: Callable[[], dict[str, int]]) -> tuple[Rows, Rows]:
        """(verify rows, prefill chunks) for the next step: chunks alone, rows alone, or with
        mixed_prefill both. `gammas` is asked only where rows are scheduled."""
        if not self.mixed or not any(s.prefilled for s in self.running):
            chunks = self.schedule_prefill()
            return ([], chunks) if chunks else (self.schedule_verify(gammas()), [])
        if not self.waiting and all(s.prefilled for s in self.running):
            return self.schedule_verify(gammas()), []
        g = gammas()
        if sum(x + 1 for x in g.values()) >= self.cfg.max_batch_tokens:  # no room for a chunk
            chunks = self.schedule_prefill()
            return ([], chunks) if chunks else (self.schedule_verify(g), [])
        rows = self.schedule_verify(g)
        chunks = self.schedule_prefill(self.cfg.max_batch_tokens - sum(x + 1 for _, x in rows))
        # a chunk's blocks may have preempted a newer row already scheduled
        return [(s, x) for s, x in rows if s.kv is not None], chunks

    def schedule_prefill(self, budget: int | None = None) -> list[tuple[Sequence, int]]:
        """(sequence, chunk length) for sequences still catching up on their prompt, within
        `budget` tokens (None: the step's whole budget)."""
        self._admit()
        budget, out = self.cfg.max_batch_tokens if budget is None else budget, []
        for seq in list(self.running):
            if seq.prefilled or seq.kv is None:  # preempted for an earlier chunk
                continue
            n = min(self.cfg.prefill_chunk, seq.prefill_target - seq.num_cached, budget)
            if n <= 0:
                break
            # the chunk and the token sampled after it (a fresh prompt's first output)
            if not self._room(seq, seq.num_cached + n + 1):
                break
            out.append((seq, n))
            budget -= n
        return [(s, n) for s, n in out if s.kv is not None]

    def schedule_verify(self, gammas: dict[str, int]) -> list[tuple[Sequence, int]]:
        """(sequence, gamma) rows whose gamma+1 tokens fit the budget (gammas shrink to fit
        it) and the pool (the newest sequences are preempted to fit it)."""
        rows = [s for s in self.running if s.prefilled]
        live = len(rows)
        budget = self.cfg.max_batch_tokens
        if len(rows) > budget:  # more sequences than tokens: plain decoding for a budget's worth
            rows = rows[:budget]
        need = sum(gammas[s.seq_id] + 1 for s in rows)
        cap = None
        if need > budget:
            cap = max(0, budget // len(rows) - 1)
        out, preempted = [], self.preemptions
        ahead = self.ahead_room if any(gammas[s.seq_id] for s in rows) else 0  # a step's rows share one width
        for s in rows:
            if s.kv is None:  # preempted to make room for an older row
                continue
            g = gammas[s.seq_id] if cap is None else min(cap, gammas[s.seq_id])
            # g + 1 positions written, and one spare for a plain step launched ahead. Short of
            # blocks, newer sequences make way, then this one: gamma never shrinks for memory,
            # so a seeded request's draws do not depend on the pool
            if not self._room(s, s.num_cached + max(g + 1, 2, ahead)):
                self.preempt(s)
                continue
            out.append((s, g))
        if self.preemptions != preempted:
            out = [(s, g) for s, g in out if s.kv is not None]
            live = sum(1 for s in self.running if s.prefilled)
        # rotate so a budget-limited subset does not starve the tail
        if len(out) < live:
            done = {s.seq_id for s, _ in out}
            self.running = [s for s in self.running if s.seq_id not in done] + [s for s, _ in out]
        return out

    def settle(self, seq: Sequence) -> None:
        """After a step: name the blocks that are now final, give back what drafts held."""
        if seq.kv is None:
            return
        self.kv.commit(seq.kv, seq.token_ids, seq.num_cached)
        self.kv.shrink(seq.kv, len(seq.token_ids) + 1 + seq.reserve)
