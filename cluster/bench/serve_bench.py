"""Single-stream speed through the real path (gRPC -> Serve proxy -> Router -> Verifier
[-> Drafter]) for no speculation, colocated and disaggregated drafting (the draft call
direct to the drafter replica, and through Serve's request path), beside the local engine;
and the gRPC + Serve overhead on time to first token.

    python -m cluster.bench.serve_bench --out benchmarks/serve_cpu
"""

from __future__ import annotations

import argparse
import statistics
import time

from tqdm.auto import tqdm

from cluster.bench.report import figure, write_json
from cluster.bench.workloads import code_prompts
from cluster.config import parse_config


def _measure(gen_fn, prompts, repeats: int) -> dict:
    toks, secs, ttfts, acc = 0, 0.0, [], []
    for _ in range(repeats):
        for p in prompts:
            t0 = time.perf_counter()
            first = None
            n = 0
            stats = None
            for ids, final in gen_fn(p):
                if first is None and ids:
                    first = time.perf_counter()
                n += len(ids)
                stats = final or stats
            secs += time.perf_counter() - t0
            toks += n
            ttfts.append(1e3 * (first - t0))
            if stats is not None:
                acc.append(stats)
    return {"tokens_per_s": toks / secs, "ttft_ms_p50": statistics.median(ttfts),
            "acceptance_rate": statistics.mean(acc) if acc else 0.0}


def local(prompts, args) -> dict:
    from cluster.engine.sampling import SamplingParams
    from cluster.engine.scheduling.sequence import SpecParams
    from cluster.serve.build import build_engine

    import torch

    torch.set_num_threads(1)  # as in a Serve replica with one CPU (Ray sets OMP_NUM_THREADS=1)
    engine = build_engine(parse_config(_base(args)))
    out = {"device": str(engine.runner.device), "backend": engine.backend}
    for name, spec in (("off", SpecParams("off")), ("spec", SpecParams("fixed", args.gamma))):
        def gen(p, spec=spec):  # noqa: B023
            sid = engine.add_request(p, SamplingParams(max_tokens=args.new_tokens, ignore_eos=True), spec, None)
            while engine.has_work:
                for o in engine.step():
                    if o.seq_id == sid:
                        yield o.token_ids, (o.stats["spec"]["acceptance_rate"] if o.finished else None)
        gen(prompts[0])  # build the generator once: warm-up below
        list(gen(prompts[0]))
        out[name] = _measure(gen, prompts, args.repeats)
    return out


def _step_split(before: dict, after: dict) -> dict:
    """Mean milliseconds per verify step spent waiting for drafts and in the verify pass."""
    steps = max(1, after["verify_steps"] - before["verify_steps"])
    out = {f"{k}_ms_per_step": 1e3 * (after[f"{k}_s"] - before[f"{k}_s"]) / steps
           for k in ("draft", "verify", "draft_compute")}
    return {**out, **{k: after[k] - before[k] for k in ("ahead_hits", "ahead_misses")}}


def _base(args) -> dict:
    return {"models": {"device": args.device, "target": args.target, "draft": args.draft, "dtype": args.dtype},
            "engine": {"max_num_seqs": 8, "compile": args.compile, "draft_look_ahead": args.look_ahead == "on"}}


def _resources(args) -> dict:
    """With GPUs: the verifier on one, the drafter on another when there are two."""
    if not args.gpus:
        return {}
    share = 1 if args.gpus >= 2 else 0.5
    return {"verifier": {"ray_actor_options": {"num_gpus": share}},
            "drafter": {"ray_actor_options": {"num_gpus": share}}}


MODES = {"colocated": ("colocated", "direct"), "disaggregated": ("disaggregated", "direct"),
         "disaggregated_handle": ("disaggregated", "handle")}
LABELS = {"local": "local engine", "colocated": "gRPC colocated", "disaggregated": "gRPC disaggregated\n(direct draft call)",
          "disaggregated_handle": "gRPC disaggregated\n(draft call via Serve handle)"}


def through_grpc(prompts, args, mode: str, port: int) -> dict:
    from ray import serve

    from cluster.client import Client
    from cluster.serve.launch import run_app

    placement, transport = MODES[mode]
    name = f"bench-{mode.replace('_', '-')}"
    run_app(parse_config({"placement": placement, "network": {"grpc_port": port, "app_name": name,
                                                               "route_prefix": f"/{name}"},
                          "router": {"drafter_transport": transport}, **_base(args), **_resources(args)}))
    out = {}
    verifier = serve.get_deployment_handle("Verifier", app_name=name)
    with Client(f"localhost:{port}", application=name) as c:
        for mode, spec in (("off", "off"), ("spec", args.gamma)):
            def gen(p, spec=spec):
                for ch in c.generate_stream(p, max_tokens=args.new_tokens, speculation=spec):
                    yield list(ch.token_ids), (ch.spec.acceptance_rate if ch.final else None)
            list(gen(prompts[0]))  # warm-up (drafter state, compile caches)
            before = verifier.stats.remote().result()
            out[mode] = _measure(gen, prompts, args.repeats)
            out[mode].update(_step_split(before, verifier.stats.remote().result()))
    serve.delete(name)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/serve_cpu")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--port", type=int, default=9310)
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda (models.device)")
    ap.add_argument("--gpus", type=int, default=0, help="GPUs for Ray (2: verifier and drafter on different GPUs)")
    ap.add_argument("--target", default="demo-target", help="target model (demo-8b-target: the 8B-shaped pair)")
    ap.add_argument("--draft", default="demo-draft")
    ap.add_argument("--dtype", default="float32", help="bfloat16 on Hopper (FA3)")
    ap.add_argument("--compile", action="store_true", help="engine.compile: the GPU fast path (Triton GEMV)")
    ap.add_argument("--modes", default="local,colocated,disaggregated,disaggregated_handle")
    ap.add_argument("--look-ahead", choices=("on", "off"), default="on",
                    help="engine.draft_look_ahead: a colocated GPU drafter drafts during the verify")
    args = ap.parse_args(argv)
    modes = args.modes.split(",")
    import ray

    from cluster.serve.launch import shutdown, start_serve

    prompts = code_prompts(args.prompts, seed=1)
    results: dict = {}
    bar = tqdm(total=len(modes), desc="serve bench")
    if "local" in modes:
        results["local"] = local(prompts, args)
        bar.update()
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the replicas below need the GPU memory the local engine held
    ray.init(num_cpus=4, num_gpus=args.gpus or None, include_dashboard=False, log_to_driver=False)
    start_serve(parse_config({"network": {"grpc_port": args.port, "http_port": args.port + 1}}), "HeadOnly")
    for mode in (m for m in modes if m in MODES):
        results[mode] = through_grpc(prompts, args, mode, args.port)
        path, summary = _write(args, results)  # after each mode: a run cut short keeps what it measured
        bar.update()
    shutdown()
    plt = figure()
    fig, ax = plt.subplots(figsize=(9, 4.5))
    keys = list(results)
    x = range(len(keys))
    ax.bar([i - 0.2 for i in x], [results[k]["off"]["tokens_per_s"] for k in keys], 0.4, label="speculation off")
    ax.bar([i + 0.2 for i in x], [results[k]["spec"]["tokens_per_s"] for k in keys], 0.4,
           label=f"draft model, gamma {args.gamma}")
    ax.set_xticks(list(x), [LABELS[k] for k in keys], fontsize=8)
    ax.set(ylabel="tokens/s (single stream, greedy)",
           title=f"{args.target} on {results.get('local', {}).get('device', 'the GPU')}: through Ray Serve + gRPC")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=120)
    print(summary)
    print(f"wrote {path}")
    return 0


def _write(args, results: dict):
    spec = {k: v["spec"]["tokens_per_s"] for k, v in results.items()}
    summary = {}
    if "colocated" in spec:
        for k in ("disaggregated", "disaggregated_handle"):
            if k in spec:
                summary[f"{k}_over_colocated"] = spec[k] / spec["colocated"]
        if "local" in results:
            summary["ttft_overhead_ms"] = results["colocated"]["off"]["ttft_ms_p50"] - results["local"]["off"]["ttft_ms_p50"]
    path = write_json(args.out, "serve_bench", {"target": args.target, "draft": args.draft, "new_tokens": args.new_tokens,
                                                "gamma": args.gamma, "results": results, "summary": summary})
    return path, summary


if __name__ == "__main__":
    raise SystemExit(main())
