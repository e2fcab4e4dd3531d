"""Where a gpu_scale.json's plain runs spent their wall time (scripts/gpu_scale.py's `gpu_by_kind`),
against the roofline's two parts, as a PNG: one bar pair per file and level.

    python -m cluster.bench.plot_kinds OUT.png A.json [B.json ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from cluster.bench.report import figure

KINDS = (("decode", "decode graphs"), ("prefill", "prefill graphs"), ("eager", "eager prefill passes"))


def bars(r: dict, label: str) -> list[tuple[str, dict, dict]]:
    """(label, measured seconds by part, roofline seconds by part) for each level's plain run."""
    out = []
    for p in r["sweep"]:
        x = p["off"]
        n = p["requests"]
        prefill = 2 * r["param_count"] * r["sweep_prompt_tokens"] * n / r["matmul_flops"]
        total = x["tokens_per_s"] * x["wall_s"] / p["roofline_tokens_per_s"]  # the roofline's seconds
        parts = {name: x["gpu_by_kind"].get(k, {}).get("gpu_s", 0.0) for k, name in KINDS}
        parts["host (GPU idle)"] = max(0.0, x["wall_s"] - x["gpu_s"])
        out.append((f"{label}\n{p['concurrency']} streams", parts, {"prefill at FLOPs bound": prefill,
                                                                      "decode at bytes bound": total - prefill}))
    return out


def main(argv=None) -> int:
    args = argv or sys.argv[1:]
    png, files = Path(args[0]), [Path(a) for a in args[1:]]
    rows = [b for f in files for b in bars(json.loads(f.read_text()), f.stem)]
    plt = figure()
    fig, ax = plt.subplots(figsize=(max(6, 2.2 * len(rows)), 4.5))
    for i, (label, parts, roof) in enumerate(rows):
        bottom = 0.0
        for j, (k, v) in enumerate(parts.items()):
            ax.bar(i - 0.2, v, 0.38, bottom=bottom, color=f"C{j}", label=k if i == 0 else None)
            bottom += v
        bottom = 0.0
        for j, (k, v) in enumerate(roof.items()):
            ax.bar(i + 0.2, v, 0.38, bottom=bottom, color=f"C{j + 5}", hatch="//", label=k if i == 0 else None)
            bottom += v
    ax.set_xticks(range(len(rows)), [r[0] for r in rows], fontsize=8)
    ax.set(ylabel="seconds (plain run)", title="plain runs: measured (left) against the roofline (right)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    print("wrote", png)
    return 0


if __name__ == "__main__":
    sys.exit(main())
