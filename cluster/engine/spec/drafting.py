"""Per-step drafting: one propose call per drafter for the whole batch.

Each request carries what its drafter reads (Drafter.reads_hidden, reads_target_kv), so no
drafter reaches into the engine.

For a drafter that can work while the target verifies (`Drafter.look_ahead`), the next
step's drafts are asked for during this step's verify pass, on the assumption that every
draft is accepted and the bonus token is the drafter's own next guess: the request is
`tokens + drafts` for gamma + 1 tokens, whose first is that guess. When the verify pass
bears the assumption out, the next step starts with its drafts already in hand; otherwise
they are dropped and drafted fresh. Either way the verifier decides every token, so the
guess only ever costs time.

For a drafter in another process ("gated") a miss costs only if the guessed call is still
running when the verify pass ends: the fresh call waits for it (the replica serves calls in
order). So looking ahead stays on while what hits save pays for what misses wait:
hit rate x (wait for a fresh draft) >= miss rate x (wait for a guessed reply that then
missed), each an average per drafter, re-tried every `probe_every` steps when off. (A gate on
the hit rate alone turned it off where it paid: benchmarks/serve_gpu/h100_8b_lookahead_gate.)

A drafter on its own CUDA stream ("free") drafts while the host would only wait for the
verify pass, so it looks ahead whenever it drafts a single row; with several rows it cost
more than it saved (benchmarks/gpu/h100).
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from cluster.engine.drafters.base import Drafter, DraftOutput, DraftRequest, PendingDrafts, spread
from cluster.engine.scheduling.sequence import Sequence

log = logging.getLogger(__name__)


@dataclass
class _Ahead:
    future: Future
    rows: dict[str, tuple[int, int]] = field(default_factory=dict)  # seq_id -> (row in reply, tokens assumed)


def _ewma(d: dict[str, float], key: str, x: float, start: float, w: float = 0.1) -> None:
    v = d.get(key, start)
    d[key] = v + w * (x - v)


class DraftPlanner:
    def __init__(self, drafters: dict[str, Drafter], default: str | None, probe_every: int = 64):
        self.drafters, self.default = drafters, default
        self.ahead: dict[str, _Ahead] = {}
        # draft_compute_s: the drafter's own seconds in the calls whose replies steps took,
        # look-ahead ones included (against draft_s it shows a remote drafter's round trips)
        # drafts_on_device: steps whose drafts fed the verify pass on the device (`launch`)
        self.counts = {"ahead_hits": 0, "ahead_misses": 0, "draft_failures": 0, "draft_compute_s": 0.0,
                       "drafts_on_device": 0}
        # per drafter, averages (EWMA) that gate a "gated" look-ahead: hits per row (from 1.0),
        # seconds waiting for a fresh call, seconds waiting for a guessed reply that missed
        self.hit_rate: dict[str, float] = {}
        self.fresh_s: dict[str, float] = {}
        self.wasted_s: dict[str, float] = {}
        self.probe_every = probe_every
        self.steps = 0

    @staticmethod
    def _groups(rows: list[tuple[Sequence, int]], default: str | None) -> dict[str, list[int]]:
        """Drafter name -> the rows (indices) it drafts this step."""
        groups: dict[str, list[int]] = {}
        for b, (s, g) in enumerate(rows):
            if g > 0:
                groups.setdefault(s.drafter or default, []).append(b)
        return groups

    def lag(self, seqs: list[Sequence]) -> int:
        """Tokens the drafters would run over before they could draft for every row of `seqs`
        (Drafter.lag): what turning speculation on costs after plain steps."""
        groups = self._groups([(s, 1) for s in seqs], self.default)
        return sum(self.drafters[name].lag([(seqs[b].seq_id, seqs[b].token_ids) for b in idx])
                   for name, idx in groups.items() if name in self.drafters)

    def start(self, rows: list[tuple[Sequence, int]], on_device: bool
              ) -> tuple[DraftOutput | None, PendingDrafts | None]:
        """(this step's drafts, None), or with `on_device` where it can (None, the drafts left
        on the device: `launch`)."""
        launched = self.launch(rows) if on_device else None
        if launched is not None and not any(launched.counts):
            return launched.finish(), None
        return (self.draft(rows), None) if launched is None else (None, launched)

    def launch(self, rows: list[tuple[Sequence, int]]) -> PendingDrafts | None:
        """This step's drafts left on the device for the verify pass to read there, where
        one drafter drafts every drafting row and can (Drafter.launch): the host then waits
        for drafts and verify pass together, once. None: `draft` instead (several drafters,
        another process's, a look-ahead's drafts in hand or one to ask for at batch 1)."""
        groups = self._groups(rows, self.default)
        if len(groups) != 1:
            return None
        (name, idx), = groups.items()
        d = self.drafters[name]
        if name in self.ahead or (d.look_ahead == "free" and len(idx) == 1):
            return None
        n = len(rows)
        try:
            pending = d.launch([self._request(d, rows[b]) for b in idx])
        except Exception as e:  # the drafter is disposable: plain decoding for these rows
            self.counts["draft_failures"] += 1
            log.warning("drafter %s failed (%s); decoding without drafts this step", name, e)
            self.steps += 1
            empty = DraftOutput([[] for _ in rows], [None] * n, [None] * n)
            return PendingDrafts(torch.full((n, 0), -1, dtype=torch.int64), [0] * n, None, lambda: empty)
        if pending is None:
            return None
        counts = [0] * n
        for j, b in enumerate(idx):
            counts[b] = pending.counts[j]
        ids = spread(pending.device_ids(), idx, n)  # this stream waits for the drafts: the verify pass reads them

        def finish() -> DraftOutput:
            t = time.perf_counter()
            res = pending.finish()
            launched.waited = time.perf_counter() - t
            self.counts["draft_compute_s"] += res.seconds
            out = DraftOutput([[] for _ in rows], [None] * n, [None] * n)
            for j, b in enumerate(idx):
                self._fill(out, b, res, j, 0, rows[b][1])
                rows[b][0].aux = None
            return out

        self.steps += 1
        self.counts["drafts_on_device"] += any(counts)
        launched = PendingDrafts(ids, counts, None, finish)
        return launched

    def draft(self, rows: list[tuple[Sequence, int]]) -> DraftOutput:
        n = len(rows)
        out = DraftOutput([[] for _ in rows], [None] * n, [None] * n)
        groups = self._groups(rows, self.default)
        fresh = {name: self._take_ahead(name, idx, rows, out) for name, idx in groups.items()}
        calls = {name: self.drafters[name].propose_async([self._request(self.drafters[name], rows[b]) for b in idx])
                 for name, idx in fresh.items() if idx}
        for name, fut in calls.items():
            t = time.perf_counter()
            res = self._result(name, fut)
            _ewma(self.fresh_s, name, time.perf_counter() - t, start=0.0)
            if res is not None:
                unread = res.unread or [False] * len(fresh[name])
                for j, b in enumerate(fresh[name]):
                    self._fill(out, b, res, j, 0, rows[b][1])
                    if not unread[j]:
                        rows[b][0].aux = None  # the drafter has these aux states now
        self.steps += 1
        return out

    def drop_ahead(self, name: str) -> None:
        """Forget a look-ahead's guessed drafts for drafter `name` (a step that drafts on the
        device its own way, cluster.engine.spec.ahead, makes them stale)."""
        self.ahead.pop(name, None)

    def ask_ahead(self, rows: list[tuple[Sequence, int]], out: DraftOutput) -> None:
        """Call once this step's verify pass is launched: the next step's drafts, guessed."""
        probe = self.steps % self.probe_every == 0
        groups = self._groups(rows, self.default)
        for name, idx in groups.items():
            mode = self.drafters[name].look_ahead
            gated = probe or self._pays(name)
            if (mode == "free" and len(idx) == 1) or (mode == "gated" and gated):
                self._ask_ahead(name, idx, rows, out)

    def _pays(self, name: str) -> bool:
        hit = self.hit_rate.get(name, 1.0)
        return hit * self.fresh_s.get(name, 0.0) >= (1 - hit) * self.wasted_s.get(name, 0.0)

    @staticmethod
    def _request(drafter: Drafter, row: tuple[Sequence, int]) -> DraftRequest:
        s, g = row
        req = DraftRequest(s.seq_id, s.token_ids, g, s.params)
        if drafter.reads_hidden and s.hidden is not None and s.hidden[0] == len(s.token_ids):
            req.hidden = s.hidden[1]  # fresh: taken at this length (Sequence.hidden)
        if drafter.reads_target_kv:
            req.target_kv = (s.kv.row, s.num_cached)
        if drafter.aux_layers and s.aux is not None:
            req.aux_start, req.aux = s.aux
        return req

    @staticmethod
    def _fill(out: DraftOutput, b: int, res: DraftOutput, j: int, start: int, g: int) -> None:
        out.tokens[b] = res.tokens[j][start:start + g]
        out.q_ids[b] = res.q_ids[j][start:start + g]
        out.q_probs[b] = res.q_probs[j][start:start + g]
        if res.parents is not None and res.parents[j] is not None:
            # a prefix of a parents-first tree is a tree; trees are never drafted ahead (start 0)
            out.parents = out.parents or [None] * len(out.tokens)
            out.parents[b] = res.parents[j][:g] if start == 0 else None

    def _result(self, name: str, fut: Future) -> DraftOutput | None:
        try:
            res = fut.result()
            self.counts["draft_compute_s"] += res.seconds
            return res
        except Exception as e:  # the drafter is disposable: plain decoding for these rows
            self.counts["draft_failures"] += 1
            log.warning("drafter %s failed (%s); decoding without drafts this step", name, e)
            return None

    def _take_ahead(self, name: str, idx: list[int], rows, out: DraftOutput) -> list[int]:
        """Use drafts asked for last step where the assumption held; return rows still to draft."""
        ahead = self.ahead.pop(name, None)
        t = time.perf_counter()
        res = self._result(name, ahead.future) if ahead else None
        waited = time.perf_counter() - t
        if res is None:
            return idx
        rest = []
        for b in idx:
            s, g = rows[b]
            j, assumed = ahead.rows.get(s.seq_id, (-1, -1))
            guess = res.tokens[j] if j >= 0 else []
            hit = len(s.token_ids) == assumed + 1 and len(guess) > 1 and guess[0] == s.token_ids[-1]
            if hit:
                self._fill(out, b, res, j, 1, g)
                self.counts["ahead_hits"] += 1
            else:
                rest.append(b)
                self.counts["ahead_misses"] += 1
            _ewma(self.hit_rate, name, float(hit), start=1.0)
        if ahead.rows:
            _ewma(self.wasted_s, name, waited if rest else 0.0, start=0.0)
        return rest

    def _ask_ahead(self, name: str, idx: list[int], rows, out: DraftOutput) -> None:
        reqs, ahead_rows = [], {}
        for b in idx:
            s, g = rows[b]
            if out.tokens[b]:
                ahead_rows[s.seq_id] = (len(reqs), len(s.token_ids) + len(out.tokens[b]))
                reqs.append(DraftRequest(s.seq_id, s.token_ids + out.tokens[b], g + 1, s.params, len(s.token_ids)))
        if reqs:
            self.ahead[name] = _Ahead(self.drafters[name].propose_async(reqs), ahead_rows)
