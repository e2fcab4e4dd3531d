"""Cache-aware routing vs Serve's default routing, on a shared-prefix workload.

  python -m cluster.bench.routing_bench --out benchmarks/routing

Two verifier replicas behind the gRPC proxy, a local Redis-protocol KV directory, the demo
target (speculation off: this measures prefill reuse). The workload is S system prompts
(distinct Python sources, ~P tokens) times many short user suffixes, sent in one seeded
order. For each KV pool size (engine.kv_cache_gb) and routing mode the app is deployed
fresh and warmed with one request per system prompt; then each concurrency is one measured
phase (the cache stays warm between phases): client-side TTFT (first streamed chunk), the
engine's own TTFT, and the prefix-cache block hit rate of the phase.

The KV cache is paged: live sequences and cached prompt blocks share one pool per replica,
and freed prompt blocks stay cached until the pool needs them (LRU). The interesting regime
is a pool whose room beyond the live sequences is smaller than all system prompts together
but large enough for half of them: default routing makes every replica cache every prompt
and thrash, cache-aware routing partitions them. With a pool that holds everything both
modes hit, and the comparison shows what routing on prefixes costs. Each run records the
pool's size in blocks as the replicas report it (kv_blocks_total).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import sys
import sysconfig
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from tqdm import tqdm

from cluster.client import Client
from cluster.config import ClusterConfig, parse_config, resolve_model_path


def system_prompts(tokenizer, n: int, tokens: int) -> list[str]:
    """The first `tokens` tokens of n stdlib modules, each tagged so no two share a block."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in stdlib.glob("*.py") if p.stat().st_size > 20_000)
    out = []
    for path in random.Random(0).sample(files, n):
        ids = tokenizer.encode(f"# context: {path.name}\n" + path.read_text(errors="replace")[:tokens * 8])[:tokens]
        out.append(tokenizer.decode(ids))
    return out


def workload(n_prompts: int, per_prompt: int, seed: int) -> list[tuple[int, str]]:
    rng = random.Random(seed)
    words = ["fix", "the", "bug", "add", "a", "test", "explain", "this", "function", "refactor", "rename"]
    reqs = [(i, f"\n# request {j}: " + " ".join(rng.choice(words) for _ in range(8)) + "\n")
            for i in range(n_prompts) for j in range(per_prompt)]
    rng.shuffle(reqs)
    return reqs


def board(app: str) -> dict:
    from ray import serve

    return serve.get_deployment_handle("StatsBoard", app).snapshot.remote().result()["replicas"]


def prefix_counts(app: str, expect: int) -> dict[str, tuple[int, int]]:
    """replica -> (block queries, block hits), once all replicas reported (every 1 s)."""
    time.sleep(1.5)
    deadline = time.monotonic() + 15
    while len(reps := board(app)) < expect and time.monotonic() < deadline:
        time.sleep(0.5)
    return {r: (s.get("prefix_queries", 0), s.get("prefix_hits", 0)) for r, s in reps.items()}


def pool_blocks(app: str) -> int:
    """KV blocks per replica (all replicas are configured alike; the first reported)."""
    return next((s.get("kv_blocks_total", 0) for s in board(app).values()), 0)


def measure(client: Client, app: str, replicas: int, prompts: list[str], reqs, concurrency: int,
            max_tokens: int, desc: str) -> dict:
    """One phase at a fixed concurrency: client TTFT and the phase's block hit rate."""
    before = prefix_counts(app, replicas)
    ttft, server_ttft, rows = [], [], []  # rows: per request, what its TTFT is made of
    lock = threading.Lock()
    bar = tqdm(total=len(reqs), desc=desc, leave=False)

    def one(req):
        i, suffix = req
        t0 = time.perf_counter()
        first = None
        for chunk in client.generate_stream(prompts[i] + suffix, max_tokens=max_tokens, speculation="off"):
            if first is None and chunk.token_ids:
                first = time.perf_counter() - t0
            if chunk.final:
                with lock:
                    ttft.append(1e3 * first)
                    server_ttft.append(chunk.timing.ttft_ms)
                    rows.append({"ttft_ms": round(1e3 * first, 2), "server_ttft_ms": round(chunk.timing.ttft_ms, 2),
                                 "replica": chunk.replica, "prompt_tokens": chunk.prompt_tokens,
                                 "cached_tokens": chunk.cached_tokens})
        bar.update()

    t0 = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, reqs))
    wall = time.perf_counter() - t0
    bar.close()
    after = prefix_counts(app, replicas)
    per_replica = {}
    for r, (q, h) in after.items():
        q0, h0 = before.get(r, (0, 0))
        per_replica[r] = {"block_queries": q - q0, "block_hits": h - h0}
    q = sum(v["block_queries"] for v in per_replica.values())
    h = sum(v["block_hits"] for v in per_replica.values())
    t = np.array(ttft)
    return {"concurrency": concurrency, "requests": len(ttft),
            "ttft_ms_p50": float(np.percentile(t, 50)), "ttft_ms_p99": float(np.percentile(t, 99)),
            "ttft_ms_mean": float(t.mean()), "server_ttft_ms_p50": float(np.percentile(server_ttft, 50)),
            "server_ttft_ms_p99": float(np.percentile(server_ttft, 99)),
            "hit_rate": h / q if q else 0.0, "requests_per_s": len(ttft) / wall, "per_replica": per_replica,
            **breakdown(rows), "requests_detail": rows}


def breakdown(rows: list[dict]) -> dict:
    """TTFT p50 of the requests whose prompt the cache mostly served (hits) and of the rest, and
    the path outside the engine (client TTFT less the engine's): what routing can and cannot change."""
    hit = [r for r in rows if 2 * r["cached_tokens"] >= r["prompt_tokens"]]
    miss = [r for r in rows if 2 * r["cached_tokens"] < r["prompt_tokens"]]
    p50 = lambda xs: float(np.percentile(xs, 50)) if xs else None  # noqa: E731
    return {"hits": len(hit), "misses": len(miss), "ttft_ms_p50_hits": p50([r["ttft_ms"] for r in hit]),
            "ttft_ms_p50_misses": p50([r["ttft_ms"] for r in miss]),
            "path_ms_p50": p50([r["ttft_ms"] - r["server_ttft_ms"] for r in rows])}


def run_mode(base: dict, mode: str, kv_cache_gb: float, prompts: list[str], reqs, args,
             on_ready=None) -> list[dict]:
    """Deploy fresh, warm up once per system prompt, then one phase per concurrency;
    `on_ready(app)` runs once warm, before the phases (scripts/gpu_multi.py checks GPUs there)."""
    from ray import serve

    from cluster.serve.launch import run_app

    app = f"routing-{mode}-{kv_cache_gb:g}".replace(".", "_")
    cfg: ClusterConfig = parse_config(base, {
        "engine": {"kv_cache_gb": kv_cache_gb},
        "kvdir": {"routing": mode},
        "network": {"app_name": app, "route_prefix": f"/{app}"}})
    run_app(cfg)
    client = Client(f"localhost:{cfg.network.grpc_port}", application=app, timeout=120)
    out = []
    try:
        for p in prompts:
            client.generate(p + "\n# warm up\n", max_tokens=1, speculation="off")
        prefix_counts(app, cfg.verifier.num_replicas)  # every replica has reported
        blocks = pool_blocks(app)
        if on_ready is not None:
            on_ready(app)
        for c in args.concurrency:
            r = measure(client, app, cfg.verifier.num_replicas, prompts, reqs, c, args.max_tokens,
                        f"{mode} kv={kv_cache_gb:g} GiB c={c}")
            out.append({"mode": mode, "kv_cache_gb": kv_cache_gb, "kv_blocks_total": blocks, **r})
            tqdm.write(f"{mode:13s} kv={kv_cache_gb:g} GiB ({blocks} blocks) c={c}  TTFT p50 "
                       f"{r['ttft_ms_p50']:6.1f} ms  p99 "
                  f"{r['ttft_ms_p99']:6.1f} ms  mean {r['ttft_ms_mean']:6.1f} ms  server p50 "
                  f"{r['server_ttft_ms_p50']:5.1f} ms  hit rate {100 * r['hit_rate']:5.1f}%  "
                  f"hits/misses {r['hits']}/{r['misses']}  path p50 {r['path_ms_p50']:5.1f} ms")
    finally:
        client.close()
        serve.delete(app)
    return out


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = res["runs"]
    groups = sorted({(r["kv_cache_gb"], r["concurrency"]) for r in runs})
    modes = [m for m in ("power_of_two", "cache_aware") if any(r["mode"] == m for r in runs)]
    label = {"power_of_two": "Serve default (power of two)", "cache_aware": "cache-aware (PrefixLoadRouter)"}
    get = {(r["mode"], r["kv_cache_gb"], r["concurrency"]): r for r in runs}
    blocks = {r["kv_cache_gb"]: r["kv_blocks_total"] for r in runs}
    x = np.arange(len(groups))
    w = 0.8 / len(modes)
    fig, (a, b) = plt.subplots(1, 2, figsize=(13, 4.8))
    for k, m in enumerate(modes):
        off = (k - (len(modes) - 1) / 2) * w
        rs = [get.get((m, *g)) for g in groups]
        a.bar(x + off, [r["ttft_ms_p50"] if r else 0 for r in rs], w, color=f"C{k}", label=f"{label[m]} p50")
        a.scatter(x + off, [r["ttft_ms_p99"] if r else np.nan for r in rs], color=f"C{k}", marker="v",
                  edgecolor="k", zorder=3, label=f"{label[m]} p99")
        b.bar(x + off, [100 * r["hit_rate"] if r else 0 for r in rs], w, color=f"C{k}", label=label[m])
    wl = res["workload"]
    ticks = [f"KV pool {blocks[s]} blocks\nconcurrency {c}" for s, c in groups]
    a.set_xticks(x, ticks)
    a.set(ylabel="TTFT, client side (ms)", title="Time to first token (bars p50, triangles p99)")
    a.legend(fontsize=8)
    b.set_xticks(x, ticks)
    b.set(ylabel="prefix-cache block hit rate (%)", ylim=(0, 100), title="Prefix-cache hits (measured phase)")
    b.legend(fontsize=8, loc="lower right")
    fig.suptitle(f"{wl['system_prompts']} system prompts ({wl['system_prompt_blocks_total']} blocks) x "
                 f"{wl['per_prompt']} suffixes, 2 verifier replicas, {Path(wl['model']).name} on "
                 f"{res['env'].get('where') or str(res['env']['cpus']) + ' shared CPUs'}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/routing"))
    ap.add_argument("--model", default="demo-target")
    ap.add_argument("--system-prompts", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=384)
    ap.add_argument("--per-prompt", type=int, default=16, help="measured requests per system prompt")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[2, 6])
    ap.add_argument("--max-tokens", type=int, default=8)
    # demo target, float32: 2 x 6 layers x 4 KV heads x 32 dims x 4 bytes = 6 KiB a token, 96 KiB
    # a 16-token block: 0.02 GiB = 218 blocks (a few concurrent sequences plus about half the
    # default 8 x 24 prompt blocks), 0.06 GiB = 655 blocks (all of them)
    ap.add_argument("--kv-cache-gb", type=float, nargs="+", default=[0.02, 0.06],
                    help="engine.kv_cache_gb per replica (the whole paged pool), one run per size and mode")
    ap.add_argument("--modes", nargs="+", default=["power_of_two", "cache_aware"])
    ap.add_argument("--max-imbalance", type=float, default=None, help="kvdir.max_imbalance (config default)")
    ap.add_argument("--num-cpus", type=int, default=4)
    args = ap.parse_args()

    import ray
    from cluster.engine.worker.loader import load_tokenizer

    from cluster.kvdir.embedded import free_port, start_local_server
    from cluster.serve.launch import shutdown, start_serve

    tok = load_tokenizer(resolve_model_path(args.model))
    prompts = system_prompts(tok, args.system_prompts, args.prompt_tokens)
    reqs = workload(len(prompts), args.per_prompt, seed=1)
    url, stop = start_local_server()
    base = {"name": "routing-bench", "models": {"target": args.model, "draft": None, "drafter": "none"},
            "engine": {"max_num_seqs": 16, "max_model_len": 1024},
            "verifier": {"num_replicas": 2, "ray_actor_options": {"num_cpus": 1}},
            "kvdir": {"url": url} | ({"max_imbalance": args.max_imbalance} if args.max_imbalance else {}),
            "network": {"grpc_port": free_port(), "http_port": free_port()}}
    runs = []
    try:
        ray.init(num_cpus=args.num_cpus, namespace="routing-bench", log_to_driver=False)
        start_serve(parse_config(base))
        for size in args.kv_cache_gb:
            for mode in args.modes:
                runs += run_mode(base, mode, size, prompts, reqs, args)
    finally:
        shutdown()
        stop()
    import ray as _ray

    bs = parse_config(base).engine.block_size
    res = {
        "workload": {"system_prompts": len(prompts), "system_prompt_tokens": args.prompt_tokens,
                     "system_prompt_blocks_total": len(prompts) * (args.prompt_tokens // bs),
                     "per_prompt": args.per_prompt, "concurrency": args.concurrency,
                     "max_tokens": args.max_tokens, "block_size": bs, "speculation": "off",
                     "model": args.model, "verifier_replicas": 2,
                     "max_imbalance": parse_config(base).kvdir.max_imbalance},
        "runs": runs,
        "env": {"cpus": os.cpu_count(), "python": platform.python_version(), "ray": _ray.__version__,
                "machine": platform.machine(), "loadavg_1m_after": os.getloadavg()[0],
                "argv": sys.argv[1:]},
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "routing.json").write_text(json.dumps(res, indent=2) + "\n")
    plot(res, args.out / "routing.png")


if __name__ == "__main__":
    main()
