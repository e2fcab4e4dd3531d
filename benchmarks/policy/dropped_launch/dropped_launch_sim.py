"""The goodput controller where speculative steps run ahead (cluster.engine.spec.ahead): a plain
step right after a speculative one also pays the verify pass launched after that one, which it
drops, unless the controller said speculation ends there (`ends_speculation`). Over the policy
tests' simulations (HopperSim, CatchUpSim, SweepSim: goodput over the best fixed gamma at each
level, 20 seeds) and `OneRowH200Sim`, one row at the step times of the H200 sweep's 1-stream
goodput trace (benchmarks/gpu/h200/pointwise_5e46173, 24 seeds). Writes NAME.json here, and
dropped_launch.png once before.json and after.json are both here.

    PYTHONPATH=. python3 benchmarks/policy/dropped_launch/dropped_launch_sim.py --name after
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path

from cluster.bench.report import figure, save_figure
from cluster.policy import SpeculationPolicyConfig, StepObservation, make_controller
from tests.policy.test_catch_up import CatchUpSim, SweepSim, best_fixed
from tests.policy.test_controller import HopperSim

HERE = Path(__file__).parent
LEVELS = (1, 16, 64, 128, 256)
# ms of a lone step at gamma 0..8 (medians of the trace), plain decoding run ahead, drafting
STEP_MS = [5.27, 5.21, 5.27, 5.285, 5.43, 5.55, 5.66, 5.78, 6.0]
AHEAD_MS = 4.48


def draft_ms(g: int) -> float:
    return 0.16 + 0.084 * g if g else 0.0  # the trace's controller fit


class OneRowH200Sim:
    """16 requests of 64-192 tokens one after another, a fifth of them drafted well (0.7 a
    position) and the rest poorly (0.28): fixed gamma 4 makes ~1.63 tokens a step, as there."""

    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.reqs = [(0.7 if self.rng.random() < 0.2 else 0.28, self.rng.randint(64, 192)) for _ in range(16)]
        self.i, self.left, self.plain_run = 0, self.reqs[0][1], 0

    def done(self) -> bool:
        return self.i >= len(self.reqs)

    def __call__(self, g: int) -> tuple[StepObservation, float, int]:
        q = self.reqs[self.i][0]
        acc = [0] * g
        for j in range(g):
            if self.rng.random() >= q:
                break
            acc[j] = 1
        jitter = lambda: 1.0 + 0.03 * (2 * self.rng.random() - 1)  # noqa: E731
        d, v = draft_ms(g) * jitter() / 1e3, (STEP_MS[g] - draft_ms(g)) * jitter() / 1e3
        self.plain_run = self.plain_run + 1 if g == 0 else 0
        if self.plain_run >= 3:
            v = AHEAD_MS * jitter() / 1e3
        obs = StepObservation(1, g, 1 + g, v, d, g, acc, [1] * g, pipelined=self.plain_run >= 3)
        self.left -= 1 + sum(acc)
        if self.left <= 0:
            self.i += 1
            self.left = self.reqs[self.i][1] if not self.done() else 0
        return obs, v + d, 1 + sum(acc)


def controller(gamma: int | None):
    cfg = (SpeculationPolicyConfig(mode="goodput") if gamma is None else
           SpeculationPolicyConfig(mode="fixed", gamma=gamma) if gamma else SpeculationPolicyConfig(mode="off"))
    ctrl = make_controller(cfg)
    ctrl.plain_runs_ahead = ctrl.spec_runs_ahead = True  # as the engine on CUDA graphs sets them
    return ctrl


def dropped(ctrl, prev: list, g: int, verify_s) -> float:
    """The launched verify pass a plain step after an unannounced speculative one drops."""
    extra = verify_s(prev[0]) if g == 0 and prev[0] > 0 and not prev[1] else 0.0
    prev[:] = [g, getattr(ctrl, "ends_speculation", False)]
    return extra


def one_row(seed: int) -> float:
    def run(gamma):
        sim, ctrl, prev, secs, toks = OneRowH200Sim(seed), controller(gamma), [0, False], 0.0, 0
        while not sim.done():
            g = ctrl.gamma(1)
            obs, s, n = sim(g)
            extra = dropped(ctrl, prev, g, lambda pg: (STEP_MS[pg] - draft_ms(pg)) / 1e3)
            obs.verify_s += extra
            ctrl.observe(obs)
            secs, toks = secs + s + extra, toks + n
        return toks / secs
    return run(None) / max(run(g) for g in range(9))


def ramp(sim, steps: int = 300) -> dict[int, float]:
    """tests/policy's ramp, with the dropped launches: tokens/s over plain decoding a level."""
    ctrl, prev, out = controller(None), [0, False], {}
    for b in LEVELS:
        if hasattr(sim, "lag"):
            ctrl.drafter_lag = lambda b=b: sim.lag(b)
            ctrl.tokens_left = lambda: sim.TOKENS_LEFT
        for _phase in ("warm-up", "measure"):
            secs = toks = 0.0
            for _ in range(steps):
                g = ctrl.gamma(b)
                obs, s, n = sim(b, g)
                extra = dropped(ctrl, prev, g, lambda pg, b=b: sim.verify_s(b, b * (pg + 1)))
                obs.verify_s += extra
                ctrl.observe(obs)
                secs, toks = secs + s + extra, toks + n
        out[b] = toks / secs / (b / (sim.AHEAD * sim.verify_s(b, b)))
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--name", required=True)
    a = ap.parse_args()
    out: dict = {"sims": {}}
    for name, cls in (("hopper", HopperSim), ("catch_up", CatchUpSim), ("sweep", SweepSim)):
        runs = []
        for seed in range(1, 21):
            r = ramp(cls(seed=seed))
            runs.append({b: r[b] / best_fixed(cls, b, 300, seed) for b in LEVELS})
        out["sims"][name] = {str(b): [round(r[b], 4) for r in runs] for b in LEVELS}
    out["sims"]["one_row_h200"] = {"1": [round(one_row(seed), 4) for seed in range(24)]}
    every = [x for s in out["sims"].values() for v in s.values() for x in v]
    out["all"] = {"mean": round(statistics.mean(every), 4), "below_0.95": sum(x < 0.95 for x in every), "n": len(every)}
    (HERE / f"{a.name}.json").write_text(json.dumps(out, indent=1))
    for name, s in out["sims"].items():
        print(a.name, name, {b: (round(statistics.mean(v), 3), min(v), sum(x < 0.95 for x in v)) for b, v in s.items()})
    print(a.name, "all", out["all"])
    if all((HERE / f"{n}.json").exists() for n in ("before", "after")):
        plt = figure()
        fig, axes = plt.subplots(1, 4, figsize=(13, 3.6), sharey=True)
        for ax, sim in zip(axes, out["sims"]):
            for n, style in (("before", "o-"), ("after", "s-")):
                s = json.loads((HERE / f"{n}.json").read_text())["sims"][sim]
                x = [int(b) for b in s]
                ax.plot(x, [statistics.mean(v) for v in s.values()], style, label=f"{n}: mean")
                ax.plot(x, [min(v) for v in s.values()], style[0] + "--", alpha=0.5, label=f"{n}: worst seed")
            ax.axhline(0.95, color="k", lw=0.6)
            ax.set(xscale="log", xlabel="rows", title=sim)
        axes[0].set_ylabel("goodput / best fixed gamma")
        save_figure(fig, HERE / "dropped_launch.png", axes[0])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
