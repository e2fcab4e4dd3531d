"""Medusa heads against the draft-model and n-gram drafters: single-stream greedy decoding.

    python -m cluster.bench.medusa_bench --out benchmarks/medusa --threads 2

The demo target with its trained heads (cluster/models/demo/target/medusa_heads.safetensors)
on held-out code prompts: tokens/s and mean accepted tokens per verify pass for plain
decoding, the n-gram and draft-model drafters at several gammas, and Medusa with the top-1
chain and with its sparse tree at several sizes (gamma = tree nodes). Also each head's top-1
and top-5 accuracy on the same prompts (the target's greedy continuations, where the heads
never trained), next to the validation-split figures the training wrote.

On a shared CPU, other work steals time at random: every configuration runs `--repeats`
times, round-robin, and the fastest run is reported (all runs are in the json).
"""

from __future__ import annotations

import argparse
import json

from tqdm.auto import tqdm

from cluster.bench.engine_bench import run
from cluster.bench.report import figure, write_json
from cluster.bench.workloads import code_prompts
from cluster.config import DEMO_DIR, parse_config
from cluster.engine.drafters.medusa import CHAIN, CONFIG_FILE, MedusaDrafter
from cluster.engine.sampling import SamplingParams
from cluster.engine.scheduling.sequence import SpecParams
from cluster.serve.build import build_engine


def held_out_accuracy(engine, prompts: list[str], new_tokens: int) -> list[list[float]]:
    """Top-i accuracy of each head along the target's greedy continuation of each prompt."""
    import torch

    from cluster.training.medusa import accuracy, continuations, head_pairs, label_ranks

    heads, model = engine.drafters["medusa"].heads, engine.model
    ranks = []
    for p in prompts:  # one at a time: prompts differ in length
        h, y = continuations(model, [engine.tokenizer.encode(p)], new_tokens, 0.0, 0, batch=1, desc="accuracy")
        dev = model.lm_head.weight.device  # continuations come back on the CPU
        ranks.append(label_ranks(heads, model.lm_head.weight, *head_pairs(h.to(dev), y.to(dev), heads.num_heads)).cpu())
    return accuracy(torch.cat(ranks))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/medusa")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--gammas", default="2,4,8", help="for the n-gram and draft-model drafters")
    ap.add_argument("--trees", default="4,8,16,32", help="Medusa sparse-tree sizes (gamma = nodes)")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="cpu", help="cpu or cuda (the demo pair in fp32: SDPA, tree attention)")
    args = ap.parse_args(argv)
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    trees = [int(g) for g in args.trees.split(",")]
    engine = build_engine(parse_config({"models": {"device": args.device}, "engine": {"max_model_len": 1024},
                                        "speculation": {"gamma_max": max(trees + [8])}}))
    medusa = engine.drafters["medusa"]
    engine.drafters["medusa-chain"] = MedusaDrafter.for_target(medusa.heads, engine.model, CHAIN[: medusa.heads.num_heads])
    prompts = code_prompts(args.prompts, seed=1)
    engine.generate(prompts[:1], SamplingParams(max_tokens=8), SpecParams("fixed", 2), "medusa")  # warm-up
    gammas = [int(g) for g in args.gammas.split(",")]
    runs = ([("off", 0, None)] + [(d, g, d) for d in ("ngram", "model") for g in gammas]
            + [("medusa-chain", medusa.heads.num_heads, "medusa-chain")] + [("medusa", g, "medusa") for g in trees])
    tries: list[list[dict]] = [[] for _ in runs]
    for _ in tqdm(range(args.repeats), desc="repeats"):
        for i, (name, g, drafter) in enumerate(tqdm(runs, desc="medusa bench", leave=False)):
            spec = SpecParams("off") if name == "off" else SpecParams("fixed", g)
            tries[i].append(run(engine, prompts, args.new_tokens, spec, drafter))
    results = []
    for (name, g, _), t in zip(runs, tries):
        r = max(t, key=lambda x: x["tokens_per_s"])
        results.append({"drafter": name, "gamma": g, **r, "tokens_per_s_all": [x["tokens_per_s"] for x in t]})
        print(f"{name:12s} gamma={g:2d}: {r['tokens_per_s']:6.1f} tok/s, mean accepted {r['mean_accepted_len']:.2f}, "
              f"verify {r['verify_ms_per_step']:.1f} ms/step, draft {r['draft_ms_per_step']:.1f} ms/step")
    base = results[0]["tokens_per_s"]
    for r in results:
        r["speedup"] = r["tokens_per_s"] / base
    acc = held_out_accuracy(engine, prompts, args.new_tokens)
    cfg = json.loads((DEMO_DIR / "target" / CONFIG_FILE).read_text())
    path = write_json(args.out, "medusa", {
        "new_tokens": args.new_tokens, "prompts": len(prompts), "tree": cfg["tree"], "results": results,
        "head_accuracy": {"held_out_top1": [round(a[0], 4) for a in acc], "held_out_top5": [round(sum(a), 4) for a in acc],
                          "validation_top1": [a[0] for a in cfg["head_accuracy_top_i"]],
                          "validation_top5": [round(sum(a), 4) for a in cfg["head_accuracy_top_i"]]}})
    _plot(results, base, path, args.new_tokens, args.device)
    print(f"wrote {path} and {path.with_suffix('.png')}")
    return 0


def _plot(results: list[dict], base: float, path, new_tokens: int, device: str = "cpu") -> None:
    plt = figure()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    kind = {"medusa": "medusa\ntree {}", "medusa-chain": "medusa\nchain {}", "ngram": "ngram\ng={}", "model": "model\ng={}"}
    labels = [kind[r["drafter"]].format(r["gamma"]) for r in results[1:]]
    colors = {"ngram": "tab:blue", "model": "tab:orange", "medusa-chain": "tab:olive", "medusa": "tab:green"}
    c = [colors[r["drafter"]] for r in results[1:]]
    x = range(len(labels))
    ax1.bar(x, [r["tokens_per_s"] for r in results[1:]], color=c)
    ax1.axhline(base, color="gray", ls="--", label=f"speculation off ({base:.0f} tok/s)")
    ax1.set(ylabel="tokens/s (single stream, greedy)", title=f"Demo target on {device.upper()}, {new_tokens} new tokens")
    ax1.legend()
    ax2.bar(x, [r["mean_accepted_len"] for r in results[1:]], color=c)
    ax2.axhline(1, color="gray", ls="--")
    ax2.set(ylabel="tokens per verify pass", title="mean accepted length (accepted drafts + 1)")
    for ax in (ax1, ax2):
        ax.set_xticks(list(x), labels, fontsize=7)
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=120)


if __name__ == "__main__":
    raise SystemExit(main())
