"""KV directory benchmark against a local server from `cluster.kvdir.embedded`.

  python -m cluster.bench.kvdir_bench --out benchmarks/kvdir

Measures (1) block updates per second: several replicas publishing batches of stored hashes
concurrently, each evicting as much as it stores so its set stays at a steady cache size;
(2) overlap() latency for 512-block prompts with 2 and 8 live replicas, both when every
replica holds the whole prompt (no early exit: the worst case) and when they hold prefixes
of mixed length. All clients share one process and event loop, so update throughput is a
floor: real replicas publish from separate processes.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import time
from pathlib import Path

import numpy as np
import redis.asyncio as aioredis
from tqdm import tqdm

from cluster.kvdir.embedded import server_binary, start_local_server
from cluster.kvdir.redis_backend import RedisDirectory

PROMPT_BLOCKS = 512
CACHE_BLOCKS = 20_000  # per replica: a verifier's prefix-cache size in blocks, roughly


def _rand_hashes(rng: random.Random, n: int) -> list[int]:
    return [rng.getrandbits(64) for _ in range(n)]


async def bench_updates(url: str, replicas: int, batch: int, batches: int, seed: int) -> dict:
    """Aggregate updates/s with `replicas` concurrent publishers, `batches` batches each."""
    rng = random.Random(seed)
    dirs = [RedisDirectory(url, "bench", f"upd{batch}", 60.0) for _ in range(replicas)]
    held = [_rand_hashes(rng, CACHE_BLOCKS) for _ in range(replicas)]
    for i, d in enumerate(dirs):
        await d.publish(f"r{i}", held[i], [], replace=True)
    # Pre-generate so the timed loop measures the directory, not the RNG.
    work = [[_rand_hashes(rng, batch) for _ in range(batches)] for _ in range(replicas)]
    bar = tqdm(total=replicas * batches, desc=f"updates batch={batch}", leave=False)

    async def run(i: int) -> int:
        n = 0
        for new in work[i]:
            old, held[i] = held[i][:batch], held[i][batch:] + new
            assert await dirs[i].publish(f"r{i}", new, old)
            n += len(new) + len(old)
            bar.update()
        return n

    t0 = time.perf_counter()
    total = sum(await asyncio.gather(*(run(i) for i in range(replicas))))
    dt = time.perf_counter() - t0
    bar.close()
    for i, d in enumerate(dirs):
        await d.remove_replica(f"r{i}")
        await d.close()
    return {"replicas": replicas, "batch": batch, "updates": total, "seconds": dt,
            "updates_per_s": total / dt, "batches_per_s": replicas * batches / dt}


async def bench_overlap(url: str, replicas: int, mode: str, queries: int, seed: int) -> dict:
    rng = random.Random(seed)
    model = f"ov{replicas}{mode}"
    pubs = [RedisDirectory(url, "bench", model, 60.0) for _ in range(replicas)]
    router = RedisDirectory(url, "bench", model, 60.0)
    prompt = _rand_hashes(rng, PROMPT_BLOCKS)
    want = {}
    for i, d in enumerate(pubs):
        k = PROMPT_BLOCKS if mode == "full" else (PROMPT_BLOCKS * i) // (replicas - 1)
        await d.publish(f"r{i}", prompt[:k] + _rand_hashes(rng, CACHE_BLOCKS - k), [])
        if k:
            want[f"r{i}"] = k
    assert await router.overlap(prompt) == want, "benchmark setup disagrees with overlap()"
    for _ in range(200):  # warm the connection, the script cache and the allocator
        await router.overlap(prompt)
    admin = aioredis.from_url(url)
    await admin.config_resetstat()
    lat = np.empty(queries)
    for q in tqdm(range(queries), desc=f"overlap {replicas} replicas {mode}", leave=False):
        t0 = time.perf_counter()
        await router.overlap(prompt)
        lat[q] = time.perf_counter() - t0
    # Server CPU per query: unlike wall latency, not inflated by other load on the host.
    server_us = (await admin.info("commandstats"))["cmdstat_evalsha"]["usec_per_call"]
    await admin.aclose()
    for i, d in enumerate(pubs):
        await d.remove_replica(f"r{i}")
        await d.close()
    await router.close()
    ms = lat * 1e3
    return {"replicas": replicas, "mode": mode, "prompt_blocks": PROMPT_BLOCKS,
            "queries": queries, "p50_ms": float(np.percentile(ms, 50)),
            "p99_ms": float(np.percentile(ms, 99)), "mean_ms": float(ms.mean()),
            "max_ms": float(ms.max()), "server_us_per_query": server_us}


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    ups = res["updates"]
    a.bar([str(u["batch"]) for u in ups], [u["updates_per_s"] / 1e3 for u in ups], color="C0")
    a.axhline(res["targets"]["updates_per_s"] / 1e3, color="C3", ls="--", label="target 20k/s")
    a.set(xlabel=f"hashes per publish batch ({ups[0]['replicas']} replicas)",
          ylabel="block updates / s (thousands)", title="Publish throughput")
    a.legend()
    ov = res["overlap"]
    x = np.arange(len(ov))
    b.bar(x - 0.27, [o["server_us_per_query"] / 1e3 for o in ov], 0.27, label="server CPU")
    b.bar(x, [o["p50_ms"] for o in ov], 0.27, label="p50")
    b.bar(x + 0.27, [o["p99_ms"] for o in ov], 0.27, label="p99")
    b.axhline(res["targets"]["overlap_p99_ms"], color="C3", ls="--", label="target p99 2 ms")
    b.set_xticks(x, [f"{o['replicas']} replicas\n{o['mode']}" for o in ov])
    b.set(ylabel="ms", title=f"overlap() latency, {PROMPT_BLOCKS}-block prompt")
    b.legend()
    env = res["env"]
    fig.suptitle(f"KV directory on {Path(env['server']).name}, {env['cpus']} CPUs shared with "
                 f"other work (load avg {env['loadavg_1m_after']:.1f})")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


async def run_all(url: str, args) -> dict:
    updates = [await bench_updates(url, args.replicas, b, args.batches, seed=b)
               for b in (16, 64, 256, 1024)]
    overlap = [await bench_overlap(url, r, m, args.queries, seed=r)
               for r in (2, 8) for m in ("mixed", "full")]
    return {"updates": updates, "overlap": overlap}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/kvdir"))
    ap.add_argument("--replicas", type=int, default=4, help="publishers in the update test")
    ap.add_argument("--batches", type=int, default=300, help="batches per publisher")
    ap.add_argument("--queries", type=int, default=3000, help="overlap queries per setting")
    args = ap.parse_args()
    url, stop = start_local_server()
    try:
        res = asyncio.run(run_all(url, args))
    finally:
        stop()
    import redis

    res["targets"] = {"updates_per_s": 20_000, "overlap_p99_ms": 2.0}
    res["env"] = {"server": server_binary(), "cpus": os.cpu_count(), "python":
                  platform.python_version(), "redis_py": redis.__version__,
                  "machine": platform.machine(), "cache_blocks_per_replica": CACHE_BLOCKS,
                  "loadavg_1m_after": os.getloadavg()[0]}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kvdir.json").write_text(json.dumps(res, indent=2) + "\n")
    plot(res, args.out / "kvdir.png")
    for u in res["updates"]:
        print(f"updates  batch={u['batch']:5d}  {u['updates_per_s']:10.0f} /s")
    for o in res["overlap"]:
        print(f"overlap  {o['replicas']} replicas {o['mode']:5s}  p50 {o['p50_ms']:.3f} ms"
              f"  p99 {o['p99_ms']:.3f} ms  server {o['server_us_per_query']:.0f} us")


if __name__ == "__main__":
    main()
