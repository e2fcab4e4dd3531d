"""Split-K for the multi-row kernel on the 8B down_proj (K 14336 > 2N): GEMV_SPLIT_K 1, 2, 4, 8
against cuBLAS (the SiLU kernel, then addmm), at 2, 5, 9 and 16 rows, each config the kernel
tunes over; CUDA-graph replays cycling through weight copies past L2, as scripts/gpu_gemm_rows.py.
Needs no bundle (torch, triton, transformers):

    PYTHONPATH=$PWD python3 scripts/gpu_split_k.py      # writes $OUT/gpu_split_k.json
    PYTHONPATH=/tmp/site:$PWD STEP=1 python3 ...         # the 8B steps (FA3: unpack .device-bundle-engine)

STEP=1: what the kernel figures mean for a step. Two engines on the same 8B-shaped weights in
one process, one whose CUDA graphs were captured with GEMV_SPLIT_K 0 and one with 4, timed in
turns (so clocks and the GPU's state are shared): the gamma-4 verify (5 rows) and the decode step.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_gemm_rows  # noqa: E402
from gpu_gemm_rows import cublas, sweep, tuned_configs  # noqa: E402

from cluster.bench.harness import copy_bandwidth, cuda_time, step_calls, triton_interpreter_numpy24  # noqa: E402
from cluster.engine.worker import gemv  # noqa: E402
from cluster.bench.harness import OUT  # noqa: E402

# SMOKE=1 (with TRITON_INTERPRET=1 GEMV_CONFIGS=one): a tiny shape on CPU, to check the script
SMOKE = os.environ.get("SMOKE") == "1"
DEV, DT = ("cpu", torch.float32) if SMOKE else ("cuda", torch.bfloat16)


def main() -> int:
    if SMOKE:
        triton_interpreter_numpy24()  # the interpreter under numpy >= 2.4, as the CPU test runs it
        gpu_gemm_rows.graph_time = lambda fn, copies: (fn(0), 1e-3)[1]
    n, k = (40, 1024) if SMOKE else (4096, 14336)
    bw = 1e12 if SMOKE else copy_bandwidth()
    g = torch.Generator(device=DEV).manual_seed(0)
    w = (torch.randn(n, k, device=DEV, generator=g) / k ** 0.5).to(DT)
    copies = -(-200_000_000 // (w.numel() * 2))
    ws = [w] + [w.clone() for _ in range(copies - 1)]
    configs = tuned_configs()
    R = {"device": "cpu (smoke)" if SMOKE else torch.cuda.get_device_name(), "shape": [n, k], "ideal_ms": 1e3 * w.numel() * 2 / bw, "rows": {}}
    os.makedirs(OUT, exist_ok=True)
    for rows in (5, 2, 9, 16):  # 5 first: a gamma-4 verify; written after each, a cut run keeps it
        x = torch.randn(rows, 2 * k, device=DEV, generator=g).to(DT)
        r = torch.randn(rows, n, device=DEV, generator=g).to(DT)
        ref = cublas(x.float(), w.float(), None, True, r.float())
        scale = ref.abs().max().item()
        row = {"cublas_ms": 1e3 * gpu_gemm_rows.graph_time(lambda i: cublas(x, ws[i], None, True, r), copies),
               "cublas_err": (cublas(x, w, None, True, r).float() - ref).abs().max().item() / scale}
        for s in (1, 2, 4, 8):
            gemv.SPLIT_K = s
            split = gemv._splits(n, k) if s > 1 else 1
            best, best_ms, times = sweep(lambda i, c: gemv.fused_linear(x, ws[i], None, None, 1e-5, True, r, config=c),
                                         configs, k // split, copies)
            y = gemv.fused_linear(x, w, None, None, 1e-5, True, r, config=best)
            row[f"split{s}"] = {"best_ms": best_ms, "best": best, "err": (y.float() - ref).abs().max().item() / scale,
                                "configs": times}
        gemv.SPLIT_K = 0
        R["rows"][rows] = row
        print(rows, {a: (round(b, 4) if isinstance(b, float) else {"ms": round(b["best_ms"], 4), "err": b["err"]})
                     for a, b in row.items()}, flush=True)
        Path(OUT, "gpu_split_k.json").write_text(json.dumps(R, indent=1))
    return 0


def step_ab() -> int:
    from transformers import AutoTokenizer

    from cluster.engine.config import EngineConfig
    from cluster.engine.engine import Engine
    from cluster.engine.worker.embedded import demo_8b

    demo = Path(__file__).resolve().parents[1] / "cluster" / "models" / "demo"
    target, _ = demo_8b(demo / "target", demo / "draft")
    tok = AutoTokenizer.from_pretrained(demo / "target")
    cfg = EngineConfig(max_num_seqs=4, max_model_len=1024, prefix_caching=False, gamma=4, gamma_max=8,
                       device="cuda", dtype="bfloat16", compile=True)
    runs, default = {}, gemv.SPLIT_K
    for split in (0, 4):
        gemv.SPLIT_K = split  # read when a graph is captured: this engine's graphs keep it
        engine = Engine(target, tok, cfg, {}, None, identity=f"split{split}")
        _, step = step_calls(engine, list(range(100, 612)), (1, 5))  # the calls keep the engine alive
        runs[split] = {"decode": step[1], "verify5": step[5]}
        for fn in runs[split].values():
            fn()  # capture
    gemv.SPLIT_K = default
    R = {"device": torch.cuda.get_device_name(), "turns": []}
    for _ in range(5):
        R["turns"].append({f"split{s}_{name}_ms": 1e3 * cuda_time(fn, 50) for s in runs for name, fn in runs[s].items()})
        print(R["turns"][-1], flush=True)
    R["median"] = {k: sorted(t[k] for t in R["turns"])[2] for k in R["turns"][0]}
    print("median", R["median"])
    Path(OUT, "gpu_split_k_step.json").write_text(json.dumps(R, indent=1))
    return 0


if __name__ == "__main__":
    if os.environ.get("STEP") == "1":
        sys.exit(step_ab())
    sys.exit(main())
