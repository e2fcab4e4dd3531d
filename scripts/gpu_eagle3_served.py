"""EAGLE-3 served, colocated against disaggregated (issue 40): `spec-cluster up` with the 8B-shape
demo target and its EAGLE-3 head (demo-8b-eagle3), once with the head in the verifier's process
and once in a drafter replica of its own, through the real gRPC endpoint: batch-1 tokens/s at
fixed gamma and plain, 128 new tokens a request; where a
greedy request's tokens at gamma part from plain's, the target's margin there (an in-process
eager pass once the served instances are down).

    BUNDLE=.device-bundle-multi bash scripts/gpu_py.sh gpu_eagle3_served.py      # one GPU: both replicas on it
    GPUS=2 BUNDLE=.device-bundle-multi bash scripts/gpu_py.sh gpu_eagle3_served.py   # nvidia-h100-x2: a GPU each
    python3 scripts/gpu_eagle3_served.py --cpu-smoke --out /tmp/e3s              # here: orchestration only

On one GPU the verifier and the drafter replica each ask Ray for half of it; on two, a whole one
each. No Redis (kvdir off). `--cpu-smoke`: the demo target and head, float32, 2 requests of 8
tokens: it checks the script, not a speed. Writes gpu_eagle3_served.json under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
# `spec-cluster up` and its Ray workers import the package too
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)

from cluster.bench.harness import log  # noqa: E402
from cluster.bench.load import run_grpc  # noqa: E402
from cluster.bench.served import served  # noqa: E402
from cluster.bench.workloads import code_prompts  # noqa: E402
from cluster.config import load_config  # noqa: E402


def config(a, placement: str) -> dict:
    cfg = load_config(REPO / "configs/hopper.yaml").model_dump(mode="json")
    gpu = not a.cpu_smoke
    cfg["models"].update(target="demo-8b-target" if gpu else "demo-target", draft=None,
                         eagle3="demo-8b-eagle3" if gpu else None, drafter="eagle3",
                         device="cuda" if gpu else "cpu", dtype="bfloat16" if gpu else "float32",
                         attention="auto" if gpu else "sdpa")
    cfg["engine"].update(max_num_seqs=16 if gpu else 4, max_model_len=4096 if gpu else 512, max_waiting=64,
                         kv_cache_gb=8 if gpu else 0.25, gpu_memory_utilization=0.4,
                         compile=gpu, compile_cache_dir=os.environ.get("COMPILE_CACHE", "/tmp/spec-cluster-compile"))
    cfg["placement"] = placement
    share = 1 if a.gpus > 1 else 0.5
    for role in ("verifier", "drafter"):
        cfg[role].update(num_replicas=1, autoscaling=False)
        cfg[role]["ray_actor_options"] = {"num_gpus": share, "num_cpus": 2} if gpu else {"num_cpus": 1}
    cfg["kvdir"]["url"] = None
    return cfg


def margins(R: dict, prompts: list[str], a) -> None:
    """Where a placement's greedy tokens at gamma part from its plain ones: the target's margin
    there, from an eager pass of an engine built in this process from the same config once the
    served ones are down (cluster.bench.harness.agreement: a near-tie flips by rounding, a wide
    gap would be a wrong token)."""
    g = f"gamma{a.gamma}"
    differ = {k: [j for j, (x, y) in enumerate(zip(v[g]["token_ids"], v["plain"]["token_ids"])) if x != y]
              for k, v in R["placements"].items()}
    if not any(differ.values()):
        return
    from cluster.bench.harness import agreement
    from cluster.config import parse_config
    from cluster.serve.build import build_engine

    cfg = parse_config({**R["placements"]["colocated"]["config"], "placement": "colocated"})
    engine = build_engine(cfg)
    try:
        for k, rows in differ.items():
            v = R["placements"][k]
            v["agreement"] = {j: agreement(engine, engine.tokenizer.encode(prompts[j]), v[g]["token_ids"][j],
                                           v["plain"]["token_ids"][j]) for j in rows}
            log(k, "where gamma's tokens part from plain's:", v["agreement"])
    finally:
        engine.close()


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--gamma", type=int, default=int(os.environ.get("GAMMA", "4")))
    p.add_argument("--gpus", type=int, default=int(os.environ.get("GPUS", "1")))
    p.add_argument("--new", type=int, default=int(os.environ.get("NEW_TOKENS", "128")))
    p.add_argument("--requests", type=int, default=int(os.environ.get("REQUESTS", "6")))
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--cpu-smoke", action="store_true")
    a = p.parse_args()
    if a.cpu_smoke:
        a.new, a.requests = 8, 2
    name = "gpu_eagle3_served" + ("_cpu_smoke" if a.cpu_smoke else "")
    R: dict = {"label": ("CPU smoke (orchestration, NOT a speed): " if a.cpu_smoke else "") +
               f"EAGLE-3 served, batch 1, {a.gpus} GPU(s)", "gamma": a.gamma,
               "command": " ".join(["python3", "scripts/gpu_eagle3_served.py", *sys.argv[1:]])}
    out = Path(a.out, name + ".json")
    out.parent.mkdir(parents=True, exist_ok=True)
    prompts = code_prompts(a.requests + 1, chars=1200, seed=9)
    for placement in ("colocated", "disaggregated"):
        cfg = config(a, placement)
        P = R.setdefault("placements", {})[placement] = {"config": cfg}
        with served(cfg, echo=lambda line: print(line, flush=True), timeout_s=1200) as up:
            P["ready_s"] = round(up.ready_s, 1)
            log(placement, "ready in", P["ready_s"], "s")
            run_grpc(up.grpc, None, prompts[:1], 1, a.new, a.gamma)  # warm-up
            for spec in ("off", a.gamma):
                done, wall = run_grpc(up.grpc, None, prompts[1:], 1, a.new, spec)
                tokens = sum(len(d.get("token_ids", [])) for d in done)
                drafted = sum(d["spec"]["drafted"] for d in done)
                accepted = sum(d["spec"]["accepted"] for d in done)
                P["plain" if spec == "off" else f"gamma{spec}"] = {
                    "requests": len(done), "tokens": tokens, "wall_s": round(wall, 2),
                    "tokens_per_s": round(tokens / wall, 1), "acceptance_rate": accepted / drafted if drafted else 0.0,
                    "token_ids": [d.get("token_ids", []) for d in done]}
                log(placement, spec, {k: v for k, v in P["plain" if spec == "off" else f"gamma{spec}"].items()
                                      if k != "token_ids"})
        out.write_text(json.dumps(R, indent=1) + "\n")
    margins(R, prompts[1:], a)
    c, d = R["placements"]["colocated"], R["placements"]["disaggregated"]
    g = f"gamma{a.gamma}"
    R["disaggregated_over_colocated"] = d[g]["tokens_per_s"] / c[g]["tokens_per_s"]
    R["speedup"] = {k: v[g]["tokens_per_s"] / v["plain"]["tokens_per_s"] for k, v in R["placements"].items()}
    R["same_tokens"] = {k: v[g]["token_ids"] == v["plain"]["token_ids"] for k, v in R["placements"].items()}
    log("disaggregated / colocated:", round(R["disaggregated_over_colocated"], 3), "speedup:", R["speedup"],
        "same tokens as plain:", R["same_tokens"])
    out.write_text(json.dumps(R, indent=1) + "\n")
    log("wrote", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
