"""Plot a gpu_scale.json (scripts/gpu_scale.py) as a PNG beside it.

    python -m cluster.bench.plot_scale benchmarks/gpu/h100/paged/gpu_scale.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from cluster.bench.report import figure

MODES = (("off", "plain"), ("fixed4", "gamma 4"), ("goodput", "goodput controller"))


def main(argv=None) -> int:
    path = Path((argv or sys.argv[1:])[0])
    r = json.loads(path.read_text())
    pts = r["sweep"]
    c = [p["concurrency"] for p in pts]
    plt = figure()
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.2))
    a.plot(c, [p["roofline_tokens_per_s"] for p in pts], "k--", label="workload roofline")
    if all("closed_loop_roofline_tokens_per_s" in p for p in pts):
        a.plot(c, [p["closed_loop_roofline_tokens_per_s"] for p in pts], "k:", label="closed-loop roofline")
    for key, label in MODES:
        a.plot(c, [p[key]["tokens_per_s"] for p in pts], "o-", label=label)
        b.plot(c, [p[key]["host_ms_per_step"] for p in pts], "o-", label=label)
    a.set(xscale="log", xlabel="streams in flight", ylabel="output tokens/s",
          title=f"640-token prompts, 64-192 new tokens ({r['device']})")
    b.set(xscale="log", yscale="log", xlabel="streams in flight", ylabel="ms per step",
          title="step wall time minus CUDA-graph GPU time")
    for ax in (a, b):
        ax.set_xticks(c, [str(x) for x in c])
        ax.legend()
        ax.grid(alpha=0.3)
    fig.tight_layout()
    out = path.with_suffix(".png")
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
