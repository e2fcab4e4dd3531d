"""Issue 38's served run: `spec-cluster up` with configs/hopper-70b.yaml at TP N on one host,
through the real endpoints: one gRPC and one OpenAI request answered, then tokens/s over gRPC
at 1 and 32 streams (128 tokens each, the config's goodput controller).

    TP=4 BUNDLE=.device-bundle-serve bash scripts/gpu_py.sh gpu_tp_served.py   # nvidia-h100-x4
    TP=4 PLACEMENT=disaggregated LEVELS=1,16 BUNDLE=.device-bundle-serve \
        bash scripts/gpu_py.sh gpu_tp_served.py                               # an 8-GPU kind (issue 41)
    python3 scripts/gpu_tp_served.py --cpu-smoke --out /tmp/tps                 # here: orchestration only

On the GPU the target is demo-70b-target (the demo target in Llama-3.1-70B dimensions) over TP
ranks and demo-8b-draft drafts on rank 0's GPU (at TP 4 on a 4-GPU host no GPU is left for a
drafter of its own); `PLACEMENT=disaggregated` puts it in a drafter replica on a GPU of its own
(TP 4 + 1 GPU: issue 41's 8-GPU host). No Redis (kvdir off), no accelerator_type. `--cpu-smoke`: the demo pair,
float32, TP 2 over gloo, 1 and 2 streams of 8 tokens: it checks the script, not a speed.
Writes gpu_tp_served.json (or gpu_tp_served_cpu_smoke.json) under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.request
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


def config(a) -> dict:
    cfg = load_config(REPO / "configs/hopper-70b.yaml").model_dump(mode="json")
    gpu = not a.cpu_smoke
    cfg["models"].update(target="demo-70b-target" if gpu else "demo-target", draft="demo-8b-draft" if gpu else "demo-draft",
                         device="cuda" if gpu else "cpu", dtype="bfloat16" if gpu else "float32",
                         attention="auto" if gpu else "sdpa")
    cfg["engine"].update(tensor_parallel_size=a.tp, kv_cache_gb={2: 4, 4: 16}.get(a.tp, 32) if gpu else 0.25,
                         max_num_seqs=64 if gpu else 8, max_model_len=4096 if gpu else 512, max_waiting=256)
    cfg["placement"] = a.placement
    cfg["verifier"]["ray_actor_options"] = {"num_gpus": 1, "num_cpus": 4} if gpu else {"num_cpus": 1}
    # disaggregated: the draft model in a drafter replica on a GPU of its own (issue 41's served
    # part: TP 4 on GPUs 0-3 and the drafter on a fifth)
    own_gpu = gpu and a.placement == "disaggregated"
    cfg["drafter"]["ray_actor_options"] = {"num_gpus": 1, "num_cpus": 2} if own_gpu else {"num_cpus": 1}
    cfg["kvdir"]["url"] = None
    cfg["router"]["failover_wait_s"] = 30.0
    return cfg


def openai_request(base: str, prompt: str, max_tokens: int) -> int:
    """One completion through the OpenAI API: with the official client where installed."""
    try:
        import openai
    except ImportError:  # the GPU image's bundles may lack it: the same request over plain HTTP
        body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}).encode()
        req = urllib.request.Request(f"{base}/completions", body, {"content-type": "application/json"})
        return json.loads(urllib.request.urlopen(req, timeout=600).read())["usage"]["completion_tokens"]
    client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=600)
    model = client.models.list().data[0].id
    return client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0).usage.completion_tokens


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--tp", type=int, default=int(os.environ.get("TP", "4")))
    p.add_argument("--levels", default=os.environ.get("LEVELS", "1,32"))
    p.add_argument("--new", type=int, default=int(os.environ.get("NEW_TOKENS", "128")))
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--placement", choices=("colocated", "disaggregated"), default=os.environ.get("PLACEMENT", "colocated"),
                   help="colocated: the draft model on rank 0's GPU; disaggregated: a drafter replica of its own")
    p.add_argument("--cpu-smoke", action="store_true")
    a = p.parse_args()
    if a.cpu_smoke:
        a.tp, a.levels, a.new = 2, "1,2", 8
    levels = [int(x) for x in a.levels.split(",")]
    name = "gpu_tp_served" + ("_drafter_replica" if a.placement == "disaggregated" else "") + ("_cpu_smoke" if a.cpu_smoke else "")
    R: dict = {"label": ("CPU smoke (orchestration, NOT a speed): " if a.cpu_smoke else "") + f"served TP {a.tp}",
               "placement": a.placement,
               "command": " ".join(["python3", "scripts/gpu_tp_served.py", *sys.argv[1:]]), "config": config(a)}
    out = Path(a.out, name + ".json")

    def write() -> None:
        out.write_text(json.dumps(R, indent=1) + "\n")

    prompts = code_prompts(max(levels) * 2, chars=1200, seed=9)
    with served(R["config"], echo=lambda line: print(line, flush=True), timeout_s=1800) as up:
        R["ready_s"] = round(up.ready_s, 1)
        log("ready in", R["ready_s"], "s")
        from cluster.client import Client

        with Client(up.grpc, timeout=600) as c:
            r = c.generate("def fibonacci(n):", max_tokens=32)
        R["grpc_request"] = {"tokens": len(r.token_ids), "finish_reason": r.finish_reason}
        R["openai_request"] = {"tokens": openai_request(up.http, "import os", 16)}
        log("gRPC:", R["grpc_request"], "OpenAI:", R["openai_request"])
        write()
        for c in levels:
            run_grpc(up.grpc, None, prompts[:c], c, a.new, "auto")  # warm-up at this level
            done, wall = run_grpc(up.grpc, None, prompts[:2 * c], c, a.new, "auto")
            tokens = sum(len(d.get("token_ids", [])) for d in done)
            R.setdefault("streams", []).append({"concurrency": c, "requests": len(done), "tokens": tokens,
                                                "wall_s": round(wall, 2), "tokens_per_s": round(tokens / wall, 1)})
            log("streams", R["streams"][-1])
            write()
    log("wrote", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
