"""Custom Ray Serve (2.60) autoscaling policies for the verifier and drafter pools.

How it plugs into Serve
-----------------------
A deployment's `autoscaling_config["policy"]` names the policy:
    {"policy_function": "cluster.policy.autoscaling:VerifierPolicy",
     "policy_kwargs": {"target_verify_tokens": 512, "tolerance": 0.1}}
Serve instantiates a class policy once with `policy_kwargs` and calls it every control
tick with an `AutoscalingContext`; it returns `(replicas, state)`. Serve itself then
applies `upscale_delay_s`/`downscale_delay_s`, up/downscaling factors and the min/max
bounds, so the policies here only say how many replicas the load needs.
`VerifierScaling.serve_autoscaling_config()` in config.py builds the whole dict.

How replicas report the metric
------------------------------
Serve calls a method named exactly `record_autoscaling_stats` on the deployment class
(sync or async, no arguments, on the replica's event loop, so it must be cheap) every
`min(0.2 * look_back_period_s, metrics_interval_s)` seconds. It returns
`Dict[str, float]`; anything else disables custom metrics for that replica. Serve keeps
the values for `look_back_period_s` and hands the policy their time-weighted mean as
`ctx.aggregated_metrics[name][replica_id]`. The meters below compute the values:

    # Verifier deployment
    self._load = VerifyLoadMeter()
    ... after each verify pass: self._load.note_step(obs.verify_tokens)
    def record_autoscaling_stats(self) -> dict[str, float]:
        return self._load.report()          # {"verify_tokens": mean tokens per pass}

    # Drafter deployment
    self._demand = DraftDemandMeter()
    ... in each batched propose call: self._demand.note_call(caller, sum(k_i))
    def record_autoscaling_stats(self) -> dict[str, float]:
        return self._demand.report()        # {"draft_tokens": sum of gamma, live callers}

`caller` is any stable id of the calling verifier replica (it sends one propose call per
step for its whole batch, so its latest sum(k_i) is its current draft demand). When
speculation is off nobody calls, callers expire, demand reads 0 and the pool shrinks to
min_replicas.

This module imports nothing from `cluster`: Serve pickles it by value into the Serve
controller actor, which may not have the project's package on its path (checked: the
pickled policy runs in a process where `import cluster` fails).
"""

from __future__ import annotations

import math
import time
from typing import Any, Dict, Mapping, Optional, Tuple

VERIFY_TOKENS_METRIC = "verify_tokens"
DRAFT_TOKENS_METRIC = "draft_tokens"


# --- pure decision core (plain numbers, no Ray) ---------------------------------------
def total_load(per_replica: Mapping[Any, float], num_running: int) -> Optional[float]:
    """Load of the whole pool, or None with no reports yet.

    Replicas that have not reported (just started) are assumed to carry the mean of
    those that have, so a new replica does not look like a drop in load.
    """
    if not per_replica:
        return None
    values = [max(0.0, float(v)) for v in per_replica.values()]
    return sum(values) / len(values) * max(num_running, len(values))


def desired_replicas(load: float, target_per_replica: float, current: int,
                     min_replicas: int, max_replicas: int, tolerance: float = 0.1) -> int:
    """Replicas needed so each carries about `target_per_replica`.

    Inside the dead band (load within `tolerance` of what `current` replicas are meant
    to carry) the count is held, so noise around a boundary does not flap N <-> N+1.
    """
    need = load / target_per_replica
    if current > 0 and current * (1 - tolerance) <= need <= current * (1 + tolerance):
        n = current
    else:
        n = math.ceil(need - 1e-9)
    return max(min_replicas, min(max_replicas, n))


def _scale(ctx, metric: str, target: float, tolerance: float,
           floor: Optional[int] = None) -> Tuple[int, Dict[str, Any]]:
    metrics = ctx.aggregated_metrics or {}
    load = total_load(metrics.get(metric, {}), ctx.current_num_replicas)
    if load is None:  # nothing reported yet: hold rather than guess
        return ctx.target_num_replicas, {"load": None}
    n = desired_replicas(load, target, ctx.target_num_replicas,
                         ctx.capacity_adjusted_min_replicas,
                         ctx.capacity_adjusted_max_replicas, tolerance)
    if floor is not None:
        n = max(n, min(floor, ctx.capacity_adjusted_max_replicas))
    return n, {"load": load, "desired": n}


# --- Serve policies ---------------------------------------------------------------------
class VerifierPolicy:
    """Scales verifiers on verify tokens per pass against `target_verify_tokens` each.

    `target_sequences`, if set, adds a floor from Serve's own ongoing-request count: a
    replica whose batch is capped cannot show its queue in its token count.
    """

    def __init__(self, target_verify_tokens: float = 512.0, tolerance: float = 0.1,
                 target_sequences: Optional[float] = None):
        self.target = float(target_verify_tokens)
        self.tolerance = float(tolerance)
        self.target_sequences = target_sequences

    def __call__(self, ctx) -> Tuple[int, Dict[str, Any]]:
        floor = None
        if self.target_sequences:
            floor = math.ceil(ctx.total_num_requests / self.target_sequences - 1e-9)
        return _scale(ctx, VERIFY_TOKENS_METRIC, self.target, self.tolerance, floor)


class DrafterPolicy:
    """Scales drafters on draft demand (sum of gamma over active sequences)."""

    def __init__(self, target_draft_tokens: float = 256.0, tolerance: float = 0.1):
        self.target = float(target_draft_tokens)
        self.tolerance = float(tolerance)

    def __call__(self, ctx) -> Tuple[int, Dict[str, Any]]:
        return _scale(ctx, DRAFT_TOKENS_METRIC, self.target, self.tolerance)


def verifier_policy(ctx) -> Tuple[int, Dict[str, Any]]:
    """`VerifierPolicy` with default targets, for `policy_function` without kwargs."""
    return VerifierPolicy()(ctx)


def drafter_policy(ctx) -> Tuple[int, Dict[str, Any]]:
    """`DrafterPolicy` with default targets, for `policy_function` without kwargs."""
    return DrafterPolicy()(ctx)


# --- replica-side meters (what record_autoscaling_stats returns) -----------------------
class VerifyLoadMeter:
    """Mean verify tokens per pass since the reader's last report; 0 when idle.

    Each reader (Serve's autoscaling, the request router's stats, GetStats) has its own
    window: with one shared window a read by one emptied it for the next, which then read
    0 under full load.
    """

    def __init__(self, readers: tuple[str, ...] = ("autoscaling",)):
        self._acc = {r: [0, 0] for r in readers}  # reader -> [tokens, steps]

    def note_step(self, verify_tokens: int) -> None:
        for acc in self._acc.values():
            acc[0] += verify_tokens
            acc[1] += 1

    def report(self, reader: str = "autoscaling") -> Dict[str, float]:
        tokens, steps = self._acc.get(reader, (0, 0))
        self._acc[reader] = [0, 0]
        return {VERIFY_TOKENS_METRIC: float(tokens / steps if steps else 0.0)}


class DraftDemandMeter:
    """Sum over live callers of each caller's latest per-step draft tokens.

    A caller silent for `expire_s` (finished, switched speculation off, moved to another
    drafter) no longer counts.
    """

    def __init__(self, expire_s: float = 2.0):
        self.expire_s = expire_s
        self._latest: Dict[str, Tuple[float, int]] = {}

    def note_call(self, caller: str, draft_tokens: int, now: Optional[float] = None) -> None:
        self._latest[caller] = (time.monotonic() if now is None else now, draft_tokens)

    def report(self, now: Optional[float] = None) -> Dict[str, float]:
        now = time.monotonic() if now is None else now
        self._latest = {c: v for c, v in self._latest.items() if now - v[0] <= self.expire_s}
        return {DRAFT_TOKENS_METRIC: float(sum(v[1] for v in self._latest.values()))}
