"""The multi-row GEMV (cluster/engine/gemv.py, _gemv_rows) against cuBLAS, on the GPU: its
outputs against the eager composition at the 8B shapes, and the step times it is for: a
batch-1 verify pass of gamma + 1 tokens and a small decode batch, with projections of up to
8 rows on the Triton kernel (GEMV_MAX_ROWS=8) and on cuBLAS (1), CUDA graphs as served.

    bash .device-bundle/unpack.sh; PYTHONPATH=/tmp/site:$PWD python3 scripts/gpu_gemv_rows.py
    # writes $OUT/gpu_gemv_rows.json
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cluster.bench.embed import demo_8b  # noqa: E402
from cluster.bench.synthetic import cuda_time  # noqa: E402
from cluster.engine import gemv, model  # noqa: E402
from cluster.engine.engine import Engine  # noqa: E402
from cluster.engine.scheduler import EngineConfig  # noqa: E402

OUT = os.environ.get("OUT", ".")
DEMO = Path(__file__).resolve().parents[1] / "cluster" / "models" / "demo"


def accuracy() -> dict:
    """Largest error against the eager composition (bf16; fp32 reference), per shape and rows."""
    out, g = {}, torch.Generator(device="cuda").manual_seed(0)
    shapes = {"qkv": (6144, 4096, "rmsnorm", False), "o": (4096, 4096, "none", True),
              "down": (4096, 14336, "silu", True)}
    for name, (n, k, pro, res) in shapes.items():
        w = (torch.randn(n, k, device="cuda", generator=g) / k ** 0.5).bfloat16()
        nw = (1 + 0.1 * torch.randn(k, device="cuda", generator=g)).bfloat16() if pro == "rmsnorm" else None
        for rows in (1, 2, 3, 5, 8):
            x = torch.randn(1, rows, 2 * k if pro == "silu" else k, device="cuda", generator=g).bfloat16()
            r = torch.randn(1, rows, n, device="cuda", generator=g).bfloat16() if res else None
            y = gemv.fused_linear(x, w, None, nw, 1e-5, pro == "silu", r).float()
            ref = model.linear(x.float(), w.float(), None, None if nw is None else nw.float(), 1e-5, pro == "silu",
                               None if r is None else r.float())
            out[f"{name}/{rows}"] = ((y - ref).abs().max() / ref.abs().max()).item()
    return out


def step_times(engine: Engine, max_rows: int) -> dict:
    """ms of a batch-1 verify of 1..9 tokens and a decode step of 2, 4 and 8 rows (graph replays)."""
    gemv.MAX_ROWS = max_rows
    engine.runner.graphs.graphs.clear()  # captured graphs hold the kernels they were captured with
    run, slots = engine.runner, [engine.kv.allocate() for _ in range(8)]
    for s in slots:
        run.forward([s], [0], [list(range(5, 517))], last_only=True)  # 512 tokens of context
    t = {f"verify{w}": 1e3 * cuda_time(lambda w=w: run.forward(slots[:1], [512], [[5] * w], last_only=False))
         for w in range(1, 10)}
    t.update({f"decode_b{b}": 1e3 * cuda_time(lambda b=b: run.forward(slots[:b], [512] * b, [[5]] * b, last_only=False))
              for b in (2, 4, 8)})
    for s in slots:
        engine.kv.free(s)
    return t


def main() -> int:
    from transformers import AutoTokenizer

    R = {"device": torch.cuda.get_device_name()}
    target, _ = demo_8b(DEMO / "target", DEMO / "draft")
    cfg = EngineConfig(max_num_seqs=8, max_model_len=1024, prefix_cache_blocks=0, device="cuda", dtype="bfloat16",
                       compile=True)
    engine = Engine(target, AutoTokenizer.from_pretrained(DEMO / "target"), cfg)  # warm-up tunes every row bucket
    R["relative_error"] = accuracy()
    print("relative error:", R["relative_error"], flush=True)
    for rows in (8, 1):
        R[f"max_rows_{rows}"] = step_times(engine, rows)
        print(f"max rows {rows}:", {k: round(v, 3) for k, v in R[f"max_rows_{rows}"].items()}, flush=True)
    a, b = R["max_rows_8"], R["max_rows_1"]
    R["verify5_over_decode"] = {"rows_kernel": a["verify5"] / a["verify1"], "cublas": b["verify5"] / b["verify1"]}
    print("verify5/decode:", R["verify5_over_decode"], flush=True)
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "gpu_gemv_rows.json"), "w") as f:
        json.dump(R, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
