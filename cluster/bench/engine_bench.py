"""Single-stream greedy decoding speed of the in-process engine: off, n-gram, draft model.

    python -m cluster.bench.engine_bench --out benchmarks/engine_cpu

For each configuration: tokens/s for `--new-tokens` new tokens per prompt, acceptance,
mean accepted length, and where the time goes (target verify passes vs drafting).
"""

from __future__ import annotations

import argparse
import time

from tqdm.auto import tqdm

from cluster.bench.report import figure, write_json
from cluster.bench.workloads import code_prompts
from cluster.config import parse_config
from cluster.engine.sampling import SamplingParams
from cluster.engine.scheduling.sequence import SpecParams
from cluster.serve.build import build_engine


def run(engine, prompts, new_tokens: int, spec: SpecParams, drafter: str | None) -> dict:
    times = {"verify_s": 0.0, "draft_s": 0.0, "steps": 0}

    def observe(obs):
        times["verify_s"] += obs.verify_s
        times["draft_s"] += obs.draft_s
        times["steps"] += 1

    engine.on_verify = observe
    tokens = drafted = accepted = verify_steps = 0
    t0 = time.perf_counter()
    for p in prompts:  # one stream at a time
        r = engine.generate([p], SamplingParams(max_tokens=new_tokens, ignore_eos=True), spec, drafter)[0]
        tokens += len(r["token_ids"])
        drafted += r["spec"]["drafted"]
        accepted += r["spec"]["accepted"]
        verify_steps += r["spec"]["verify_steps"]
    wall = time.perf_counter() - t0
    engine.on_verify = None
    return {"tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall,
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "mean_accepted_len": (accepted + verify_steps) / verify_steps if verify_steps else 1.0,
            "verify_ms_per_step": 1e3 * times["verify_s"] / max(1, times["steps"]),
            "draft_ms_per_step": 1e3 * times["draft_s"] / max(1, times["steps"]),
            "time_share": {"verify": times["verify_s"] / wall, "draft": times["draft_s"] / wall}}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/engine_cpu")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--gammas", default="2,4,8")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"], help="engine.kv_cache_dtype")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    args = ap.parse_args(argv)
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    engine = build_engine(parse_config({"models": {"dtype": args.dtype, "device": args.device},
                                        "engine": {"max_model_len": 1024, "kv_cache_dtype": args.kv_cache_dtype}}))
    prompts = code_prompts(args.prompts, seed=1)
    engine.generate(prompts[:1], SamplingParams(max_tokens=8), SpecParams("fixed", 2))  # warm-up
    runs = [("off", 0, None)] + [(d, g, d) for d in ("ngram", "model") for g in map(int, args.gammas.split(","))]
    results = []
    for name, g, drafter in tqdm(runs, desc="engine bench"):
        spec = SpecParams("off") if name == "off" else SpecParams("fixed", g)
        r = run(engine, prompts, args.new_tokens, spec, drafter)
        results.append({"drafter": name, "gamma": g, **r})
        tqdm.write(f"{name:6s} gamma={g}: {r['tokens_per_s']:.1f} tok/s, acceptance {r['acceptance_rate']:.2f}, "
                   f"verify {r['verify_ms_per_step']:.1f} ms/step, draft {r['draft_ms_per_step']:.1f} ms/step")
    base = results[0]["tokens_per_s"]
    for r in results:
        r["speedup"] = r["tokens_per_s"] / base
    path = write_json(args.out, "engine_bench", {"new_tokens": args.new_tokens, "prompts": len(prompts),
                                                  "results": results})
    plt = figure()
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.axhline(base, color="gray", ls="--", label="speculation off")
    for d, m in (("ngram", "o-"), ("model", "s-")):
        rs = [r for r in results if r["drafter"] == d]
        ax.plot([r["gamma"] for r in rs], [r["tokens_per_s"] for r in rs], m, label=f"{d} drafter")
    ax.set(xlabel="gamma (draft tokens per step)", ylabel="tokens/s (single stream, greedy)",
           title=f"Engine on CPU, demo pair, {args.new_tokens} new tokens")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=120)
    print(f"wrote {path} and {path.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
