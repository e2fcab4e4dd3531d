"""The goodput controller where turning drafting on costs a catch-up: the draft model first runs
over every token its rows missed while plain steps ran (a new prompt whole)."""

from cluster.policy import SpeculationPolicyConfig, make_controller
from tests.policy.test_controller import HopperSim, ramp


class CatchUpSim(HopperSim):
    """HopperSim whose drafter lags while plain steps run: the first drafting step after them
    also runs the draft model over the tokens every row missed, up to 100 a row at 30 us each
    (126-261 ms steps at 55-64 rows on an H100, benchmarks/gpu/h100/sweep_2026-11-27: 2-5 ms a
    row), with the acceptance of distinct prompts and drafting near break-even with plain
    decoding at 64 rows."""

    ACCEPT = [0.45, 0.45] + [0.4] * 6
    CATCH_UP = (0.0, 0.00003)  # seconds fixed, seconds a lagged token
    TOKENS_LEFT = 64  # rows of 0-128 tokens turning over

    def draft_s(self, b, g):
        return 0.0004 + g * (0.00035 + 0.00001 * b) if g else 0.0

    def lag(self, b):
        return b * min(self.plain_run, 100)

    def __call__(self, b, g):
        lag = self.lag(b) if g else 0
        extra = self.CATCH_UP[0] + self.CATCH_UP[1] * lag if lag else 0.0
        obs, s, n = super().__call__(b, g)
        obs.draft_s += extra
        return obs, s + extra, n


class SweepSim(CatchUpSim):
    """The 8B-shaped demo pair as the H100 sweep at fa54992 measured it
    (benchmarks/gpu/h100/sweep_2026-11-27b, distinct 640-token prompts): a step at gamma 4
    costs about 8.6 ms + 0.13 ms a row all told and yields 1.67 tokens a row, 1.15x plain
    decoding at 1 row and 0.6-0.75x from 64 rows; a plain step run ahead costs 0.95 of a lone
    one. Rows turn over every ~128 tokens, so after a plain stretch of k steps a row lags k
    tokens and, once it is new, its whole prompt; the catch-up costs 5 ms + 3.5 us a token."""

    ACCEPT = [0.42] + [0.4] * 7
    AHEAD = 0.95
    CATCH_UP = (0.005, 0.0000035)

    def verify_s(self, b, tokens):
        return 0.0061 + 0.000031 * b + (0.00045 if tokens > b else 0.0) + 0.0000085 * max(0, tokens - 128)

    def draft_s(self, b, g):  # with the host's work a drafting row (proposals, rejection sampling)
        return 0.0004 + g * (0.0004 + 0.000008 * b) + 0.00003 * b if g else 0.0

    def lag(self, b):
        k = self.plain_run
        return int(b * (k + 640 * min(1.0, k / 128)))


def best_fixed(sim_cls, b: int, steps: int, seed: int) -> float:
    """Tokens/s of the best constant gamma (0: plain decoding run ahead) over plain decoding."""
    plain = b / (sim_cls.AHEAD * sim_cls(seed=seed).verify_s(b, b))
    best = 1.0
    for g in range(1, 9):
        sim, secs, toks = sim_cls(seed=seed), 0.0, 0
        for _ in range(steps):
            _obs, s, n = sim(b, g)
            secs, toks = secs + s, toks + n
        best = max(best, toks / secs / plain)
    return best


def test_goodput_prices_the_drafters_catch_up():
    # Turning drafting on after a plain stretch pays the draft model's catch-up over every row.
    # Switching on a modelled gain alone, and probing as often at 128 rows as at 16, made 0.965
    # of plain decoding on average over these levels and seeds (9 of 24 below 0.95, the worst
    # 0.85); a probe at a new load still pays one catch-up before it is measured there.
    ratios, learnt = [], []
    for seed in range(1, 9):
        ctrl = make_controller(SpeculationPolicyConfig(mode="goodput"))
        r = ramp(ctrl, CatchUpSim(seed=seed), (1, 16, 64, 128, 256), 400)
        ratios += [r[b] for b in (64, 128, 256)]
        fit = ctrl.snapshot()["switch_cost"]
        learnt.append(fit["s"] + fit["s_per_token"] * 6400)  # 64 rows 100 tokens behind
    assert sum(ratios) / len(ratios) >= 0.99, ratios
    assert sum(x < 0.95 for x in ratios) <= 2 and min(ratios) >= 0.9, ratios
    assert all(0.13 <= x <= 0.26 for x in learnt), learnt  # the sim's 30 us a token: 0.192 s


def test_goodput_speculates_where_it_pays_despite_the_catch_up():
    # Speculation pays at 1-16 rows and loses from 64 (as on the H100 sweep at fa54992), and a
    # switch up after plain steps costs a catch-up: at each level the controller makes most of
    # the best constant gamma. (The H100's failure at 1 and 16 streams, a price read per token
    # over short lags, is test_a_fixed_catch_up_is_priced_fixed's; this simulation's catch-up
    # at one row is cheap enough that fa54992's controller passes here too.)
    levels = (1, 16, 64, 128, 256)
    over_best = {b: [] for b in levels}
    for seed in range(1, 5):
        r = ramp(make_controller(SpeculationPolicyConfig(mode="goodput")), SweepSim(seed=seed), levels, 300)
        for b in levels:
            over_best[b].append(r[b] / best_fixed(SweepSim, b, 300, seed))
    means = {b: sum(x) / len(x) for b, x in over_best.items()}
    assert min(means.values()) >= 0.95, over_best
    assert min(min(x) for x in over_best.values()) >= 0.9, over_best


class FixedCatchUpSim(CatchUpSim):
    """A catch-up that costs the same however far the drafter lags (passes, not tokens)."""

    CATCH_UP = (0.02, 0.0)


def test_a_fixed_catch_up_is_priced_fixed():
    # Read as seconds a lagged token, a catch-up that is mostly fixed cost (passes, a pipeline
    # restart) prices a switch after a short plain stretch (few tokens) far too high: on an H100
    # the price read at 1 stream came to 0.35 ms a token, and no probe up followed.
    for seed in (1, 2, 3):
        ctrl = make_controller(SpeculationPolicyConfig(mode="goodput"))
        ramp(ctrl, FixedCatchUpSim(seed=seed), (1, 16, 64, 128, 256), 400)
        fit = ctrl.snapshot()["switch_cost"]
        assert fit["n"] >= 3 and len(fit["readings"]) >= 3, fit
        for lag in (100, 10_000, 100_000):
            assert 0.015 <= fit["s"] + fit["s_per_token"] * lag <= 0.025, fit


def drain(ctrl, sim: SweepSim, top: int = 256, full: int = 160, tail: int = 120) -> float:
    """`full` steps at `top` rows, then a batch that drains to one row over `tail` steps (the
    end of a closed-loop run: no new requests), each row's tokens left told as an engine tells
    them. Tokens/s over plain decoding run ahead on the same steps."""
    rows = [top] * full + [max(1, int(top * (1 - i / tail))) for i in range(tail)]
    secs = toks = 0.0
    for i, b in enumerate(rows):
        ctrl.drafter_lag = lambda b=b: sim.lag(b)
        ctrl.tokens_left = lambda i=i: sim.TOKENS_LEFT if i < full else (full + tail - i) / 2
        obs, s, n = sim(b, ctrl.gamma(b))
        ctrl.observe(obs)
        secs, toks = secs + s, toks + n
    return toks / secs / (sum(rows) / sum(sim.AHEAD * sim.verify_s(b, b) for b in rows))


def test_a_draining_batch_pays_no_catch_up():
    # The H200 sweep at 256 streams (benchmarks/gpu/h200/scale_2026-11-28): after 160 plain
    # steps the batch drained, speculation looked better at 188 rows, and the switch paid a
    # 430 ms catch-up over 131k tokens that the rows, ending within ~60 steps, never won back
    # (0.913 of plain). Here a switch or a probe up in the drain cost 0.96 of plain decoding.
    for seed in (1, 2, 3):
        ctrl = make_controller(SpeculationPolicyConfig(mode="goodput"))
        sim = SweepSim(seed=seed)
        ramp(ctrl, sim, (1, 16, 64, 128), 300)
        assert drain(ctrl, sim) >= 0.99, ctrl.snapshot()["switch_cost"]
