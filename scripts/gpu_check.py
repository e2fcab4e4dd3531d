"""GPU check on Hopper: FA3 against SDPA (prefill, decode, verify shapes), and an 8B-shaped
Llama (Llama-3.1-8B dimensions, random bf16 weights) decoding at batch 1 beside the
memory-bandwidth floor.

    bash scripts/gpu_check.sh            # on the GPU machine; writes $OUT/gpu_check.json
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from cluster.bench.harness import copy_bandwidth, cuda_time
from cluster.bench.synthetic import random_llama
from cluster.engine.scheduling.kv_cache import KVCache
from cluster.engine.worker.attention import Fa3Backend, SdpaBackend, make_backend
from cluster.engine.worker.model import CausalLM
from cluster.engine.worker.runner import Runner

def random_model(layers: int | None = None) -> CausalLM:
    return random_llama(layers)


def parity(results: dict) -> None:
    model = random_model(layers=2)
    s = model.shape
    fa3 = make_backend("fa3", torch.device("cuda"), torch.bfloat16)
    assert isinstance(fa3, Fa3Backend)
    out = {}
    for name, backend in (("sdpa", SdpaBackend()), ("fa3", fa3)):
        model.backend = backend
        kv = KVCache.dense(s.layers, 4, 4096, s.kv_heads, s.head_dim, torch.bfloat16, "cuda")
        r = Runner(model, kv)
        g = torch.Generator().manual_seed(1)
        p = [torch.randint(0, 128000, (n,), generator=g).tolist() for n in (700, 333)]
        pre = r.forward([1, 3], [0, 0], p, last_only=False)                       # prefill, ragged
        dec = r.forward([1, 3], [700, 333], [[5], [6]], last_only=False)          # decode
        ver = r.forward([1, 3], [701, 334], [[7, 8, 9, 10, 11], [12, 13, 14]], last_only=False)  # verify
        out[name] = (pre[0, :700], pre[1, :333], dec, ver[0, :5], ver[1, :3])
    rows = {}
    for label, a, b in zip(["prefill_a", "prefill_b", "decode", "verify_a", "verify_b"], out["sdpa"], out["fa3"]):
        rel = ((a - b).abs().max() / a.abs().max()).item()
        agree = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
        rows[label] = {"max_rel_err": rel, "argmax_agreement": agree}
    results["fa3_vs_sdpa"] = rows
    print("fa3 vs sdpa:", json.dumps(rows), flush=True)
    del model


def decode_speed(results: dict, bandwidth: float) -> None:
    model = random_model()
    s = model.shape
    params = sum(p.numel() for p in model.parameters())
    param_bytes = params * 2
    floor_ms = 1e3 * param_bytes / bandwidth
    out = {"params": params, "param_bytes": param_bytes, "floor_ms_per_token": floor_ms,
           "ceiling_tokens_per_s": 1e3 / floor_ms}
    for name in ("fa3", "sdpa"):
        model.backend = make_backend(name, torch.device("cuda"), torch.bfloat16)
        kv = KVCache.dense(s.layers, 2, 2048 + 64, s.kv_heads, s.head_dim, torch.bfloat16, "cuda")
        r = Runner(model, kv)
        r.forward([0], [0], [list(range(1, 513))], last_only=True)  # 512-token prompt
        pos = [512]

        def step(t=1):
            r.forward([0], [pos[0]], [[7] * t], last_only=True)

        decode = cuda_time(lambda: step(1), 50)
        verify = cuda_time(lambda: step(5), 50)
        # wall clock of a full decode loop, host overheads included
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for i in range(128):
            r.forward([0], [512 + i], [[7]], last_only=True).argmax(-1).item()
        wall = (time.perf_counter() - t0) / 128
        out[name] = {"decode_ms": 1e3 * decode, "verify5_ms": 1e3 * verify, "verify5_over_decode": verify / decode,
                     "loop_ms_per_token": 1e3 * wall, "loop_tokens_per_s": 1 / wall,
                     "fraction_of_ceiling": floor_ms / (1e3 * wall)}
        print(name, json.dumps(out[name]), flush=True)
    results["llama8b_batch1"] = out


def main() -> int:
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    bw = copy_bandwidth()
    results["copy_bandwidth_TBps"] = bw / 1e12
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    parity(results)
    torch.cuda.empty_cache()
    decode_speed(results, bw)
    path = os.path.join(os.environ.get("OUT", "."), "gpu_check.json")
    with open(path, "w") as f:
        json.dump(results, f, indent=2)
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
