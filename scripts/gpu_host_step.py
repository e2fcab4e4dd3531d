"""The engine's host time per step on a GPU (CUDA graphs, the paged Triton kernel, the
decode pipeline) at 64-256 sequences, for several checkouts of the code in one run, and
whether their greedy tokens agree.

    python3 scripts/gpu_host_step.py main=.device-extra/baseline branch=.   # on the GPU machine

A small random Llama (4 layers, hidden 512, bf16) over the demo tokenizer, so a step's GPU
work is short and its host work shows. Prompts: 640-token code prompts from
.device-extra/prompts.json (made on the CPU by benchmarks/engine_cpu/host_step.prompts). Each
(batch, mode) prefills all its rows, then times `STEPS` steps with no arrivals or finishes:
wall ms per step, the GPU time of the step's graph replays (CUDA events), host = the rest.
Writes $OUT/gpu_host_step.json.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import subprocess
import sys
import time

DEMO = "cluster/models/demo/target"
STEPS = int(os.environ.get("STEPS", "40"))
BATCHES = [int(b) for b in os.environ.get("BATCHES", "64,128,256").split(",")]


def worker() -> None:
    import torch
    from transformers import LlamaConfig

    from cluster.engine.config import EngineConfig
    from cluster.engine.drafters.ngram import NgramDrafter
    from cluster.engine.engine import Engine
    from cluster.engine.sampling import SamplingParams
    from cluster.engine.scheduling.sequence import SpecParams
    from cluster.engine.worker.embedded import random_model
    from cluster.engine.worker.loader import load_tokenizer

    replays: list = []
    replay = torch.cuda.CUDAGraph.replay

    def timed(self):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        replay(self)
        b.record()
        replays.append((a, b))

    torch.cuda.CUDAGraph.replay = timed
    tok = load_tokenizer(DEMO)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=512, num_hidden_layers=4, num_attention_heads=8,
                      num_key_value_heads=4, intermediate_size=1024, max_position_embeddings=2048,
                      tie_word_embeddings=False)
    model = random_model(cfg, "cuda", torch.bfloat16, seed=0)
    ecfg = EngineConfig(max_num_seqs=max(BATCHES), max_model_len=1024, max_waiting=1024, max_batch_tokens=2048,
                        prefill_chunk=512, gamma=4, gamma_max=4, device="cuda", dtype="bfloat16", kv_cache_gb=4)
    t = time.perf_counter()
    engine = Engine(model, tok, ecfg, {"ngram": NgramDrafter()}, "ngram", identity="gpu-host-step")
    print(json.dumps({"start_s": time.perf_counter() - t}), flush=True)
    prompts = iter(json.load(open(".device-extra/prompts.json")))
    for b in BATCHES:
        for mode in ("decode", "verify"):
            spec = SpecParams("off") if mode == "decode" else SpecParams("fixed", 4)
            ids = [engine.add_request(next(prompts), SamplingParams(max_tokens=400, ignore_eos=True), spec)
                   for _ in range(b)]
            while engine.scheduler.waiting or not all(s.prefilled for s in engine.scheduler.running):
                engine.step()
            for _ in range(3):
                engine.step()
            torch.cuda.synchronize()
            replays.clear()
            walls, tokens0 = [], engine.totals["tokens"]
            for _ in range(STEPS):
                t = time.perf_counter()
                engine.step()
                walls.append(time.perf_counter() - t)
            torch.cuda.synchronize()
            gpu = sum(a.elapsed_time(z) for a, z in replays) / 1e3
            out = [engine.seqs[i].token_ids[engine.seqs[i].num_prompt:] for i in ids]
            for i in ids:
                engine.abort(i)
            print(json.dumps({"batch": b, "mode": mode, "wall_ms_per_step": 1e3 * sum(walls) / STEPS,
                              "wall_ms_p50": 1e3 * statistics.median(walls), "graph_gpu_ms_per_step": 1e3 * gpu / STEPS,
                              "host_ms_per_step": 1e3 * (sum(walls) - gpu) / STEPS,
                              "tokens_per_step": (engine.totals["tokens"] - tokens0) / STEPS,
                              "tokens_md5": hashlib.md5(json.dumps(out).encode()).hexdigest()}), flush=True)


def main(codes: list[str]) -> int:
    results: dict = {"device": None, "steps": STEPS, "runs": {}}
    for rep in range(int(os.environ.get("REPS", "1"))):
        for code in codes:
            label, path = code.split("=", 1)
            env = {**os.environ, "PYTHONPATH": f"{os.path.abspath(path)}:/tmp/site:{os.getcwd()}"}
            p = subprocess.run([sys.executable, __file__, "--worker"], env=env, capture_output=True, text=True)
            if p.returncode:
                print(p.stderr[-4000:])
                return 1
            rows = [json.loads(x) for x in p.stdout.splitlines() if x.startswith("{")]
            results["runs"].setdefault(label, []).append(rows)
            for r in rows:
                print(rep, label, r, flush=True)
    import torch

    results["device"] = torch.cuda.get_device_name()
    with open(os.path.join(os.environ.get("OUT", "."), "gpu_host_step.json"), "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    if sys.argv[1:] == ["--worker"]:
        worker()
    else:
        raise SystemExit(main(sys.argv[1:]))
