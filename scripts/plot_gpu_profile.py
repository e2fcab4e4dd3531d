"""Plot a batch-1 decode step's kernel time by kind, before and after the fused GEMV path.

    python scripts/plot_gpu_profile.py benchmarks/gpu/h100/gpu_profile_cublas_baseline.json \
        benchmarks/gpu/h100/gpu_profile.json benchmarks/gpu/h100/gpu_profile.png
"""

from __future__ import annotations

import json
import sys

from cluster.bench.report import figure

KINDS = [("projections (GEMV/GEMM)", ("nvjet", "_gemv", "gemm", "splitKreduce")),
         ("attention (FA3)", ("flash",)),
         ("KV write / index", ("index",)),
         ("norms, rope, SiLU, adds, casts", ("triton_", "elementwise", "copy", "Memcpy", "Memset"))]


def by_kind(path: str) -> tuple[dict[str, float], dict]:
    d = json.load(open(path))["breakdown"]
    out = {k: 0.0 for k, _ in KINDS} | {"other": 0.0}
    for row in d["top"]:
        kind = next((k for k, keys in KINDS if any(s in row["kernel"] for s in keys)), "other")
        out[kind] += row["us"] / 1e3
    return out, d


def main(before: str, after: str, png: str) -> None:
    plt = figure()
    fig, ax = plt.subplots(figsize=(9, 4.5))
    bottoms = [0.0, 0.0]
    runs = [by_kind(before), by_kind(after)]
    labels = [f"cuBLAS + compiled elementwise\n{runs[0][1]['kernel_count']} kernels, graph step {runs[0][1]['graph_step_ms']:.2f} ms",
              f"fused Triton GEMV + FA3 append\n{runs[1][1]['kernel_count']} kernels, graph step {runs[1][1]['graph_step_ms']:.2f} ms"]
    for kind in [k for k, _ in KINDS] + ["other"]:
        vals = [r[0][kind] for r in runs]
        ax.bar(labels, vals, bottom=bottoms, label=kind)
        bottoms = [b + v for b, v in zip(bottoms, vals)]
    ideal = 15.0e9 / (json.load(open(after))["copy_bandwidth_TBps"] * 1e12) * 1e3
    ax.axhline(ideal, color="black", ls="--", label=f"weights / copy bandwidth ({ideal:.2f} ms)")
    ax.set(ylabel="GPU kernel time per decode step (ms)",
           title="8B-shaped Llama, bf16, batch 1, 512-token context, H100 (eager profile)")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(png, dpi=120)


if __name__ == "__main__":
    main(*sys.argv[1:4])
