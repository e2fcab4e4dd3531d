"""EAGLE-3 against the draft model and Medusa on the demo target: acceptance at T=0 and T=0.7.

    python -m cluster.bench.eagle3_bench --out benchmarks/eagle3 --threads 2

Held-out code prompts (the stdlib's test suites, never trained on), one stream at a time,
gamma 4 (Medusa: its sparse tree's first 4 nodes; eagle3-tree: an EAGLE-2 tree of 4 and 8
nodes, greedy rows only): mean accepted length per verify pass, acceptance per draft and per
position, tokens/s (a shared CPU: indicative only). Also what the disaggregated hop carries
for EAGLE-3: the aux hidden states of each step's accepted tokens.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from cluster.bench.report import figure, write_json
from cluster.bench.workloads import code_prompts
from cluster.config import parse_config
from cluster.engine.drafters.eagle3 import Eagle3Drafter
from cluster.engine.sampling import SamplingParams
from cluster.engine.scheduling.sequence import SpecParams
from cluster.serve.build import build_engine


def run(engine, prompts, new_tokens: int, gamma: int, drafter: str, temperature: float) -> dict:
    tot = {"drafted": 0, "accepted": 0, "verify_steps": 0, "tokens": 0}
    pos_acc = [0.0] * gamma
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        sp = SamplingParams(max_tokens=new_tokens, temperature=temperature, seed=i, ignore_eos=True)
        r = engine.generate([p], sp, SpecParams("fixed", gamma), drafter)[0]
        tot["tokens"] += len(r["token_ids"])
        for k in ("drafted", "accepted", "verify_steps"):
            tot[k] += r["spec"][k]
        for j, a in enumerate(r["spec"]["per_position"][:gamma]):
            pos_acc[j] += a / len(prompts)
    wall = time.perf_counter() - t0
    return {"drafter": drafter, "gamma": gamma, "temperature": temperature, **tot,
            "mean_accepted_len": (tot["accepted"] + tot["verify_steps"]) / max(1, tot["verify_steps"]),
            "acceptance_rate": tot["accepted"] / max(1, tot["drafted"]),
            "per_position": [round(a, 3) for a in pos_acc], "tokens_per_s": tot["tokens"] / wall}


def plot(results: list[dict], path: Path) -> None:
    """Mean accepted length by drafter at T=0 and T=0.7 (trees: greedy rows only), and the
    acceptance of each draft position at T=0."""
    plt = figure()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    label = lambda r: r["drafter"] + (f"\n{r['gamma']} nodes" if r["drafter"] == "eagle3-tree" else "")  # noqa: E731
    names = list(dict.fromkeys(label(r) for r in results))
    for i, t in enumerate((0.0, 0.7)):
        got = {label(r): r["mean_accepted_len"] for r in results if r["temperature"] == t}
        xs = [j + (i - 0.5) * 0.38 for j, n in enumerate(names) if n in got]
        bars = ax1.bar(xs, [got[n] for n in names if n in got], 0.38, label=f"T={t}")
        ax1.bar_label(bars, fmt="%.2f", fontsize=8)
    ax1.set_xticks(range(len(names)), names, fontsize=8)
    ax1.set_ylabel("mean accepted length (tokens per verify pass)")
    ax1.set_title("demo target, held-out code prompts, gamma 4")
    ax1.legend()
    for r in results:
        if r["temperature"] == 0.0 and r["gamma"] == 4:  # the bar chart's gamma
            ax2.plot(range(1, len(r["per_position"]) + 1), r["per_position"], marker="o", label=label(r).replace("\n", " "))
    ax2.set_xticks(range(1, 1 + max(r["gamma"] for r in results if r["drafter"] == "eagle3")))
    ax2.set_xlabel("draft position")
    ax2.set_ylabel("share of verify passes accepting it (T=0)")
    ax2.set_ylim(0, 1)
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/eagle3")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--drafters", default="eagle3,eagle3-tree,model,medusa",
                    help="which rows to run; with --update, the others are kept from the existing JSON "
                         "(a retrained head re-measures eagle3 only)")
    ap.add_argument("--update", action="store_true", help="replace the rows run in the existing JSON")
    args = ap.parse_args(argv)
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    # No prefix cache: every row runs the same prompts, and a cached prompt is not recomputed, so
    # the target has no aux states for it and an EAGLE-3 head starts its window past it; rows
    # would differ by what ran before them (benchmarks/eagle3/README.md: cold is the fair row)
    engine = build_engine(parse_config({"placement": "colocated", "engine": {"max_model_len": 1024, "prefix_caching": False},
                                        "speculation": {"gamma_max": 8}}))
    eagle = engine.drafters["eagle3"]
    engine.drafters["eagle3-tree"] = Eagle3Drafter(eagle.head, 4, eagle.max_len, tree_width=4)
    prompts = code_prompts(args.prompts, seed=1)
    engine.generate(prompts[:1], SamplingParams(max_tokens=8), SpecParams("fixed", 2), "eagle3")  # warm-up
    g = args.gamma
    runs = [(d, g, t) for t in (0.0, 0.7) for d in ("eagle3", "model", "medusa")]
    runs += [("eagle3-tree", g, 0.0), ("eagle3-tree", 2 * g, 0.0)]
    chosen = args.drafters.split(",")
    runs = [r for r in runs if r[0] in chosen]
    results = []
    for d, gamma, t in runs:
        r = run(engine, prompts, args.new_tokens, gamma, d, t)
        results.append(r)
        print(f"{d:12s} gamma={gamma} T={t}: mean accepted {r['mean_accepted_len']:.2f}, acceptance "
              f"{r['acceptance_rate']:.2f}, per position {r['per_position']}, {r['tokens_per_s']:.0f} tok/s")
    m = engine.model
    aux_bytes = m.shape.hidden * len(m.aux_layers) * 4  # fp32 here
    old = Path(args.out) / "eagle3.json"
    if args.update and old.is_file():  # the rows not run now, as last measured, in the usual order
        kept = [r for r in json.loads(old.read_text())["results"] if r["drafter"] not in chosen]
        order = {(d, gm, t): i for i, (d, gm, t) in enumerate(
            [(d, g, t) for t in (0.0, 0.7) for d in ("eagle3", "model", "medusa")] + [("eagle3-tree", g, 0.0), ("eagle3-tree", 2 * g, 0.0)])}
        results = sorted(kept + results, key=lambda r: order.get((r["drafter"], r["gamma"], r["temperature"]), 99))
    greedy = next(r for r in results if r["drafter"] == "eagle3" and r["temperature"] == 0.0)
    hop = {"aux_bytes_per_token": aux_bytes, "aux_layers": list(m.aux_layers),
           "aux_bytes_per_step_per_sequence": round(aux_bytes * greedy["mean_accepted_len"]),
           "llama_3_1_8b_bf16_bytes_per_token": 3 * 4096 * 2}
    path = write_json(args.out, "eagle3", {"prompts": len(prompts), "new_tokens": args.new_tokens,
                                           "head": eagle.head.cfg.__dict__ | {"aux_layers": list(eagle.aux_layers)},
                                           "results": results, "disaggregated_hop": hop})
    plot(results, path.with_suffix(".png"))
    print(f"wrote {path} and {path.with_suffix('.png').name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
