"""Multi-GPU serve runs (issue 28) through the real gRPC path, on a local Ray that holds the
machine's GPUs; one part per device call, everything written under --out ($OUT).

    bash scripts/gpu_multi.sh drafter            # run 1: drafter on its own GPU, shared GPU, colocated
    bash scripts/gpu_multi.sh shared             # run 2: one drafter GPU for k verifiers (KS=1,3,7)
    bash scripts/gpu_multi.sh routing            # run 3: cache-aware routing vs Serve's default
    python scripts/gpu_multi.py --cpu-smoke      # all three on CPU with fake GPUs: orchestration only

drafter: modes `colocated` (verifier and draft model in one process, one GPU), `shared` (a
  verifier and a Drafter replica on one GPU, half each: the setting of every disaggregated
  figure so far), `own` (verifier on one GPU, Drafter replica on another). Each mode is
  deployed fresh, then a closed-loop concurrency sweep (gamma 4, greedy, 128 tokens), level 1
  being batch 1. Summary: each mode's tokens/s over colocated's per level, and per GPU.
shared: for each k in --ks with k + 1 GPUs present, k verifiers on a GPU each and one Drafter
  replica on one more (`own_xk`), against k colocated verifiers (`colocated_xk`); each level
  is k x that many streams. Summary: the cluster's tokens/s per GPU of both, and their ratio.
routing: two verifier replicas on a GPU each, the Redis-protocol KV directory, a shared-prefix
  workload with speculation off (cluster.bench.routing_bench), cache-aware routing against
  Serve's power of two. Summary: TTFT p50 of power of two over cache-aware (aim 2).

Every replica's GPU ids are checked against its mode before it is measured
(cluster.bench.placement); a mismatch stops the run. The JSON is rewritten after each mode, so
a call cut short keeps what it measured, and a mode that would not fit in --budget-s is
skipped and named in the JSON.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)

from cluster.bench import placement  # noqa: E402
from cluster.bench.placement import Mode  # noqa: E402

# 8B-shaped demo pair in bf16 on Hopper; the sweep's levels are streams per verifier replica
GPU = {"target": "demo-8b-target", "draft": "demo-8b-draft", "dtype": "bfloat16", "device": "cuda",
       "compile": True, "levels": [1, 4, 16, 32], "max_tokens": 128, "requests_per_stream": 2, "min_requests": 8, "max_num_seqs": 32, "kv_cache_gb": 8.0,
       "modes": "colocated,own,shared", "ks": "1,3,7", "budget_s": 540, "mode_s": 200,
       # routing: 16 prompts of 1024 tokens = 1024 blocks of 2 MiB (8B shape, bf16: 128 KiB a
       # token) = 2 GiB; a 1.5 GiB pool (768 blocks) per replica holds half of them beside the
       # live rows, not all: default routing makes both replicas cache all 16 and thrash
       "system_prompts": 16, "prompt_tokens": 1024, "per_prompt": 8, "concurrency": [4, 12],
       "routing_kv_gb": 1.5, "routing_max_tokens": 8, "max_model_len": 2048}
# the small pair in float32 on CPU, fake GPUs: placement and plumbing only, no speed
SMOKE = {"target": "demo-target", "draft": "demo-draft", "dtype": "float32", "device": "cpu",
         "compile": False, "levels": [1, 2], "max_tokens": 8, "requests_per_stream": 1, "min_requests": 2, "max_num_seqs": 4, "kv_cache_gb": None,
         "modes": "colocated,own,shared", "ks": "1,3", "budget_s": 1800, "mode_s": 0,
         "system_prompts": 4, "prompt_tokens": 128, "per_prompt": 2, "concurrency": [2],
         "routing_kv_gb": 0.02, "routing_max_tokens": 4, "max_model_len": 512}
GAMMA = 4


class PlacementError(RuntimeError):
    """Ray put replicas where the mode says they are not."""


def base_config(p: dict, port: int) -> dict:
    return {"name": "gpu-multi",
            "models": {"device": p["device"], "target": p["target"], "draft": p["draft"], "dtype": p["dtype"]},
            "engine": {"max_num_seqs": p["max_num_seqs"], "compile": p["compile"], "kv_cache_gb": p["kv_cache_gb"]},
            # one client host sends every stream: lift the per-peer cap (64)
            "router": {"per_client_concurrency": 4096},
            "kvdir": {"url": None, "routing": "power_of_two"},  # no prefix reuse in these workloads
            "network": {"grpc_port": port, "http_port": port + 1}}


def requests_at(concurrency: int, p: dict) -> int:
    """Requests at one level: each stream sends a few, so the level's ramp-up and tail matter little."""
    return max(p["requests_per_stream"] * concurrency, p["min_requests"])


def sweep(address: str, app: str, levels: list[int], k: int, p: dict) -> list[dict]:
    from cluster.bench.load import run_grpc, summarise
    from cluster.bench.workloads import code_prompts

    points = []
    for c in levels:
        n = c * k
        res, wall = run_grpc(address, app, code_prompts(requests_at(n, p), seed=c), n, p["max_tokens"], GAMMA)
        points.append({"per_verifier": c, "concurrency": n, **summarise(res, wall)})
        print(f"  {app} {n:4d} streams: {points[-1]['tokens_per_s']:8.1f} tok/s  TTFT p50 "
              f"{points[-1]['ttft_ms_p50']:7.1f} ms  acceptance {points[-1]['acceptance_rate']:.2f}", flush=True)
    return points


def drafting(app: str, mode: Mode) -> dict:
    """Who drafted: each verifier's draft count, the Drafter replica's calls (disaggregated)."""
    from ray import serve

    reps = serve.get_deployment_handle("StatsBoard", app).snapshot.remote().result()["replicas"]
    out = {"verifier_drafted": {r: s.get("drafted", 0) for r, s in reps.items()},
           # rows whose draft asked for during the previous verify pass was used / dropped: how
           # often a drafter working ahead paid (issue 39), since the mode was deployed
           "look_ahead": {r: {"used": s.get("ahead_hits", 0), "dropped": s.get("ahead_misses", 0)}
                          for r, s in reps.items()}}
    if mode.placement == "disaggregated":
        out["drafter_calls"] = serve.get_deployment_handle("Drafter", app).info.remote().result()["calls"]
    return out


def run_mode(mode: Mode, base: dict, p: dict) -> dict:
    from ray import serve

    from cluster.bench.load import run_grpc
    from cluster.bench.workloads import code_prompts
    from cluster.config import parse_config
    from cluster.serve.launch import run_app

    app = f"multi-{mode.name.replace('_', '-')}"
    t0 = time.perf_counter()
    run_app(parse_config(base, {**mode.overrides(), "network": {"app_name": app, "route_prefix": f"/{app}"}}))
    deploy_s = time.perf_counter() - t0
    try:
        gmap = placement.gpu_map(app, mode)
        problems = placement.check(mode, gmap)
        print(f"{mode.name}: deployed in {deploy_s:.0f} s; GPU ids {gmap}; "
              f"{'placement ok' if not problems else 'PLACEMENT WRONG: ' + '; '.join(problems)}", flush=True)
        if problems:
            raise PlacementError(f"{mode.name}: {'; '.join(problems)}")
        address = f"localhost:{base['network']['grpc_port']}"
        run_grpc(address, app, code_prompts(2 * mode.verifiers, seed=99), 2 * mode.verifiers, 16, GAMMA)  # warm-up
        t1 = time.perf_counter()
        points = sweep(address, app, p["levels"], mode.verifiers, p)
        for pt in points:
            pt["tokens_per_s_per_gpu"] = pt["tokens_per_s"] / mode.gpus
        return {"mode": mode.name, "placement": mode.placement, "verifiers": mode.verifiers, "gpus": mode.gpus,
                "verifier_num_gpus": mode.verifier_gpus, "drafter_num_gpus": mode.drafter_gpus,
                "gpu_map": gmap, "deploy_s": deploy_s, "measure_s": time.perf_counter() - t1,
                "points": points, **drafting(app, mode)}
    finally:
        serve.delete(app)


def run_modes(modes: list[Mode], base: dict, p: dict, t_start: float, write) -> dict:
    """Each mode in turn, skipping one that would not finish inside the budget. A mode is
    expected to take as long as the one before it, and the second 0.7 of the first: the first
    tunes kernels from cold, later ones reuse the Triton and inductor caches (H100, 8B-shaped
    pair: 191 s then 110 s, benchmarks/serve_gpu/h100_8b_zmq). The first: `mode_s`."""
    results, skipped, last = {}, [], float(p["mode_s"])
    for mode in modes:
        if time.perf_counter() - t_start + last > p["budget_s"]:
            skipped.append(mode.name)
            print(f"{mode.name}: skipped, would not fit the {p['budget_s']} s budget", flush=True)
            continue
        t = time.perf_counter()
        results[mode.name] = run_mode(mode, base, p)
        last = (time.perf_counter() - t) * (0.7 if len(results) == 1 else 1.0)
        write(results, skipped)
    return {"results": results, "skipped": skipped}


def ratios(results: dict, mode: str, base_mode: str, key: str) -> dict:
    """{per-verifier level: mode's key over base_mode's key} at the levels both measured."""
    if mode not in results or base_mode not in results:
        return {}
    b = {pt["per_verifier"]: pt[key] for pt in results[base_mode]["points"]}
    return {str(pt["per_verifier"]): pt[key] / b[pt["per_verifier"]]
            for pt in results[mode]["points"] if b.get(pt["per_verifier"])}


def part_drafter(args, p, base, t0) -> dict:
    by_name = {"colocated": placement.colocated(), "own": placement.own_drafter(), "shared": placement.SHARED}
    modes = [by_name[m] for m in args.modes.split(",")]
    if any(m.gpus > args.gpus for m in modes):
        raise SystemExit(f"mode {[m.name for m in modes if m.gpus > args.gpus]} needs more than {args.gpus} GPUs")

    def write(results, skipped):
        summary = {f"{m}_over_colocated": ratios(results, m, "colocated", "tokens_per_s")
                   for m in results if m != "colocated"}
        summary.update({f"{m}_per_gpu_over_colocated": ratios(results, m, "colocated", "tokens_per_s_per_gpu")
                        for m in results if m != "colocated"})
        return save(args, "drafter", {"results": results, "skipped": skipped, "summary": summary}, plot_drafter)

    out = run_modes(modes, base, p, t0, write)
    return write(out["results"], out["skipped"])


def part_shared(args, p, base, t0) -> dict:
    ks = [k for k in (int(x) for x in args.ks.split(",")) if k + 1 <= args.gpus]
    if not ks:
        raise SystemExit(f"no k in {args.ks} fits {args.gpus} GPUs (k verifiers + 1 drafter)")
    modes = [m for k in ks for m in (placement.own_drafter(k), placement.colocated(k))]

    def write(results, skipped):
        rows = []
        for k in ks:
            own, col = placement.own_drafter(k).name, placement.colocated(k).name
            if own in results and col in results:
                per = {pt["per_verifier"]: pt for pt in results[col]["points"]}
                rows.append({"k": k, "gpus_shared_drafter": k + 1, "gpus_colocated": k, "levels": [
                    {"per_verifier": pt["per_verifier"], "concurrency": pt["concurrency"],
                     "shared_drafter_per_gpu": pt["tokens_per_s_per_gpu"],
                     "colocated_per_gpu": per[pt["per_verifier"]]["tokens_per_s_per_gpu"],
                     "ratio": pt["tokens_per_s_per_gpu"] / per[pt["per_verifier"]]["tokens_per_s_per_gpu"]}
                    for pt in results[own]["points"] if pt["per_verifier"] in per]})
        return save(args, "shared", {"ks": ks, "results": results, "skipped": skipped, "summary": rows},
                    plot_shared)

    out = run_modes(modes, base, p, t0, write)
    return write(out["results"], out["skipped"])


def part_routing(args, p, base, t0) -> dict:
    from cluster.bench import routing_bench as rb
    from cluster.config import resolve_model_path
    from cluster.engine.worker.loader import load_tokenizer
    from cluster.kvdir.embedded import start_local_server

    two = Mode("two_verifiers", "colocated", 2, 1.0)
    maps: dict = {}

    def on_ready(app):
        gmap = placement.gpu_map(app, two)
        problems = placement.check(two, gmap)
        print(f"{app}: GPU ids {gmap}; {'placement ok' if not problems else 'PLACEMENT WRONG'}", flush=True)
        if problems:
            raise PlacementError(f"{app}: {'; '.join(problems)}")
        maps[app] = gmap

    prompts = rb.system_prompts(load_tokenizer(resolve_model_path(p["target"])), p["system_prompts"], p["prompt_tokens"])
    reqs = rb.workload(len(prompts), p["per_prompt"], seed=1)
    url, stop = start_local_server()
    cfg = {**base, "models": {**base["models"], "draft": None, "drafter": "none"},
           "engine": {"max_num_seqs": p["max_num_seqs"], "max_model_len": p["max_model_len"], "compile": False},
           "verifier": {"num_replicas": 2, "ray_actor_options": {"num_gpus": 1, "num_cpus": 1}},
           "kvdir": {"url": url}, "placement": "colocated"}
    rargs = argparse.Namespace(concurrency=p["concurrency"], max_tokens=p["routing_max_tokens"])
    runs = []
    try:
        for mode in ("power_of_two", "cache_aware"):
            runs += rb.run_mode(cfg, mode, p["routing_kv_gb"], prompts, reqs, rargs, on_ready)
    finally:
        stop()
    get = {(r["mode"], r["concurrency"]): r for r in runs}
    summary = {str(c): get[("power_of_two", c)]["ttft_ms_p50"] / get[("cache_aware", c)]["ttft_ms_p50"]
               for c in p["concurrency"] if ("power_of_two", c) in get and ("cache_aware", c) in get}
    bs = 16
    data = {"workload": {"system_prompts": len(prompts), "system_prompt_tokens": p["prompt_tokens"],
                         "system_prompt_blocks_total": len(prompts) * (p["prompt_tokens"] // bs),
                         "per_prompt": p["per_prompt"], "concurrency": p["concurrency"], "block_size": bs,
                         "max_tokens": p["routing_max_tokens"], "speculation": "off", "model": p["target"],
                         "verifier_replicas": 2},
            "runs": runs, "gpu_maps": maps, "summary": {"ttft_p50_default_over_cache_aware": summary}}
    return save(args, "routing", data, lambda d, path: rb.plot({**d, "env": {"cpus": os.cpu_count(),
                                                                              "where": where(args)}}, path))


def where(args) -> str:
    return f"{args.gpus} fake GPUs on CPU (orchestration check)" if args.cpu_smoke else f"{args.gpus} GPUs"


def save(args, name: str, data: dict, plot) -> dict:
    from cluster.bench.report import write_json

    data = {"part": name, "where": where(args), "cpu_smoke": args.cpu_smoke, "gpus": args.gpus,
            "models": args.models, **data}
    path = write_json(args.out, name, data)
    try:
        plot(data, path.with_suffix(".png"))
    except Exception as e:  # noqa: BLE001 - a plot of a partial run must not lose the JSON
        print(f"plot {name} failed: {type(e).__name__}: {e}", flush=True)
    return data


def finish(a, b, levels: list[int]) -> None:
    """Log x axes ticked at the measured levels; legends where something was drawn (a partial
    run's first write has no ratio yet)."""
    for ax in (a, b):
        ax.set_xscale("log")
        if levels:
            ax.set_xticks(levels, [str(c) for c in levels])
            ax.minorticks_off()
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=8)


def plot_drafter(data: dict, path: Path) -> None:
    from cluster.bench.report import figure

    plt = figure()
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    res = data["results"]
    for name, r in res.items():
        cs = [pt["concurrency"] for pt in r["points"]]
        a.plot(cs, [pt["tokens_per_s"] for pt in r["points"]], "o-", label=f"{name} ({r['gpus']} GPU)")
        if name != "colocated" and "colocated" in res:
            rat = ratios(res, name, "colocated", "tokens_per_s")
            b.plot([int(c) for c in rat], list(rat.values()), "o-", label=f"{name} / colocated")
    a.set(xlabel="concurrent streams", ylabel="tokens/s", title="Throughput (gamma 4, greedy)")
    b.axhline(1.0, color="gray", ls="--")
    b.set(xlabel="concurrent streams", ylabel="fraction of colocated", title="Against colocated")
    finish(a, b, sorted({pt["concurrency"] for r in res.values() for pt in r["points"]}))
    fig.suptitle(f"Drafter placement, {data['where']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def plot_shared(data: dict, path: Path) -> None:
    from cluster.bench.report import figure

    plt = figure()
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for row in data["summary"]:
        lv = row["levels"]
        cs = [x["per_verifier"] for x in lv]
        a.plot(cs, [x["shared_drafter_per_gpu"] for x in lv], "o-", label=f"k={row['k']}: shared drafter ({row['k'] + 1} GPUs)")
        a.plot(cs, [x["colocated_per_gpu"] for x in lv], "s--", label=f"k={row['k']}: colocated ({row['k']} GPUs)")
        b.plot(cs, [x["ratio"] for x in lv], "o-", label=f"k={row['k']}")
    a.set(xlabel="streams per verifier", ylabel="tokens/s per GPU", title="Cluster tokens/s per GPU")
    b.axhline(1.0, color="gray", ls="--")
    b.set(xlabel="streams per verifier", ylabel="shared drafter / colocated (per GPU)",
          title="One drafter GPU for k verifiers")
    finish(a, b, sorted({x["per_verifier"] for row in data["summary"] for x in row["levels"]}))
    fig.suptitle(f"One drafter GPU for k verifiers, {data['where']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


PARTS = {"drafter": part_drafter, "shared": part_shared, "routing": part_routing}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", default="all", help=f"{', '.join(PARTS)}, or all (comma-separated)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--cpu-smoke", action="store_true", help="small pair on CPU, Ray told of --gpus fake GPUs")
    ap.add_argument("--gpus", type=int, help="GPUs for Ray (default: torch's count; --cpu-smoke: 4)")
    ap.add_argument("--modes", help="drafter part: colocated,own,shared (any of them)")
    ap.add_argument("--ks", help="shared part: verifier counts k (each needs k + 1 GPUs)")
    ap.add_argument("--levels", help="streams per verifier, comma-separated")
    ap.add_argument("--budget-s", type=float, help="skip modes that would end past this (a call has 600 s)")
    ap.add_argument("--draft", help="the draft model (default demo-8b-draft; demo-8b-draft-1b drafts its tokens at "
                    "a 1B's step time, issue 39's k verifiers sharing one drafter GPU)")
    args = ap.parse_args(argv)
    p = dict(SMOKE if args.cpu_smoke else GPU)
    if args.draft and not args.cpu_smoke:
        p["draft"] = args.draft
    args.models = {"target": p["target"], "draft": p["draft"]}  # recorded in every part's JSON
    if args.levels:
        p["levels"] = [int(x) for x in args.levels.split(",")]
    if args.budget_s:
        p["budget_s"] = args.budget_s
    args.modes, args.ks = args.modes or p["modes"], args.ks or p["ks"]
    if args.gpus is None:
        import torch

        args.gpus = 4 if args.cpu_smoke else torch.cuda.device_count()
    parts = list(PARTS) if args.part == "all" else args.part.split(",")
    import ray

    from cluster.config import parse_config
    from cluster.kvdir.embedded import free_port
    from cluster.serve.launch import shutdown, start_serve

    t0 = time.perf_counter()
    port = free_port()
    base = base_config(p, port)
    ray.init(address="local", num_cpus=max(16, os.cpu_count() or 1), num_gpus=args.gpus, include_dashboard=False,
             log_to_driver=False, namespace="gpu-multi")
    try:
        start_serve(parse_config({"network": {"grpc_port": port, "http_port": port + 1}}), "HeadOnly")
        for part in parts:
            data = PARTS[part](args, p, base, t0)
            print(f"{part}: summary {data['summary']}", flush=True)
    finally:
        shutdown()
    print(f"done in {time.perf_counter() - t0:.0f} s; wrote under {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
