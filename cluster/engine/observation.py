"""What one verifier step did: the engine reports it; the speculation controller, metrics and
autoscaling read it. Defined here, beside the engine that fills it, so the policy layer
depends on the engine and never the other way round."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StepObservation:
    """One verify step; reported to `Controller.observe` after the verify pass."""

    batch_size: int  # sequences in the verify pass
    gamma: int  # gamma the controller chose for this step (auto sequences)
    verify_tokens: int  # sum over sequences of gamma_i + 1, plus prefill tokens
    verify_s: float  # seconds of the target pass
    draft_s: float  # seconds waiting on the drafter (0 if fully overlapped)
    drafted: int  # draft tokens proposed in total (sum of gamma_i)
    accepted_per_position: list[int] = field(default_factory=list)  # [j]: seqs accepting j
    proposed_per_position: list[int] = field(default_factory=list)  # [j]: seqs proposing j
    # A plain step launched while the one before it ran (cluster.engine.worker.pipeline): its cost
    # is what plain decoding costs once sustained, less than a lone plain step's.
    pipelined: bool = False
    # Wall seconds of the whole step as the engine loop lives it: from the end of the step
    # before (the caller's work in between included) through this step's outputs. Host work
    # (accepting, detokenizing, streaming) hides behind the GPU in a pipelined plain step and
    # adds to a speculative one; what throughput is made of. 0: not measured.
    step_s: float = 0.0
    captured: bool = False  # the step captured a CUDA graph: its time is not a step's cost
    # prompt tokens prefilled in the same pass (a mixed step, Scheduler.schedule): verify_s
    # and step_s include their cost, so the step's time is not what speculating costs
    prefill_tokens: int = 0


def observation(batch: int, verify_tokens: int, verify_s: float, draft_s: float,
                num_draft: list[int], num_acc: list[int], pipelined: bool = False) -> StepObservation:
    """From per-row draft and acceptance counts: how many rows proposed / accepted position j."""
    g = max(num_draft, default=0)
    return StepObservation(batch, g, verify_tokens, verify_s, draft_s, sum(num_draft),
                           [sum(a > j for a in num_acc) for j in range(g)],
                           [sum(d > j for d in num_draft) for j in range(g)], pipelined)


def engine_stats(engine) -> dict:
    """Engine.stats(): the KV pool's figures and the engine's counts (metrics, the stats RPC)."""
    pool, t, sch = engine.kv.pool, engine.totals, engine.scheduler
    ahead = engine.spec_ahead
    return {"running": len(sch.running), "waiting": len(sch.waiting),
            "kv_slots_used": engine.kv.rows_used, "kv_slots_total": engine.kv.max_rows,
            "kv_blocks_total": pool.num_blocks, "kv_blocks_used": pool.num_used,
            "kv_blocks_cached": pool.num_cached_free, "preemptions": sch.preemptions,
            "prefix_hit_tokens": sch.prefix_hit_tokens, "prefix_queries": pool.stats.queries,
            "prefix_hits": pool.stats.hits, "prefix_hit_rate": pool.stats.hit_rate,
            "acceptance_rate": t["accepted"] / t["drafted"] if t["drafted"] else 0.0, **t,
            **engine.planner.counts, "spec_ahead_hits": ahead.hits if ahead else 0,
            "spec_ahead_fresh": ahead.fresh if ahead else 0}
