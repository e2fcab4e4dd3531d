"""The policy load ramp through a local Ray Serve cluster and its gRPC proxy.

    python -m cluster.bench.policy_bench --ray --out benchmarks/policy --levels 1,4,16

One app per policy (Router -> Verifier -> Drafter, disaggregated, one CPU replica each),
deployed in turn on one local Ray. At concurrency c, c client threads each send `--rounds`
greedy requests back to back (unary Generate, speculation "auto"); tokens/s is tokens
received over wall time. Mean gamma and acceptance come from the verifier's own counters
(drafted / verify steps, accepted / drafted) read before and after each level. Every
output must equal what the in-process engine produces with speculation off.

The apps run one after another, not interleaved, so load from elsewhere on the machine
lands on whichever runs at the time: these numbers show the path works end to end and
the controller behaves the same behind Serve; the engine-level ramp is the comparison.
"""

from __future__ import annotations

import socket
import threading
import time

from tqdm.auto import tqdm

from cluster.bench.report import figure, write_json


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _verifier_counts(app: str) -> dict:
    from ray import serve

    s = serve.get_deployment_handle("Verifier", app).stats.remote().result()
    return {k: s.get(k, 0) for k in ("drafted", "accepted", "verify_steps", "gamma")}


def _level(client, reqs, c: int, rounds: int, ref: dict, mismatches: list, policy: str) -> tuple[int, float]:
    """c threads x `rounds` requests each; returns (tokens, seconds)."""
    tokens, lock = [0], threading.Lock()

    def worker(t: int):
        for r in range(rounds):
            i = (r * c + t) % len(reqs)
            prompt, m = reqs[i]
            out = client.generate(prompt, max_tokens=m, speculation="auto")
            ids = list(out.token_ids)
            with lock:
                tokens[0] += len(ids)
                if ids != ref[i]:
                    mismatches.append(f"{policy} c={c} request {i}")

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(c)]
    t0 = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return tokens[0], time.perf_counter() - t0


def main(args) -> int:
    import ray
    from ray import serve

    from cluster.bench.policies import POLICIES, policy_config, requests
    from cluster.client import Client
    from cluster.config import parse_config
    from cluster.engine.sampling import SamplingParams
    from cluster.engine.scheduling.sequence import SpecParams
    from cluster.serve.build import build_engine
    from cluster.serve.launch import run_app, start_serve

    levels = [int(x) for x in args.levels.split(",")]
    policies = args.policies.split(",")
    reqs = requests(max(levels) * args.rounds, args.min_tokens, args.max_tokens)
    engine_cfg = {"max_num_seqs": max(levels), "max_waiting": max(levels), "max_model_len": 1024}
    # the reference run takes every request at once: its queue holds them all
    local = build_engine(parse_config({"engine": {**engine_cfg, "max_waiting": len(reqs)}}))
    ref = {i: r["token_ids"] for i, r in enumerate(local.generate(
        [p for p, _ in reqs], [SamplingParams(max_tokens=m) for _, m in reqs], SpecParams("off")))}
    del local

    port = _free_port()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, namespace="policy-bench")
    results, mismatches = [], []
    try:
        start_serve(parse_config({"network": {"grpc_port": port, "http_port": _free_port()}}), "HeadOnly")
        bar = tqdm(total=len(policies) * len(levels), desc="policy ramp (Ray)")
        for p in policies:
            app = f"policy-{p}"
            run_app(parse_config({
                "speculation": policy_config(p), "engine": engine_cfg, "kvdir": {"url": None},
                "network": {"grpc_port": port, "app_name": app, "route_prefix": f"/{app}"},
                "verifier": {"ray_actor_options": {"num_cpus": 1}},
                "drafter": {"ray_actor_options": {"num_cpus": 1}}}))
            with Client(f"localhost:{port}", application=app, timeout=300) as client:
                client.generate("def warm_up():", max_tokens=16)
                for c in levels:
                    before = _verifier_counts(app)
                    tokens, secs = _level(client, reqs, c, args.rounds, ref, mismatches, p)
                    after = _verifier_counts(app)
                    d = {k: after[k] - before[k] for k in ("drafted", "accepted", "verify_steps")}
                    results.append({"policy": p, "concurrency": c, "tokens": tokens, "seconds": secs,
                                    "tokens_per_s": tokens / secs,
                                    "mean_gamma": d["drafted"] / d["verify_steps"] if d["verify_steps"] else 0.0,
                                    "acceptance_rate": d["accepted"] / d["drafted"] if d["drafted"] else 0.0,
                                    "gamma_at_end": after["gamma"]})
                    bar.set_postfix_str(f"{p} c={c}: {tokens / secs:.0f} tok/s")
                    bar.update()
            serve.delete(app)
        bar.close()
    finally:
        serve.shutdown()
        ray.shutdown()

    for r in results:
        tqdm.write(f"{r['policy']:8s} c={r['concurrency']:2d}: {r['tokens_per_s']:6.1f} tok/s, "
                   f"gamma {r['mean_gamma']:.2f}, acceptance {r['acceptance_rate']:.2f}")
    path = write_json(args.out, "policy_ray", {
        "kind": "ray-grpc", "levels": levels, "policies": {p: POLICIES.get(p, "inline") for p in policies},
        "rounds": args.rounds, "results": results, "identical_to_off": not mismatches,
        "mismatches": mismatches[:20], "checked_outputs": sum(r["concurrency"] * args.rounds for r in results)})
    plt = figure()
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for p in policies:
        rs = [r for r in results if r["policy"] == p]
        ax.plot([r["concurrency"] for r in rs], [r["tokens_per_s"] for r in rs], "o-", label=p)
        if p != "off":
            ax2.plot([r["concurrency"] for r in rs], [r["mean_gamma"] for r in rs], "o-", label=p)
    for a, ylabel in ((ax, "tokens/s (client, greedy)"), (ax2, "mean gamma")):
        a.set(xscale="log", xlabel="concurrent gRPC streams", ylabel=ylabel)
        a.set_xticks(levels, [str(x) for x in levels])
        a.grid(alpha=0.3)
        a.legend()
    ax.set_title("Through Ray Serve + gRPC (local, CPU), demo pair")
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=120)
    print(f"wrote {path} and {path.with_suffix('.png')}")
    if mismatches:
        print("greedy outputs differ from speculation off: " + "; ".join(mismatches[:10]))
        return 1
    return 0
