"""Before/after of scripts/gpu_scale.py sweeps run on one machine: a table (stdout), compare.json
and compare.png beside this file.

    PYTHONPATH=. python3 benchmarks/gpu/drafts_on_device/compare.py
"""

from __future__ import annotations

import json
from pathlib import Path

from cluster.bench.report import figure, save_figure

HERE = Path(__file__).parent
RUNS = {"greedy": ("before.json", "after.json"), "T=0.8": ("before_t08.json", "after_t08.json")}
MODES = ("off", "fixed4", "goodput")


def point(path: Path) -> dict:
    out = {}
    for p in json.loads(path.read_text())["sweep"]:
        out[p["concurrency"]] = {m: {"tokens_per_s": p[m]["tokens_per_s"], "host_ms_per_step": p[m]["host_ms_per_step"],
                                     "wall_over_gpu": p[m]["wall_s"] / p[m]["gpu_s"]} for m in MODES}
        out[p["concurrency"]]["goodput_over_best"] = p["goodput_over_best"]
    return out


def main() -> int:
    table = {run: {"before": point(HERE / b), "after": point(HERE / a)} for run, (b, a) in RUNS.items()}
    (HERE / "compare.json").write_text(json.dumps(table, indent=1))
    print("| sampling | streams | mode | tok/s before -> after | host ms a step | wall / GPU |")
    print("|---|---|---|---|---|---|")
    for run, t in table.items():
        for c in t["after"]:
            for m in MODES:
                b, a = t["before"][c][m], t["after"][c][m]
                print(f"| {run} | {c} | {m} | {b['tokens_per_s']:,.0f} -> {a['tokens_per_s']:,.0f} "
                      f"({a['tokens_per_s'] / b['tokens_per_s']:.2f}x) | {b['host_ms_per_step']:.2f} -> "
                      f"{a['host_ms_per_step']:.2f} | {b['wall_over_gpu']:.2f} -> {a['wall_over_gpu']:.2f} |")
    plt = figure()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.38
    bars = [(run, c) for run, t in table.items() for c in t["after"]]
    x = range(len(bars))
    for ax, key, title in ((axes[0], "tokens_per_s", "gamma 4: output tokens/s"),
                           (axes[1], "host_ms_per_step", "gamma 4: host ms a step (wall - GPU)")):
        for k, side in enumerate(("before", "after")):
            ax.bar([i + (k - 0.5) * width for i in x], [table[r][side][c]["fixed4"][key] for r, c in bars],
                   width, label=f"{side} ({'8d690bb' if side == 'before' else 'bd305fe'})")
        ax.set_xticks(list(x), [f"{r}\n{c} streams" for r, c in bars])
        ax.set_title(title)
    fig.suptitle("drafts left on the device into the verify pass, one H200, 8B-shaped demo pair")
    save_figure(fig, HERE / "compare.png", *axes)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
