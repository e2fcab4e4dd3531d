"""Admission, slots and the choice of what runs next.

Prefill chunks go first (they bound time to first token); otherwise every running sequence
takes one verify row of gamma+1 tokens. A step is measured in verify tokens (sum of gamma+1
over rows plus prefill tokens) under `max_batch_tokens`: that is speculation-aware batching,
so a batch with long drafts holds fewer sequences than one decoding plainly.
"""

from __future__ import annotations

from collections import deque
from cluster.engine.config import EngineConfig
from cluster.engine.kv_cache import KVCache
from cluster.engine.sequence import Sequence, Status


class QueueFull(RuntimeError):
    """The admission queue is at its bound; the caller should answer RESOURCE_EXHAUSTED."""


class Scheduler:
    def __init__(self, cfg: EngineConfig, kv: KVCache):
        self.cfg = cfg
        self.kv = kv
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        if len(self.waiting) >= self.cfg.max_waiting:
            raise QueueFull(f"admission queue full ({self.cfg.max_waiting} waiting)")
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.running:
            self.running.remove(seq)
        if seq.slot is not None:
            self.kv.free(seq.slot)
            seq.slot = None
        seq.status = Status.FINISHED

    def _admit(self) -> None:
        while self.waiting and self.kv.free_slots:
            seq = self.waiting.popleft()
            seq.slot = self.kv.allocate()
            seq.status = Status.RUNNING
            if self.kv.prefix is not None:
                loaded = self.kv.prefix.load(seq.prompt_ids, seq.slot)
                seq.num_cached = min(loaded, seq.num_prompt - 1)  # recompute >= 1 token for logits
                seq.stats.prefix_hit_tokens = seq.num_cached
            self.running.append(seq)

    def schedule_prefill(self) -> list[tuple[Sequence, int]]:
        """(sequence, chunk length) for sequences still catching up on their prompt."""
        self._admit()
        budget, out = self.cfg.max_batch_tokens, []
        for seq in self.running:
            if seq.prefilled:
                continue
            n = min(self.cfg.prefill_chunk, seq.num_prompt - seq.num_cached, budget)
            if n <= 0:
                break
            out.append((seq, n))
            budget -= n
        return out

    def schedule_verify(self, gammas: dict[str, int]) -> list[tuple[Sequence, int]]:
        """(sequence, gamma) rows whose gamma+1 tokens fit the budget; gammas shrink first."""
        rows = [s for s in self.running if s.prefilled]
        budget = self.cfg.max_batch_tokens
        if len(rows) > budget:  # more sequences than tokens: plain decoding for a budget's worth
            rows = rows[:budget]
        need = sum(gammas[s.seq_id] + 1 for s in rows)
        cap = None
        if need > budget:
            cap = max(0, budget // len(rows) - 1)
        out = []
        for s in rows:
            g = gammas[s.seq_id] if cap is None else min(cap, gammas[s.seq_id])
            out.append((s, g))
        # rotate so a budget-limited subset does not starve the tail
        if len(rows) < len([s for s in self.running if s.prefilled]):
            self.running = self.running[len(rows):] + self.running[:len(rows)]
        return out
