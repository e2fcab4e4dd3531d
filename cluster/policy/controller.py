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
    step time   = t_verify(b, g) + t_draft(b, g)
    t_verify    = c0 + c_row*b + c1*(b*g + prefill)
    t_draft     = d0 + d_row*b + d_pass*g + d1*b*g      (0 when g = 0)
with a_i the acceptance rate of draft position i given all before it were accepted. Rows
and tokens are separate terms because on a CPU (and in the sampler everywhere) a row costs
far more than one more token in it: a one-line fit over tokens alone mistakes the per-row
cost for a per-token one when the batch grows, overprices drafts and turns speculation off
where it still pays. Likewise a draft costs g sequential passes (d_pass) as well as work
per row and token. The fits (cluster.policy.fit) are shared across batch sizes, so the
costs measured at one concurrency predict the next; periodic probe steps at other gammas
keep every term measured.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

from cluster.policy.config import SpeculationPolicyConfig
from cluster.policy.fit import CostFit

REFIT_EVERY = 4  # steps between cost re-fits on the hot path (the costs drift slowly)


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


class GoodputController(_Base):
    """Chooses the gamma that maximises expected tokens per second (see module docstring)."""

    def __init__(self, cfg: SpeculationPolicyConfig):
        super().__init__(cfg)
        gmax = cfg.gamma_max
        # Acceptance as decayed counts plus prior pseudo-counts (`_prior_mass`) that decay
        # with each observation of their position: the prior fades as data arrives
        # instead of switching off at a threshold. The data decays every step, drafted or
        # not, so what was measured long ago counts for less and less (see _optimistic).
        self._acc = [0.0] * gmax
        self._reached = [0.0] * gmax
        self._prior_mass = [cfg.prior_weight] * gmax
        self._mass_floor = min(1.0, cfg.prior_weight)
        # Features: verify [1, b, drafted + prefill]; draft [1, b, g, drafted]. The ridge
        # leans an unresolved split towards the cheaper reading for speculation (per-pass
        # rather than per-row draft cost), so the controller tries it and learns.
        eps = cfg.cost_ridge
        clip, warm = cfg.cost_clip, cfg.min_observations
        self._verify = CostFit(3, cfg.cost_alpha, [0.0, eps, eps], clip, warm)
        self._draft = CostFit(4, cfg.cost_alpha, [0.0, eps, eps, 10 * eps], clip, warm)
        self._prefill = 0.0  # EWMA of non-decode tokens per step
        self._steps = 0
        self._probes = 0
        self._probed_at = -1
        self._last = min(cfg.gamma, gmax)
        self._expected = self._expected_tokens(self._optimistic())

    # --- learning -------------------------------------------------------------
    def observe(self, obs: StepObservation) -> None:
        if obs.batch_size <= 0:
            return
        self._steps += 1
        keep, a = 1.0 - self.cfg.alpha, self.cfg.alpha
        self._acc = [keep * x for x in self._acc]
        self._reached = [keep * x for x in self._reached]
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
                self._acc[j] += accepted
                self._reached[j] += reached
                self._prior_mass[j] = max(self._mass_floor, keep * self._prior_mass[j])
        self._expected = self._expected_tokens(self._optimistic())
        b = obs.batch_size
        extra = max(0, obs.verify_tokens - b - obs.drafted)
        self._verify.add([1.0, b, obs.drafted + extra], obs.verify_s)
        self._prefill = (1 - a) * self._prefill + a * extra
        if obs.drafted > 0:
            self._draft.add([1.0, b, obs.gamma, obs.drafted], obs.draft_s)

    def acceptance(self) -> list[float]:
        """Per-position conditional acceptance. A position's prior is the larger of
        `prior_acceptance` and the position before's estimate: deeper positions are
        rarely reached at a low gamma, and a fixed pessimistic prior there would keep
        gamma low for good (the conditional rate is roughly flat in depth on real pairs;
        if it falls, drafting there measures it)."""
        out, prev = [], self.cfg.prior_acceptance
        for acc, r, m in zip(self._acc, self._reached, self._prior_mass):
            a = min(1.0, (acc + m * prev) / (r + m)) if r + m > 0 else prev
            out.append(a)
            prev = max(self.cfg.prior_acceptance, a)
        return out

    def _optimistic(self) -> list[float]:
        """Acceptance plus `acceptance_bonus` standard errors, for deciding. Evidence fades
        each step, so a position not drafted for a while (gamma went down, or to 0) gets
        uncertain, its optimistic rate rises, and the controller drafts there again to
        look, but only where speculation could pay at that optimistic rate: at a batch
        so large that even perfect acceptance would not pay, it never looks."""
        k = self.cfg.acceptance_bonus
        est = self.acceptance()
        if not k:
            return est
        return [min(1.0, p + k * math.sqrt(p * (1.0 - p) / (r + m + 1.0)))
                for p, r, m in zip(est, self._reached, self._prior_mass)]

    def _expected_tokens(self, acceptance: list[float] | None = None) -> list[float]:
        """E[N|g] for g = 0..gamma_max."""
        out, run, prod = [1.0], 1.0, 1.0
        for a in acceptance if acceptance is not None else self.acceptance():
            prod *= a
            run += prod
            out.append(run)
        return out

    # --- deciding -------------------------------------------------------------
    def _step_times(self, b: float) -> list[float]:
        """Predicted step seconds at batch b for g = 0..gamma_max (one pass: called per step)."""
        cfg = self.cfg
        c0, cr, c1 = self._verify.coef(REFIT_EVERY)
        base = c0 + cr * b + c1 * self._prefill
        if self._draft.n >= cfg.min_observations:
            d0, dr, dp, d1 = self._draft.coef(REFIT_EVERY)
            fixed, per_g = d0 + dr * b, dp + d1 * b
        else:  # prior: g sequential draft passes, each a fraction of a target pass
            fixed, per_g = 0.0, cfg.prior_draft_cost_ratio * base
        out = [max(base, 1e-9)]
        for g in range(1, cfg.gamma_max + 1):
            out.append(max(base + c1 * b * g + fixed + per_g * g, 1e-9))
        return out

    def goodputs(self, b: float) -> list[float]:
        """Expected tokens per second at batch b for g = 0..gamma_max under the current model."""
        e = self._expected
        if self._verify.n < self.cfg.min_observations:
            # No cost data: verify cost flat (the memory-bound premise of speculation).
            r = self.cfg.prior_draft_cost_ratio
            return [e[g] / (1.0 + r * g) for g in range(len(e))]
        return [b * eg / t for eg, t in zip(e, self._step_times(b))]

    def _probe(self) -> int | None:
        """Every `explore_every` steps one step at another gamma, alternately 0 (cost of
        plain decoding) and higher (acceptance at deeper positions): the cost fit needs
        more than one gamma to see the slope, and a stale acceptance estimate would
        otherwise hold gamma at 0 for good once it got there."""
        cfg = self.cfg
        if not cfg.explore_every or self._steps % cfg.explore_every or self._probed_at == self._steps:
            return None
        self._probed_at = self._steps
        self._probes += 1
        up = min(cfg.gamma_max, max(self._last + 2, cfg.gamma))
        if self._last == 0:
            return up or None
        return 0 if self._last >= cfg.gamma_max or self._probes % 2 else up

    def gamma(self, batch_size: int, cluster_inflight: int = 0) -> int:
        cfg = self.cfg
        if self._verify.n < cfg.min_observations:
            # Start at the configured gamma if the prior predicts a gain, else plain decoding.
            v = self.goodputs(1)
            self._last = cfg.gamma if v[cfg.gamma] > v[0] else 0
            return self._last
        probe = self._probe()
        if probe is not None:
            return probe
        v = self.goodputs(max(1.0, self.concurrency(batch_size, cluster_inflight)))
        best_g = max(range(len(v)), key=v.__getitem__)
        if best_g != self._last and v[best_g] >= v[self._last] * (1.0 + cfg.hysteresis):
            self._last = best_g
        return self._last

    def snapshot(self) -> dict:
        c0, cr, c1 = self._verify.theta
        d0, dr, dp, d1 = self._draft.theta
        return {
            "mode": self.cfg.mode,
            "gamma": self._last,
            "acceptance": [round(a, 4) for a in self.acceptance()],
            "expected_tokens": [round(e, 3) for e in self._expected_tokens()],
            "expected_tokens_optimistic": [round(e, 3) for e in self._expected],
            "verify_cost": {"c0": c0, "c_row": cr, "c1": c1, "n": self._verify.n},
            "draft_cost": {"d0": d0, "d_row": dr, "d_pass": dp, "d1": d1, "n": self._draft.n},
            "prefill_tokens": self._prefill,
            "steps": self._steps,
            "probes": self._probes,
        }


def make_controller(cfg: SpeculationPolicyConfig) -> Controller:
    """The controller for `cfg.mode`."""
    if cfg.mode in ("off", "fixed"):
        return StaticController(cfg)
    if cfg.mode == "table":
        return TableController(cfg)
    return GoodputController(cfg)
