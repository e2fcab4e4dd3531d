"""Mixed steps: prefill chunks and verify rows in one target pass (EngineConfig.mixed_prefill).

Without it a step prefills or verifies, so every decoding sequence waits out each prefill
step. Here the decoding rows' verify rows and the prompts' chunks share one pass, each a
segment padded only to its own width (Runner.forward_mixed): a 256-token chunk does not pad
5-token verify rows, and the weights are read once for both.

The verify rows are scheduled first, with their full gammas, and the chunks get what they
leave of the step's token budget. Where the rows would take the whole budget the step is
today's prefill step instead, so prompts are never starved. A mixed pass runs eager, so the
plain-decoding pipeline (CUDA graphs, a step ahead) is interrupted as by any eager verify step.
"""

from __future__ import annotations

import time

from cluster.engine.observation import StepObservation, observation
from cluster.engine.scheduling.sequence import Sequence

Rows = list[tuple[Sequence, int]]


class MixedSteps:
    def __init__(self, engine):
        self.engine = engine

    def schedule(self) -> tuple[Rows | None, Rows]:
        """(verify rows, prefill chunks) for this step. Rows None: none scheduled here (the
        engine's own verify step schedules them where there are no chunks)."""
        e = self.engine
        sch, budget = e.scheduler, e.cfg.max_batch_tokens
        if not sch.waiting and all(s.prefilled for s in sch.running):
            return None, []
        if not any(s.prefilled for s in sch.running):
            return None, sch.schedule_prefill()
        gammas = e._gammas()
        if sum(g + 1 for g in gammas.values()) >= budget:  # no room for a chunk: a prefill step
            return None, sch.schedule_prefill()
        rows = sch.schedule_verify(gammas)
        chunks = sch.schedule_prefill(budget - sum(g + 1 for _, g in rows))
        # a chunk's blocks may have preempted a newer row already scheduled
        return [(s, g) for s, g in rows if s.kv is not None], chunks

    def run(self, rows: Rows, chunks: Rows) -> tuple[list[Sequence], StepObservation]:
        """Draft, one pass over both segments, then acceptance for the rows and each finished
        prompt's first token, as a verify step and a prefill step do."""
        e = self.engine
        seqs, pre = [s for s, _ in rows], [s for s, _ in chunks]
        t0 = time.perf_counter()
        drafts = e.planner.draft(rows)
        t1 = time.perf_counter()
        feeds = [[s.token_ids[-1]] + d for s, d in zip(seqs, drafts.tokens)]
        if e.pipeline is not None:
            e.pipeline.interrupt()
        verify = ([s.kv.row for s in seqs], [s.num_cached for s in seqs], feeds)
        prefill = ([s.kv.row for s in pre], [s.num_cached for s in pre],
                   [s.token_ids[s.num_cached:s.num_cached + n] for s, n in chunks])
        v, p = e.runner.forward_mixed(verify, prefill, drafts.parents)
        if any(drafts.tokens):
            e.planner.ask_ahead(rows, drafts)
        accepted, out = e._verified(seqs, drafts, *v)
        first = e._prefilled(chunks, *p)
        t2 = time.perf_counter()
        num_prefill = sum(n for _, n in chunks)
        totals = e.totals
        totals["draft_s"] += t1 - t0
        totals["mixed_s"] += t2 - t1
        totals["mixed_steps"] += 1
        num_draft = [len(d) for d in drafts.tokens]
        obs = observation(len(seqs), sum(map(len, feeds)) + num_prefill, t2 - t1, t1 - t0, num_draft,
                          [len(o) - 1 for o in out])
        # the pass's time includes the chunks': the goodput controller must not take it for
        # what verifying at this gamma costs (Engine._observe skips it); metrics still count its drafts
        obs.prefill_tokens = num_prefill
        return accepted + first, obs
