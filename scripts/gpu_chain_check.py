"""The model drafter's chain graph (cluster/engine/worker/graphs.py, _Chain) on a GPU, quickly:
the small demo pair with CUDA graphs and no compile, greedy speculation at gamma 4 against
plain decoding on the same engine (the tokens must be equal), and how many chain graphs were
captured at warm-up and replayed. One GPU, about 20 s after CUDA starts.

    PYTHONPATH=/tmp/site:$PWD python3 scripts/gpu_chain_check.py      # writes $OUT/gpu_chain_check.json
    python3 scripts/gpu_chain_check.py --cpu                          # here: the CPU stand-in for graphs
"""

from __future__ import annotations

import json
import os
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cluster.config import parse_config  # noqa: E402
from cluster.engine.sampling import SamplingParams  # noqa: E402
from cluster.engine.scheduling.sequence import SpecParams  # noqa: E402
from cluster.engine.worker.capture import eager_on_cpu  # noqa: E402
from cluster.serve.build import build_engine  # noqa: E402


def main() -> int:
    cpu = "--cpu" in sys.argv or not torch.cuda.is_available()
    t0 = time.perf_counter()
    cfg = parse_config({"models": {"target": "demo-target", "draft": "demo-draft", "device": "cpu" if cpu else "cuda",
                                   "dtype": "float32" if cpu else "bfloat16"},
                        "engine": {"max_num_seqs": 4, "max_model_len": 512, "kv_cache_gb": 0.25, "compile": False},
                        "placement": "colocated"})
    with eager_on_cpu() if cpu else nullcontext():
        e = build_engine(cfg)
    up = time.perf_counter() - t0
    graphs = e.drafters["model"].runner.graphs
    chains = lambda: {k: g.graph.replays for k, g in graphs.graphs.items() if k[1] < 0} if cpu else \
        {k: 0 for k in graphs.graphs if k[1] < 0}  # noqa: E731 (a CUDA graph keeps no count)
    prompts = ["def fibonacci(n):", "import os\nimport sys\n", "class Stack:\n    def push(self, x):"]
    greedy = SamplingParams(max_tokens=64, ignore_eos=True)
    plain = e.generate(prompts, greedy, SpecParams("off"))
    spec = e.generate(prompts, greedy, SpecParams("fixed", 4), "model")
    R = {"device": "cpu (stand-in)" if cpu else torch.cuda.get_device_name(), "engine_up_s": round(up, 1),
         "chain_graphs": len(chains()), "chain_buckets": sorted({k[0] for k in chains()}),
         "same_tokens_as_plain": [a["token_ids"] for a in spec] == [b["token_ids"] for b in plain],
         "drafted": sum(r["spec"]["drafted"] for r in spec), "accepted": sum(r["spec"]["accepted"] for r in spec)}
    if cpu:
        R["chain_replays"] = sum(chains().values())
    # speculative steps launched ahead (cluster.engine.spec.ahead) against the same steps waiting
    # for the host: tokens equal, and tokens/s at 1 and 3 streams (gamma 4)
    ahead = e.spec_ahead
    R["spec_ahead"] = {"hits": ahead.hits, "fresh": ahead.fresh} if ahead else None
    for n in (1, 3):
        for on in (True, False):
            e.spec_ahead = ahead if on else None
            e.generate(prompts[:n], SamplingParams(max_tokens=32, ignore_eos=True), SpecParams("fixed", 4), "model")
            t = time.perf_counter()
            res = e.generate(prompts[:n], SamplingParams(max_tokens=256, ignore_eos=True), SpecParams("fixed", 4), "model")
            rate = sum(len(r["token_ids"]) for r in res) / (time.perf_counter() - t)
            R[f"g4_{n}_streams_{'ahead' if on else 'waiting'}_tok_s"] = round(rate, 1)
            R.setdefault(f"g4_{n}_streams_ids", []).append([r["token_ids"] for r in res])
        R[f"g4_{n}_streams_same_tokens"] = R[f"g4_{n}_streams_ids"][0] == R.pop(f"g4_{n}_streams_ids")[1]
    # seeded sampled rows (rejection sampling on the device): the same seed, ahead and waiting
    # (equal up to the passes' rounding: their shapes differ), and their tokens/s at 3 streams
    sampled = [SamplingParams(max_tokens=256, temperature=0.8, seed=i, ignore_eos=True) for i in range(3)]
    got = {}
    for on in (True, False):
        e.spec_ahead = ahead if on else None
        t = time.perf_counter()
        res = e.generate(prompts, sampled, SpecParams("fixed", 4), "model")
        R[f"sampled_g4_3_streams_{'ahead' if on else 'waiting'}_tok_s"] = round(
            sum(len(r["token_ids"]) for r in res) / (time.perf_counter() - t), 1)
        got[on] = [r["token_ids"] for r in res]
    R["sampled_same_tokens"] = got[True] == got[False]
    e.spec_ahead = ahead
    R["same_tokens_as_plain"] = R["same_tokens_as_plain"] and R["g4_1_streams_same_tokens"] and R["g4_3_streams_same_tokens"]
    print(json.dumps(R), flush=True)
    out = Path(os.environ.get("OUT", "."), "gpu_chain_check.json")
    out.write_text(json.dumps(R, indent=1) + "\n")
    return 0 if R["same_tokens_as_plain"] and R["drafted"] and R["chain_graphs"] else 1


if __name__ == "__main__":
    sys.exit(main())
