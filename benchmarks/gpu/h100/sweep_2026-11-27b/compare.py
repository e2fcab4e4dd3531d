"""The goodput controller's sweeps on one H100 at three commits (scripts/gpu_scale.py): goodput over
the better of plain decoding and gamma 4 at each level, a table (stdout), compare.json and
compare.png beside this file.

    PYTHONPATH=. python3 benchmarks/gpu/h100/sweep_2026-11-27b/compare.py
"""

from __future__ import annotations

import json
from pathlib import Path

from cluster.bench.report import figure, save_figure

HERE = Path(__file__).parent
COMMITS = ("fa54992", "0ec5353", "79c8c8b", "747e611")  # 747e611: greedy only, levels 1, 16, 64, 256
RUNS = ("greedy", "t08")


def levels(path: Path) -> dict:
    out = {}
    for p in json.loads(path.read_text())["sweep"]:
        c = p["goodput"]["controller"]
        out[p["concurrency"]] = {"off": p["off"]["tokens_per_s"], "fixed4": p["fixed4"]["tokens_per_s"],
                                 "goodput": p["goodput"]["tokens_per_s"], "goodput_over_best": p["goodput_over_best"],
                                 "off_over_roofline": p["off_over_roofline"],
                                 "switch_readings": c.get("switch_cost", {}).get("readings")}
    return out


def main() -> int:
    table = {run: {sha: levels(HERE / f"{sha}_{run}.json") for sha in COMMITS if (HERE / f"{sha}_{run}.json").exists()}
             for run in RUNS}
    (HERE / "compare.json").write_text(json.dumps(table, indent=1))
    print("| sampling | streams | plain / gamma 4 tok/s (at 79c8c8b) | goodput / best: " + " | ".join(COMMITS) + " |")
    print("|---|---|---|" + "---|" * len(COMMITS))
    for run in RUNS:
        for c, p in table[run]["79c8c8b"].items():
            cells = " | ".join(f"{table[run][sha][c]['goodput_over_best']:.2f}" if c in table[run].get(sha, {}) else "-"
                               for sha in COMMITS)
            print(f"| {'greedy' if run == 'greedy' else 'T=0.8'} | {c} | {p['off']:,.0f} / {p['fixed4']:,.0f} | {cells} |")
    plt = figure()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, run in zip(axes, RUNS):
        for sha, lv in table[run].items():
            ax.plot(list(lv), [p["goodput_over_best"] for p in lv.values()], "o-", label=sha)
        ax.axhline(0.95, color="k", lw=0.6)
        ax.set(xscale="log", xlabel="streams", title=f"{'greedy' if run == 'greedy' else 'T=0.8'}: goodput / best of plain, gamma 4")
    axes[0].set_ylabel("goodput controller / best fixed")
    save_figure(fig, HERE / "compare.png", *axes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
