"""The goodput controller over a rising load whose drafter must catch up after plain runs
(tests/policy/test_controller.py's CatchUpSim and ramp): tokens/s over plain decoding at each
level, 20 seeds. Writes NAME.json here, and catch_up.png of the runs here (before, per_row, after).

    PYTHONPATH=. python3 benchmarks/policy/catch_up/catch_up_sim.py --name after
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from cluster.bench.report import figure, save_figure
from cluster.policy import SpeculationPolicyConfig, make_controller
from tests.policy.test_controller import CatchUpSim, ramp

HERE = Path(__file__).parent
LEVELS = (1, 16, 64, 128, 256)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--name", required=True)
    ap.add_argument("--seeds", type=int, default=20)
    a = ap.parse_args()
    runs = []
    for seed in range(1, a.seeds + 1):
        ctrl = make_controller(SpeculationPolicyConfig(mode="goodput"))
        runs.append(ramp(ctrl, CatchUpSim(seed=seed), LEVELS, 400))
    out = {"levels": {b: {"mean": statistics.mean(r[b] for r in runs), "min": min(r[b] for r in runs),
                          "below_0.95": sum(r[b] < 0.95 for r in runs)} for b in LEVELS}, "seeds": a.seeds}
    (HERE / f"{a.name}.json").write_text(json.dumps(out, indent=1))
    for b, s in out["levels"].items():
        print(f"{a.name} {b:>4} rows: mean {s['mean']:.3f}, worst {s['min']:.3f}, {s['below_0.95']} of {a.seeds} below 0.95")
    names = [n for n in ("before", "per_row", "after") if (HERE / f"{n}.json").exists()]
    if len(names) > 1:
        plt = figure()
        fig, ax = plt.subplots(figsize=(6.5, 4))
        for name in names:
            lv = json.loads((HERE / f"{name}.json").read_text())["levels"]
            x = [int(b) for b in lv]
            ax.plot(x, [lv[b]["mean"] for b in lv], "o-", label=f"{name}: mean of {a.seeds} seeds")
            ax.plot(x, [lv[b]["min"] for b in lv], "x--", label=f"{name}: worst seed")
        ax.axhline(0.95, color="k", lw=0.6)
        ax.set(xscale="log", xlabel="rows", ylabel="goodput controller / plain decoding",
               title="drafter catch-up priced (simulated H100 costs)")
        save_figure(fig, HERE / "catch_up.png", ax)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
