"""Plot a gpu_bench.json (scripts/gpu_bench.py) as a PNG beside it.

    python -m cluster.bench.plot_gpu benchmarks/gpu/gpu_bench.json [gpu_bench_sweep.json]
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
    if "speculation_batch1" in r:  # draft model on the demo pair embedded in the 8B shape
        sd, title = r["speculation_batch1"], "draft model (demo pair in 8B dimensions)"
        ideal = {n: v["ideal_speedup"] * plain for n, v in sd.items()}
    else:  # older runs: early-exit self-drafting on random weights
        sd, title = r["self_draft"], "early-exit self-drafting (random weights)"
        ideal = {n: v["ideal_tokens_per_s"] for n, v in sd.items()}
    names = list(sd)
    x = range(len(names))
    b.bar([i - 0.2 for i in x], [sd[n]["tokens_per_s"] for n in names], 0.4, label="measured")
    b.bar([i + 0.2 for i in x], [ideal[n] for n in names], 0.4, label="ideal E[N] t/(t + g t_draft)")
    b.axhline(plain, color="gray", ls="--", label="plain decoding")
    b.set_xticks(list(x), [f"{n}\nacc {sd[n]['acceptance_rate']:.2f}" for n in names], fontsize=8)
    b.set(ylabel="tokens/s, batch 1", title=title)
    b.legend(fontsize=8)
    sw = r.get("concurrency_sweep") or r.get("concurrency_sweep_partial", [])  # partial: a run cut short
    if len(argv or sys.argv[1:]) > 1:  # a separate sweep run (gpu_bench_sweep.json)
        sw = json.loads(Path((argv or sys.argv[1:])[1]).read_text())["concurrency_sweep"]
    c.plot([s["concurrency"] for s in sw], [s["off_tokens_per_s"] for s in sw], "o-", label="speculation off")
    if sw and "fixed4_tokens_per_s" in sw[0]:
        c.plot([s["concurrency"] for s in sw], [s["fixed4_tokens_per_s"] for s in sw], "^:", label="gamma 4")
    c.plot([s["concurrency"] for s in sw], [s["goodput_tokens_per_s"] for s in sw], "s--", label="goodput controller")
    c.set(xscale="log", xlabel="concurrent streams", ylabel="tokens/s", title="concurrency sweep")
    c.legend()
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=110)
    print("wrote", path.with_suffix(".png"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
