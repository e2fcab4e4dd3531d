"""Plot a gpu_bench.json (scripts/gpu_bench.py) as a PNG beside it.

    python -m cluster.bench.plot_gpu benchmarks/gpu/gpu_bench.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from cluster.bench.report import figure


def main(argv=None) -> int:
    path = Path((argv or sys.argv[1:])[0])
    r = json.loads(path.read_text())
    plt = figure()
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(15, 4.2))
    plain = r["plain_batch1"]["tokens_per_s"]
    a.bar(["ceiling\n(bytes/bandwidth)", "plain decode\n(graphs, FA3)"], [r["ceiling_tokens_per_s"], plain],
          color=["gray", "tab:blue"])
    a.set(ylabel="tokens/s, batch 1", title=f"8B-shaped Llama, {r['device']}\n{plain / r['ceiling_tokens_per_s']:.0%} of ceiling")
    sd = r["self_draft"]
    names = list(sd)
    x = range(len(names))
    b.bar([i - 0.2 for i in x], [sd[n]["tokens_per_s"] for n in names], 0.4, label="measured")
    b.bar([i + 0.2 for i in x], [sd[n]["ideal_tokens_per_s"] for n in names], 0.4, label="ideal from measured parts")
    b.axhline(plain, color="gray", ls="--", label="plain decoding")
    b.set_xticks(list(x), [f"{n}\nacc {sd[n]['acceptance_rate']:.2f}" for n in names], fontsize=8)
    b.set(ylabel="tokens/s", title="early-exit self-drafting (random weights)")
    b.legend(fontsize=8)
    sw = r["concurrency_sweep"]
    c.plot([s["concurrency"] for s in sw], [s["off_tokens_per_s"] for s in sw], "o-", label="speculation off")
    c.plot([s["concurrency"] for s in sw], [s["goodput_tokens_per_s"] for s in sw], "s--", label="goodput controller")
    c.set(xscale="log", xlabel="concurrent streams", ylabel="tokens/s", title="concurrency sweep")
    c.legend()
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=110)
    print("wrote", path.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
