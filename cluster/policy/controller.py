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
    t_verify    = c0 + c_row*b + c1*(b*g + prefill) + c_draft_row*b*[g > 0]
    t_draft     = d0 + d_pass*g + d1*b*g                (0 when g = 0)
with a_i the acceptance rate of draft position i given all before it were accepted
(cluster.policy.acceptance: recent and long-run estimates). Rows and tokens are separate
terms because a row costs far more than one more token in it (the sampler, per-row work;
on the CPU demo pair about 1 ms a row against 0.2 ms a token): a one-line fit over tokens
mistakes the per-row cost for a per-token one as the batch grows, overprices drafts and
turns speculation off where it still pays. A row that carries drafts costs more again
(multi-token attention, rejection sampling), so plain decoding is cheaper than the
per-token slope says. A draft is g sequential passes (d_pass), each with work per row (d1).

The fits (cluster.policy.fit) span batch sizes, so costs measured at one concurrency
predict the next. Probe steps at other gammas (see GoodputController._probe) keep every
term measured, and a switch needs `hysteresis` more expected goodput, so gamma does not
flap on noise. Probes are paced by what they cost: each one's measured excess over a step
at the chosen gamma is charged, and a new probe waits while the charges exceed
`explore_budget` of the time run (at 256 rows a speculative probe costs several plain
steps; probing every `explore_every` steps there lost 8% of plain decoding's throughput).

The model is only as good as its features, and a step's cost is not linear in them: on an
H100 a verify pass is flat until its tokens fill the tensor cores, a draft pass at 64 rows
costs three times what a per-pass reading learnt at 16 rows says, and plain decoding run a
step ahead (`plain_runs_ahead`) costs less than the lone plain steps the fit sees (a model
alone kept gamma at 8 where speculation lost: benchmarks/gpu/h100/run3). So measurements
correct the model where it is used: per batch-size bucket (powers of two) an EWMA of measured over modelled step
time, one for plain steps run ahead (their sustained cost; lone plain steps are what the
fit models) and one for speculative steps, scales the model's times for that bucket.
The model still shapes the choice among gammas; the correction sets the level, and the
choice between speculating and not rests on steps measured at this load. A correction
older than MEASURED_FOR steps lapses; speculating in a bucket whose plain cost is not
measured triggers a gamma-0 probe (three steps where plain decoding runs ahead, so the
third is a pipelined one).

Turning drafting on after a plain run has a price of its own, the draft model's catch-up over
everything its rows missed (cluster.policy.switch). The engine tells how many tokens that is
(`drafter_lag`) and how many its rows may still produce (`tokens_left`). Every step up from plain
decoding (a probe, a switch, a probe's end) reads what its catch-up cost; probes up are paced by
that price, and a switch up happens once the time speculation would have saved since it first
looked better covers it, where the rows live to win it back (rent or buy). A switch on a wrong model then
costs one catch-up and the few steps that measure it, at most once per MEASURED_FOR steps, and a
right one is not held back until a probe happens to measure the load first (that held speculation
off at 1 and 16 streams on an H100, where it made 1.13x, benchmarks/gpu/h100/sweep_2026-11-27b).
"""

from __future__ import annotations

from cluster.engine.observation import StepObservation
from cluster.policy.acceptance import Acceptance
from cluster.policy.config import SpeculationPolicyConfig
from cluster.policy.fit import CostFit
from cluster.policy.static import BaseController, Controller, StaticController, TableController
from cluster.policy.switch import SwitchPrice

__all__ = ["GoodputController", "StepObservation", "make_controller"]

REFIT_EVERY = 4  # steps between cost re-fits on the hot path (the costs drift slowly)
DITHER_EVERY = 4  # every 4th step runs at gamma +-1 (see GoodputController._dither)
MEASURED_FOR = 256  # steps a bucket's measured/modelled correction stays in force
BUDGET_WINDOW = 4096  # steps over which probe charges and run time fade (the budget's window)
CORRECT_ALPHA = 0.1  # EWMA weight of a step in a correction (its first step sets it)


class GoodputController(BaseController):
    """Chooses the gamma that maximises expected tokens per second (see module docstring)."""

    def __init__(self, cfg: SpeculationPolicyConfig):
        super().__init__(cfg)
        gmax = cfg.gamma_max
        self._acceptance = Acceptance(gmax, cfg.alpha, cfg.prior_acceptance, cfg.prior_weight)
        # Features: verify [1, b, drafted + prefill, rows drafting]; draft [1, g, drafted].
        # While steps at only two gammas (one of them 0) cannot tell a fixed cost of
        # drafting rows from a per-token one, the stronger ridge on the former reads it as
        # per token; steps at a third gamma separate them.
        eps = cfg.cost_ridge
        clip, warm = cfg.cost_clip, cfg.min_observations
        self._verify = CostFit(4, cfg.cost_alpha, [0.0, eps, eps, 30 * eps], clip, warm)
        # Drafts: at one batch size per-pass and per-row-pass costs are one term; reading
        # it as per pass keeps drafting looking affordable at a larger batch, so drafts are
        # made there and measured (reading it as per row would hold gamma at 0 unmeasured).
        # Draft times also carry the drafter's prefill of each new sequence's prompt (in
        # its first propose call): a per-request cost, tiny per token, but a spike in the
        # step it lands in; a tighter clip keeps those spikes from reading as step costs.
        self._draft = CostFit(3, cfg.cost_alpha, [0.0, eps, 10 * eps], min(clip, 1.5) if clip else 0.0, warm)
        self._drafted_before = False  # did the previous step draft (see observe)
        # set by an engine: () -> tokens its drafters would run over before drafting every row
        self.drafter_lag = None
        # set by an engine: () -> tokens its speculating rows may still produce, on average
        self.tokens_left = None
        self._switch = SwitchPrice(eps)  # steps up from plain decoding: the drafters' catch-up
        self._since_up_s = 0.0  # seconds run since the last probe up from plain decoding
        self._switch_lag = None  # the drafters' lag at the step up from plain decoding this step is
        self._prefill = 0.0  # EWMA of non-decode tokens per step
        self._steps, self._probes, self._probed_at = 0, 0, -1
        self._probe_again = None  # a probe up from 0 lasts two steps (see _probe)
        self._dithers = 0
        # set by an engine whose plain steps run a step ahead, and one that launches speculative steps ahead
        self.plain_runs_ahead = self.spec_runs_ahead = False
        # (bucket, speculative) -> [measured over modelled step time, step of the last sample]
        self._measured: dict[tuple[int, bool], list[float]] = {}
        self._zero_hold = 0  # steps a gamma-0 probe still holds
        self._zero_next = 0  # steps of a gamma-0 probe announced, from the next step on
        self._zero_probed: dict[int, int] = {}  # bucket -> step of its last measuring probe
        self._charge = 0  # steps still charged to the last probe (see _charged)
        self._probe_s = 0.0  # probes' excess seconds, fading over BUDGET_WINDOW steps
        self._run_s = 0.0  # all steps' seconds, fading the same way
        self._last = min(cfg.gamma, gmax)
        self._expected = self._expected_tokens()
        self.goodputs_seen: list[float] = []  # the tokens/s by gamma the last choice weighed (traces)

    # --- learning -------------------------------------------------------------
    def observe(self, obs: StepObservation) -> None:
        if obs.batch_size <= 0:
            return
        self._steps += 1
        a = self.cfg.alpha
        self._acceptance.observe(obs.proposed_per_position, obs.accepted_per_position)
        self._expected = self._expected_tokens()
        b = obs.batch_size
        extra = max(0, obs.verify_tokens - b - obs.drafted)
        drafting = obs.proposed_per_position[0] if obs.proposed_per_position else 0
        spec = obs.drafted > 0
        # Plain steps are corrected only where they run ahead (pipelined: the sustained cost);
        # lone ones are what the fit models, and a correction from the few of them probes
        # make would be noise. A drafting step after plain ones pays the drafter's catch-up.
        seconds = obs.step_s or obs.verify_s + obs.draft_s
        self._account(b, seconds)
        self._since_up_s += seconds
        if spec and self._switch_lag:  # nothing lagged, nothing to catch up
            # its drafting's excess over a modelled draft: the drafters catching up (the whole
            # step's over a modelled step holds the verify model's error as well)
            excess = max(0.0, obs.draft_s - self._draft_times(b, min(obs.gamma, self.cfg.gamma_max)))
            self._switch.read(b, self._switch_lag, excess)
        self._switch_lag = None
        if (obs.pipelined or spec) and (self._drafted_before or not spec):
            self._correct(b, spec, seconds, obs.drafted / b, extra)
        if obs.pipelined:  # not a lone step's cost: the fit models lone steps
            self._drafted_before = False
            return
        self._verify.add([1.0, b, obs.drafted + extra, drafting], obs.verify_s)
        self._prefill = (1 - a) * self._prefill + a * extra
        if spec and self._drafted_before:
            # The first drafting step after plain ones pays the drafter's catch-up over
            # every token it missed: a cost of switching, not of drafting at this gamma.
            self._draft.add([1.0, obs.gamma, obs.drafted], obs.draft_s)
        self._drafted_before = spec

    def _account(self, b: int, seconds: float) -> None:
        """Run time, and a probe's charge: its excess over a step at the chosen gamma."""
        fade = 1.0 - 1.0 / BUDGET_WINDOW
        self._run_s = self._run_s * fade + seconds
        self._probe_s *= fade
        if self._charge:
            self._charge -= 1
            if self._verify.n >= self.cfg.min_observations:
                self._probe_s += max(0.0, seconds - self._step_times(b)[self._last])

    def _charged(self, steps: int) -> None:
        """A probe starts: charge its steps, and after a probe from plain decoding run ahead
        the two steps that restart the pipeline (cluster.engine.worker.pipeline)."""
        self._charge = steps + (2 if self.plain_runs_ahead and not self._last else 0)
        self._probes += 1

    def _within_budget(self) -> bool:
        return self._probe_s <= self.cfg.explore_budget * self._run_s

    def _lag(self) -> int | None:
        return self.drafter_lag() if self.drafter_lag else None

    def _switch_cost(self) -> float:
        return self._switch.cost(self._lag())

    def _tokens_left(self) -> float | None:
        return self.tokens_left() if self.tokens_left is not None else None

    def _correct(self, b: int, spec: bool, seconds: float, g: float, prefill: float) -> None:
        """Fold one measured step into its bucket's measured/modelled correction."""
        if self._verify.n < 4 * self.cfg.min_observations:  # the fit still moves a lot: nothing to correct yet
            return
        model = self._model_times(b, [g], prefill)[0]
        if model <= 0.0:
            return
        x = min(4.0, max(0.25, seconds / model))  # one stalled step moves it a bounded amount
        key = (b.bit_length(), spec)
        m = self._measured.get(key)
        if m is None or self._steps - m[1] > MEASURED_FOR:
            self._measured[key] = [x, self._steps]
        else:
            m[0] += CORRECT_ALPHA * (x - m[0])
            m[1] = self._steps

    def _correction(self, b: float, spec: bool) -> float | None:
        """The bucket's measured/modelled step time; None where it has no recent steps."""
        m = self._measured.get((int(b).bit_length(), spec))
        return m[0] if m is not None and self._steps - m[1] <= MEASURED_FOR else None

    def acceptance(self) -> list[float]:
        """Per-position conditional acceptance (cluster.policy.acceptance)."""
        return self._acceptance.rates()

    def _expected_tokens(self) -> list[float]:
        """E[N|g] for g = 0..gamma_max."""
        out, run, prod = [1.0], 1.0, 1.0
        for a in self.acceptance():
            prod *= a
            run += prod
            out.append(run)
        return out

    # --- deciding -------------------------------------------------------------
    def _model_times(self, b: float, gammas, prefill: float) -> list[float]:
        """Modelled seconds of a lone step at batch b for each g in `gammas` (uncorrected)."""
        c0, cr, c1, cj = self._verify.coef(REFIT_EVERY)
        base = c0 + cr * b + c1 * prefill
        fixed, per_g = self._draft_terms(b, base)
        return [base + (cj * b + c1 * b * g + fixed + per_g * g if g else 0.0) for g in gammas]

    def _draft_terms(self, b: float, base: float) -> tuple[float, float]:
        """A draft's modelled seconds at batch b: (fixed, per draft position)."""
        if self._draft.n >= self.cfg.min_observations:
            d0, dp, d1 = self._draft.coef(REFIT_EVERY)
            return d0, dp + d1 * b
        # prior: g sequential draft passes, each a fraction of a target pass (`base`)
        return 0.0, self.cfg.prior_draft_cost_ratio * base

    def _draft_times(self, b: float, g: int) -> float:
        """Modelled seconds of a draft of g tokens a row at batch b (uncorrected)."""
        c0, cr, c1, _ = self._verify.coef(REFIT_EVERY)
        fixed, per_g = self._draft_terms(b, c0 + cr * b + c1 * self._prefill)
        return fixed + per_g * g if g else 0.0

    def _step_times(self, b: float) -> list[float]:
        """Predicted step seconds at batch b for g = 0..gamma_max (one pass: called per step):
        the model, scaled by the bucket's measured corrections."""
        t = self._model_times(b, range(self.cfg.gamma_max + 1), self._prefill)
        plain, spec = self._correction(b, False) or 1.0, self._correction(b, True) or 1.0
        return [max(x * (spec if g else plain), 1e-9) for g, x in enumerate(t)]

    def goodputs(self, b: float) -> list[float]:
        """Expected tokens per second at batch b for g = 0..gamma_max under the current model."""
        e = self._expected
        if self._verify.n < self.cfg.min_observations:
            # No cost data: verify cost flat (the memory-bound premise of speculation).
            r = self.cfg.prior_draft_cost_ratio
            return [e[g] / (1.0 + r * g) for g in range(len(e))]
        return [b * eg / t for eg, t in zip(e, self._step_times(b))]

    def _probe(self, v: list[float], b: float) -> int | None:
        """Every `explore_every` steps one step at another gamma (0, half, higher, in turn):
        the cost fit needs gammas far apart to see the slope and the step at 0, and
        acceptance is only measured where drafts are made. At gamma 0 with speculation
        predicted within 20% of paying, probes come 4x as often: there a few drafts can
        change the decision, and with one stream a probe yields a single sample."""
        cfg = self.cfg
        if self._probe_again is not None:
            g, self._probe_again = self._probe_again, None
            self.ends_speculation = True  # a probe up's last step: plain decoding resumes after it
            return g
        if self._zero_next:  # a gamma-0 probe announced at the step before (see _zero_probe)
            self._zero_hold, self._zero_next = self._zero_next - 1, 0
            return 0
        if self._zero_hold:
            self._zero_hold -= 1
            return 0
        if not self._within_budget():
            return None
        k = int(b).bit_length()
        if (self.plain_runs_ahead and self._last and self._correction(b, False) is None
                and self._steps - self._zero_probed.get(k, -MEASURED_FOR) > MEASURED_FOR):
            # Speculating where plain decoding's cost at this load is only modelled: measure
            # it (once per MEASURED_FOR steps: plain steps of rows asking for logprobs never run ahead).
            self._zero_probed[k] = self._steps
            self._charged(3 + self.spec_runs_ahead)
            return self._zero_probe(3)
        every = cfg.explore_every
        if every and self._last == 0 and max(v[1:], default=0.0) >= 0.8 * v[0]:
            every = max(1, every // 4)
        if not every or self._steps % every or self._probed_at == self._steps:
            return None
        self._probed_at = self._steps
        if self._last == 0:
            # A probe up pays the drafter's catch-up: paid from the time run since the last one
            price = self._switch_cost()
            if price > self.cfg.explore_budget * self._since_up_s:
                return None
            if not self._switch.won_back(0.5 * b / v[0], price, self._tokens_left()):
                return None  # not even speculation twice as fast as plain decoding would win it back
            self._since_up_s = 0.0
            # The best speculative gamma as predicted (at high load a short one: a probe at
            # the configured gamma would cost several plain steps), never above the configured
            # one: where the fitted costs are flat in gamma the best lies at gamma_max, whose
            # measured cost alone reads speculation dear at every gamma (TP 4: 33 ms at gamma 8
            # against 24 at 4). Twice: the first step's drafts pay the drafter's catch-up (not fitted).
            up = min(max(range(1, len(v)), key=v.__getitem__), self.cfg.gamma or cfg.gamma_max) if len(v) > 1 else 0
            self._probe_again = up or None
            if up:
                self._charged(2)
            return up or None
        up = min(cfg.gamma_max, max(self._last + 2, cfg.gamma))
        # Dithering by one alone measures the slope poorly (see the docstring).
        turn = (self._probes + 1) % 3
        self._charged(1)
        if turn == 2 and self._last < cfg.gamma_max:
            return up
        if turn == 1:
            return self._last // 2
        self._charge += (2 if self.plain_runs_ahead else 0) + self.spec_runs_ahead
        return self._zero_probe(3 if self.plain_runs_ahead else 1)

    def _zero_probe(self, steps: int) -> int | None:
        """A gamma-0 probe of `steps` steps. Where speculative steps run ahead it starts at the next
        step: this one runs as chosen and says speculation ends after it, so no step is launched
        for the probe to drop (a verify pass: ~5 ms at one row on an H200, ~25 at 32 rows on TP 4)."""
        if self.spec_runs_ahead:
            self._zero_next, self.ends_speculation = steps, True
            return None
        self._zero_hold = steps - 1
        return 0

    def _dither(self) -> int:
        """One step in DITHER_EVERY at gamma-1 or gamma+1, in turn. Sitting at one gamma,
        the steps only measure the cost there; the slope around it (what the next gamma
        up or down would cost at this batch) would come from other batch sizes, fitted
        through a line that is only roughly one, and a wrong slope moves gamma to an end.
        Near the best gamma the goodput curve is flat, so this costs well under 1%."""
        self._dithers += 1
        return max(0, min(self.cfg.gamma_max, self._last + (1 if self._dithers % 2 else -1)))

    def gamma(self, batch_size: int, cluster_inflight: int = 0) -> int:
        self.ends_speculation = False
        g = self._choose(batch_size, cluster_inflight)
        if g and not self._drafted_before:  # drafting after plain steps (a probe, a switch, a probe's end): read its catch-up
            self._switch_lag = self.drafter_lag() if self.drafter_lag else None
        return g

    def _choose(self, batch_size: int, cluster_inflight: int) -> int:
        cfg = self.cfg
        if self._verify.n < cfg.min_observations:
            # Start at the configured gamma if the prior predicts a gain, else plain decoding.
            v = self.goodputs(1)
            self._last = cfg.gamma if v[cfg.gamma] > v[0] else 0
            return self._last
        c = max(1.0, self.concurrency(batch_size, cluster_inflight))
        v = self.goodputs_seen = self.goodputs(c)
        probe = self._probe(v, c)
        if probe is not None:
            return probe
        if self._last and self._steps % DITHER_EVERY == DITHER_EVERY - 1:
            return self._dither()
        best_g = max(range(len(v)), key=v.__getitem__)
        if best_g != self._last and v[best_g] >= v[self._last] * (1.0 + cfg.hysteresis):
            if self._last or self._switch.pays(c / v[0] - c / v[best_g], self._lag, self._tokens_left):
                self._last = best_g
        else:
            self._switch.bank = 0.0
        return self._last

    def snapshot(self) -> dict:
        c0, cr, c1, cj = self._verify.theta
        d0, dp, d1 = self._draft.theta
        return {
            "mode": self.cfg.mode,
            "gamma": self._last,
            "acceptance": [round(a, 4) for a in self.acceptance()],
            "expected_tokens": [round(e, 3) for e in self._expected],
            "verify_cost": {"c0": c0, "c_row": cr, "c1": c1, "c_draft_row": cj, "n": self._verify.n},
            "draft_cost": {"d0": d0, "d_pass": dp, "d1": d1, "n": self._draft.n},
            "prefill_tokens": self._prefill,
            "steps": self._steps,
            "probes": self._probes,
            "probe_time_share": round(self._probe_s / self._run_s, 4) if self._run_s else 0.0,
            # the drafters' catch-up, stepping up from plain decoding: its fit and last readings
            "switch_cost": self._switch.snapshot(),
            # per bucket of batch sizes (its smallest): measured over modelled step time
            "measured_over_model": {f"{1 << (k - 1)}{'/spec' if sp else '/plain'}": round(m[0], 3)
                                    for (k, sp), m in sorted(self._measured.items())
                                    if self._steps - m[1] <= MEASURED_FOR},
        }


def make_controller(cfg: SpeculationPolicyConfig) -> Controller:
    """The controller for `cfg.mode`."""
    if cfg.mode in ("off", "fixed"):
        return StaticController(cfg)
    if cfg.mode == "table":
        return TableController(cfg)
    return GoodputController(cfg)
