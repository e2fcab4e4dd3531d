"""Speculation controller: picks gamma (draft tokens per sequence) for each verifier step.

The verifier's loop calls `gamma()` before drafting and `observe()` after verifying. Both
are plain arithmetic on cached numbers (a few microseconds), never block and hold no
locks: one controller belongs to one verifier loop.

Concurrency signal: `max(batch_size, cluster_inflight / num_verifier_replicas)`. The
local batch is what this step's verify pass will cost; the cluster average is where the
batch is heading (the router is already sending that load), so gamma is turned down
before the batch fills rather than one burst late. `cluster_inflight=0` means unknown.

Goodput mode models one step at batch b and gamma g as
    tokens out  = b * E[N|g],  E[N|g] = 1 + sum_{j=1..g} prod_{i<=j} a_i
    step time   = t_verify(b*(g+1) + prefill) + t_draft(b, g)
    t_verify(x) = c0 + c1*x,   t_draft(b, g) = d0 + d1*b*g  (0 when g = 0)
with a_i the acceptance rate of draft position i given all before it were accepted. The
verify cost is one line over tokens, so steps at any gamma teach it the cost at gamma 0
(which speculating steps never see directly) and vice versa.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

from cluster.policy.config import SpeculationPolicyConfig


@dataclass
class StepObservation:
    """What one verifier step did; reported to `Controller.observe` after the verify pass."""

    batch_size: int  # sequences in the verify pass
    gamma: int  # gamma the controller chose for this step (auto sequences)
    verify_tokens: int  # sum over sequences of gamma_i + 1, plus prefill tokens
    verify_s: float  # seconds of the target pass
    draft_s: float  # seconds waiting on the drafter (0 if fully overlapped)
    drafted: int  # draft tokens proposed in total (sum of gamma_i)
    accepted_per_position: list[int] = field(default_factory=list)  # [j]: seqs accepting j
    proposed_per_position: list[int] = field(default_factory=list)  # [j]: seqs proposing j

    @classmethod
    def make_dummy(cls, batch_size: int = 4, gamma: int = 4) -> "StepObservation":
        """A plausible step (acceptance 0.5 per position) for warm-up and tests."""
        accepted, n = [], batch_size
        for _ in range(gamma):
            n //= 2
            accepted.append(n)
        return cls(batch_size, gamma, batch_size * (gamma + 1), 0.010, 0.002,
                   batch_size * gamma, accepted, [batch_size] * gamma)


class Controller(Protocol):
    def gamma(self, batch_size: int, cluster_inflight: int = 0) -> int: ...
    def observe(self, obs: StepObservation) -> None: ...
    def snapshot(self) -> dict: ...
    def set_num_verifier_replicas(self, n: int) -> None: ...


class _Base:
    """Shared concurrency signal; observe is a no-op for modes that do not learn."""

    def __init__(self, cfg: SpeculationPolicyConfig):
        self.cfg = cfg
        self.num_verifier_replicas = 1
        self._last = 0

    def set_num_verifier_replicas(self, n: int) -> None:
        """Called by the verifier when it learns the pool size (e.g. from routing stats)."""
        self.num_verifier_replicas = max(1, int(n))

    def concurrency(self, batch_size: int, cluster_inflight: int) -> float:
        return max(float(batch_size), cluster_inflight / self.num_verifier_replicas)

    def observe(self, obs: StepObservation) -> None:
        pass

    def snapshot(self) -> dict:
        return {"mode": self.cfg.mode, "gamma": self._last}


class StaticController(_Base):
    """off -> 0, fixed -> cfg.gamma."""

    def gamma(self, batch_size: int, cluster_inflight: int = 0) -> int:
        self._last = self.cfg.gamma if self.cfg.mode == "fixed" else 0
        return self._last


class TableController(_Base):
    """Looks gamma up by concurrency; below the first row or above the last, the nearest row."""

    def __init__(self, cfg: SpeculationPolicyConfig):
        super().__init__(cfg)
        self._rows = sorted((r.min_concurrency, r.max_concurrency, r.gamma) for r in cfg.table)

    def gamma(self, batch_size: int, cluster_inflight: int = 0) -> int:
        # Ceil: a fractional cluster average counts as the next whole sequence (conservative).
        c = math.ceil(self.concurrency(batch_size, cluster_inflight))
        g = self._rows[0][2] if c < self._rows[0][0] else self._rows[-1][2]
        for lo, hi, rg in self._rows:
            if lo <= c <= hi:
                g = rg
                break
        self._last = g
        return g


class _LineFit:
    """Exponentially weighted least squares for y = a + b*x, both clamped non-negative."""

    def __init__(self, forget: float):
        self.keep = 1.0 - forget
        self.n = 0
        self.w = self.sx = self.sy = self.sxx = self.sxy = 0.0
        self.a = self.b = 0.0
        self.degenerate = True  # every x (nearly) equal: the slope is unknowable

    def add(self, x: float, y: float) -> None:
        k = self.keep
        self.w = k * self.w + 1.0
        self.sx = k * self.sx + x
        self.sy = k * self.sy + y
        self.sxx = k * self.sxx + x * x
        self.sxy = k * self.sxy + x * y
        self.n += 1
        det = self.w * self.sxx - self.sx * self.sx
        self.degenerate = det <= 1e-4 * self.w * self.sxx
        if self.degenerate:
            self.a, self.b = self.sy / self.w, 0.0  # flat: memory-bound until shown otherwise
            return
        b = (self.w * self.sxy - self.sx * self.sy) / det
        a = (self.sy - b * self.sx) / self.w
        if b < 0.0:  # noise made cost fall with size: treat as flat
            a, b = self.sy / self.w, 0.0
        elif a < 0.0:  # line through the origin instead
            a, b = 0.0, self.sxy / self.sxx
        self.a, self.b = a, b

    def __call__(self, x: float) -> float:
        return self.a + self.b * x


class GoodputController(_Base):
    """Chooses the gamma that maximises expected tokens per second (see module docstring)."""

    def __init__(self, cfg: SpeculationPolicyConfig):
        super().__init__(cfg)
        gmax = cfg.gamma_max
        # Acceptance as decayed counts seeded with prior pseudo-counts: the prior fades
        # as data arrives instead of switching off at a threshold.
        self._acc = [cfg.prior_acceptance * cfg.prior_weight] * gmax
        self._reached = [cfg.prior_weight] * gmax
        self._verify = _LineFit(cfg.cost_alpha)
        self._draft = _LineFit(cfg.cost_alpha)
        self._prefill = 0.0  # EWMA of non-decode tokens per step
        self._steps = 0
        self._last = min(cfg.gamma, gmax)
        self._expected = self._expected_tokens()

    # --- learning -------------------------------------------------------------
    def observe(self, obs: StepObservation) -> None:
        if obs.batch_size <= 0:
            return
        self._steps += 1
        keep, a = 1.0 - self.cfg.alpha, self.cfg.alpha
        prev_accepted = None
        for j in range(min(len(obs.proposed_per_position), self.cfg.gamma_max)):
            # Sequences that reached position j: proposed it and accepted all before it.
            # Exact when the step used one gamma; an upper bound on the denominator otherwise.
            reached = obs.proposed_per_position[j]
            if prev_accepted is not None:
                reached = min(reached, prev_accepted)
            accepted = obs.accepted_per_position[j] if j < len(obs.accepted_per_position) else 0
            prev_accepted = accepted
            if reached > 0:
                self._acc[j] = keep * self._acc[j] + accepted
                self._reached[j] = keep * self._reached[j] + reached
        self._expected = self._expected_tokens()
        self._verify.add(obs.verify_tokens, obs.verify_s)
        extra = max(0, obs.verify_tokens - obs.batch_size - obs.drafted)
        self._prefill = (1 - a) * self._prefill + a * extra
        if obs.drafted > 0:
            self._draft.add(obs.drafted, obs.draft_s)

    def acceptance(self) -> list[float]:
        return [min(1.0, acc / r) for acc, r in zip(self._acc, self._reached)]

    def _expected_tokens(self) -> list[float]:
        """E[N|g] for g = 0..gamma_max."""
        out, run, prod = [1.0], 1.0, 1.0
        for a in self.acceptance():
            prod *= a
            run += prod
            out.append(run)
        return out

    # --- deciding -------------------------------------------------------------
    def _step_time(self, b: float, g: int) -> float:
        cfg = self.cfg
        t_v = self._verify(b * (g + 1) + self._prefill)
        if g == 0:
            return t_v
        if self._draft.n >= cfg.min_observations:
            t_d = self._draft(b * g)
        else:  # prior: g sequential draft passes, each a fraction of a target pass
            t_d = cfg.prior_draft_cost_ratio * g * self._verify(b)
        return max(t_v + t_d, 1e-9)

    def goodput(self, b: float, g: int) -> float:
        """Expected tokens per second at batch b and gamma g under the current model."""
        if self._verify.n < self.cfg.min_observations:
            # No cost data: verify cost flat (the memory-bound premise of speculation).
            return self._expected[g] / (1.0 + self.cfg.prior_draft_cost_ratio * g)
        return b * self._expected[g] / self._step_time(b, g)

    def gamma(self, batch_size: int, cluster_inflight: int = 0) -> int:
        cfg = self.cfg
        if self._verify.n < cfg.min_observations:
            # Start at the configured gamma if the prior predicts a gain, else plain decoding.
            self._last = cfg.gamma if self.goodput(1, cfg.gamma) > self.goodput(1, 0) else 0
            return self._last
        if (cfg.explore_every and self._verify.degenerate
                and self._steps % cfg.explore_every == 0):
            # One probe step at another verify size, so the cost slope becomes measurable.
            return 0 if self._last > 0 else max(1, cfg.gamma)
        b = max(1.0, self.concurrency(batch_size, cluster_inflight))
        best_g, best = self._last, self.goodput(b, self._last)
        current = best
        for g in range(cfg.gamma_max + 1):
            v = self.goodput(b, g)
            if v > best:
                best_g, best = g, v
        if best_g != self._last and best >= current * (1.0 + cfg.hysteresis):
            self._last = best_g
        return self._last

    def snapshot(self) -> dict:
        return {
            "mode": self.cfg.mode,
            "gamma": self._last,
            "acceptance": [round(a, 4) for a in self.acceptance()],
            "expected_tokens": [round(e, 3) for e in self._expected],
            "verify_cost": {"c0": self._verify.a, "c1": self._verify.b, "n": self._verify.n},
            "draft_cost": {"d0": self._draft.a, "d1": self._draft.b, "n": self._draft.n},
            "prefill_tokens": self._prefill,
            "steps": self._steps,
        }


def make_controller(cfg: SpeculationPolicyConfig) -> Controller:
    """The controller for `cfg.mode`."""
    if cfg.mode in ("off", "fixed"):
        return StaticController(cfg)
    if cfg.mode == "table":
        return TableController(cfg)
    return GoodputController(cfg)
