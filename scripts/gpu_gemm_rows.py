"""The multi-row kernel (cluster/engine/worker/gemv.py, _gemm_rows) against cuBLAS, on the GPU.

1. Each 8B projection (norm, SiLU and residual as the model fuses them) at 2, 5, 9 and 16 rows:
   every config the kernel tunes over, cuBLAS as the model composes it without the kernel
   (eager norm or SiLU, then addmm/mm), and the one-row GEMV; times are CUDA-graph replays of
   20 calls that cycle through enough weight copies (>= 200 MB) that none is served from L2,
   so neither launch cost nor cache is in them; ideal = weight bytes / copy bandwidth.
2. Its error against an fp32 reference, next to cuBLAS's.
3. Step times, CUDA graphs as served: a batch-1 verify of 1..9 tokens and decode steps of
   2..16 rows, with the kernel (GEMV_MAX_ROWS 16) and with cuBLAS (1).

    bash .device-bundle/unpack.sh; PYTHONPATH=/tmp/site:$PWD python3 scripts/gpu_gemm_rows.py
    # writes $OUT/gpu_gemm_rows.json; then, anywhere:
    python3 scripts/gpu_gemm_rows.py plot benchmarks/gpu/h100/gemm_rows/gpu_gemm_rows.json

A tensor-parallel rank's projections instead (part 1 only, a wider config set, K splits 1, 2
and 4 for every shape, rows 5 and 7: the verify passes of gamma 4 and 6):

    SHAPES=70b-tp4,70b-tp2 CONFIGS=wide SPLITS=1,2,4 ROWS=5,7 PARTS=kernels python3 scripts/gpu_gemm_rows.py
"""

from __future__ import annotations

import json
import os
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from cluster.bench.harness import copy_bandwidth, cuda_time  # noqa: E402
from cluster.engine.worker import gemv, model  # noqa: E402
from cluster.bench.harness import OUT  # noqa: E402

DEMO = Path(__file__).resolve().parents[1] / "cluster" / "models" / "demo"
# name: (N, K, prologue, residual) as the 8B model calls them
SHAPES = {"qkv": (6144, 4096, "rmsnorm", False), "o": (4096, 4096, "none", True),
          "gate_up": (28672, 4096, "rmsnorm", False), "down": (4096, 14336, "silu", True),
          "lm_head": (128256, 4096, "none", False)}


def rank_shapes(tp: int) -> dict:
    """A tensor-parallel rank's projections of the 70B shape (64 q heads, 8 KV heads of 128,
    hidden 8192, intermediate 28672), as rank 0 calls them (its partial sums carry the residual)."""
    return {f"70b-tp{tp}/qkv": ((64 + 16) * 128 // tp, 8192, "rmsnorm", False),
            f"70b-tp{tp}/o": (8192, 64 * 128 // tp, "none", True),
            f"70b-tp{tp}/gate_up": (2 * 28672 // tp, 8192, "rmsnorm", False),
            f"70b-tp{tp}/down": (8192, 28672 // tp, "silu", True)}


# CONFIGS=wide: more programs at a rank's narrower N (a 70B rank's qkv is 2560 wide at TP 4)
WIDE = [(16, 128, 4, 4), (16, 256, 8, 4), (16, 512, 4, 3), (16, 512, 8, 3), (16, 1024, 8, 2),
        (32, 128, 4, 4), (32, 128, 4, 5), (32, 256, 8, 4), (32, 512, 4, 3), (32, 512, 8, 3),
        (64, 64, 4, 6), (64, 128, 8, 5), (64, 512, 8, 3), (128, 64, 4, 6), (128, 256, 8, 3)]


def graph_time(fn, copies: int, reps: int = 20) -> float:
    """Seconds per call of fn(i) (i: which weight copy), from a CUDA graph of `reps` calls."""
    fn(0)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn(0)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        for i in range(reps):
            fn(i % copies)
    return cuda_time(g.replay, 10) / reps


def tuned_configs() -> list[dict]:
    """_gemm_rows's autotune configs as fused_linear's `config` argument takes them."""
    return [dict(c.kwargs, num_warps=c.num_warps, num_stages=c.num_stages) for c in gemv._rows_configs()]


def sweep(call, configs: list[dict], k_range: int, copies: int) -> tuple[dict, float, dict]:
    """Time call(i, config) for every config whose BLOCK_K divides the K range one program
    sums: (best config, its ms, ms or the error's name per config)."""
    times = {}
    for c in configs:
        if k_range % c["BLOCK_K"]:
            continue
        try:
            times[json.dumps(c)] = 1e3 * graph_time(lambda i, c=c: call(i, c), copies)
        except Exception as e:  # noqa: BLE001 (out of shared memory, say)
            times[json.dumps(c)] = type(e).__name__
    ok = {c: t for c, t in times.items() if isinstance(t, float)}
    best = min(ok, key=ok.get)
    return json.loads(best), ok[best], times


@contextmanager
def split_k(split: int | None):
    """fused_linear with `split` K splits for every shape (None: the kernel's own rule)."""
    rule = gemv._splits
    if split is not None:
        gemv._splits = lambda n, k: split if k % (split * 128) == 0 else 1
    try:
        yield
    finally:
        gemv._splits = rule


def cublas(x, w, nw, silu, r):
    if nw is not None:
        x = model.rms_norm(x, nw, 1e-5)
    if silu:
        x = model.silu_mul(x)
    n = w.shape[0]
    x2 = x.reshape(-1, x.shape[-1])
    return torch.addmm(r.reshape(-1, n), x2, w.t()) if r is not None else x2 @ w.t()


def kernels(bw: float) -> dict:
    out, g = {}, torch.Generator(device="cuda").manual_seed(0)
    configs = tuned_configs()
    if os.environ.get("CONFIGS") == "wide":
        configs += [dict(BLOCK_N=bn, BLOCK_K=bk, num_warps=w, num_stages=st) for bn, bk, w, st in WIDE]
    shapes = SHAPES if "SHAPES" not in os.environ else \
        {k: v for x in os.environ["SHAPES"].split(",") for k, v in rank_shapes(int(x.split("tp")[1])).items()}
    splits = [int(x) for x in os.environ["SPLITS"].split(",")] if "SPLITS" in os.environ else [None]
    rows_set = [int(x) for x in os.environ.get("ROWS", "1,2,5,9,16").split(",")]
    for name, (n, k, pro, res) in shapes.items():
        w = (torch.randn(n, k, device="cuda", generator=g) / k ** 0.5).bfloat16()
        copies = -(-200_000_000 // (w.numel() * 2))
        ws = [w] + [w.clone() for _ in range(copies - 1)]
        nw = (1 + 0.1 * torch.randn(k, device="cuda", generator=g)).bfloat16() if pro == "rmsnorm" else None
        for rows in sorted({1, *rows_set}):
            x = torch.randn(rows, 2 * k if pro == "silu" else k, device="cuda", generator=g).bfloat16()
            r = torch.randn(rows, n, device="cuda", generator=g).bfloat16() if res else None
            row = {"ideal_ms": 1e3 * w.numel() * 2 / bw,
                   "cublas_ms": 1e3 * graph_time(lambda i: cublas(x, ws[i], nw, pro == "silu", r), copies)}
            ref = cublas(x.float(), w.float(), None if nw is None else nw.float(), pro == "silu",
                         None if r is None else r.float())
            scale = ref.abs().max().item()
            row["cublas_err"] = (cublas(x, w, nw, pro == "silu", r).float() - ref).abs().max().item() / scale
            if rows == 1:
                f = lambda i: gemv.fused_linear(x, ws[i], None, nw, 1e-5, pro == "silu", r)  # noqa: E731
                row["gemv_ms"] = 1e3 * graph_time(f, copies)
                row["gemv_err"] = (f(0).float() - ref).abs().max().item() / scale
            else:
                for split in splits:  # None: the kernel's own rule (gemv._splits)
                    with split_k(split):
                        best, best_ms, times = sweep(lambda i, c: gemv.fused_linear(
                            x, ws[i], None, nw, 1e-5, pro == "silu", r, config=c), configs, k // gemv._splits(n, k),
                            copies)
                    if split is not None:
                        row.setdefault("by_split", {})[split] = {"best_ms": best_ms, "best": best}
                    if "best_ms" not in row or best_ms < row["best_ms"]:
                        row.update(best_ms=best_ms, best=best, configs=times, split=split)
                with split_k(row["split"]):
                    y = gemv.fused_linear(x, w, None, nw, 1e-5, pro == "silu", r, config=row["best"])
                row["kernel_err"] = (y.float() - ref).abs().max().item() / scale
                row["used"] = "kernel" if gemv.supported(rows, n, k) else "cublas"
            out[f"{name}/{rows}"] = row
            print(name, rows, {a: (round(b, 4) if isinstance(b, float) else b) for a, b in row.items()
                               if a not in ("configs",)}, flush=True)
        ws = None  # the copies go before the next shape
    return out


def step_times(engine, max_rows: int) -> dict:
    """ms of a batch-1 verify of 1..9 tokens and decode steps of 2..16 rows (graph replays)."""
    gemv.MAX_ROWS = max_rows
    engine.runner.graphs.graphs.clear()  # captured graphs hold the kernels they were captured with
    run, handles = engine.runner, [engine.kv.open() for _ in range(16)]
    for h in handles:
        engine.kv.grow(h, 512 + 9)  # the context and the widest verify
    slots = [h.row for h in handles]
    for s in slots:
        run.forward([s], [0], [list(range(5, 517))], last_only=True)  # 512 tokens of context
    t = {f"verify{w}": 1e3 * cuda_time(lambda w=w: run.forward(slots[:1], [512], [[5] * w], last_only=False))
         for w in range(1, 10)}
    t.update({f"decode_b{b}": 1e3 * cuda_time(lambda b=b: run.forward(slots[:b], [512] * b, [[5]] * b, last_only=False))
              for b in (2, 4, 8, 16)})
    logits = run.forward(slots[:1], [512], [[5, 6, 7, 8, 9]], last_only=False)[0, :5]
    for h in handles:
        engine.kv.close(h)
    return t, logits.clone()


def main() -> int:
    from transformers import AutoTokenizer

    from cluster.engine.config import EngineConfig
    from cluster.engine.engine import Engine
    from cluster.engine.worker.embedded import demo_8b

    os.makedirs(OUT, exist_ok=True)
    R = {"device": torch.cuda.get_device_name()}
    R["copy_bandwidth_Bps"] = bw = copy_bandwidth()  # as the must-show's ceiling counts it
    print(R, flush=True)
    t0 = time.perf_counter()
    R["kernels"] = kernels(bw)
    print(f"kernel sweep {time.perf_counter() - t0:.0f} s", flush=True)
    if os.environ.get("PARTS") == "kernels":
        with open(os.path.join(OUT, os.environ.get("NAME", "gpu_gemm_rows") + ".json"), "w") as f:
            json.dump(R, f, indent=1)
        return 0
    target, _ = demo_8b(DEMO / "target", DEMO / "draft")
    cfg = EngineConfig(max_num_seqs=16, max_model_len=1024, device="cuda", dtype="bfloat16",
                       compile=True)
    engine = Engine(target, AutoTokenizer.from_pretrained(DEMO / "target"), cfg)
    logits = {}
    for rows in (16, 1):
        R[f"max_rows_{rows}"], logits[rows] = step_times(engine, rows)
        print(f"max rows {rows}:", {k: round(v, 3) for k, v in R[f"max_rows_{rows}"].items()}, flush=True)
    a, b = R["max_rows_16"], R["max_rows_1"]
    R["verify5_over_decode"] = {"kernel": a["verify5"] / a["verify1"], "cublas": b["verify5"] / b["verify1"]}
    R["verify5_logits"] = {"max_abs_diff": (logits[16] - logits[1]).abs().max().item(),
                           "scale": logits[1].abs().max().item(),
                           "argmax_equal": bool((logits[16].argmax(-1) == logits[1].argmax(-1)).all())}
    print("verify5/decode:", R["verify5_over_decode"], R["verify5_logits"], flush=True)
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "gpu_gemm_rows.json"), "w") as f:
        json.dump(R, f, indent=1)
    return 0


def plot(path: str) -> None:
    """Per projection at 5 rows (a gamma-4 verify) and verify step time by width, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    R = json.load(open(path))
    K = R["kernels"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.2))
    names = list(SHAPES)
    bars = {"weights at copy bandwidth": [K[f"{n}/5"]["ideal_ms"] for n in names],
            "cuBLAS (+ eager norm / SiLU), 5 rows": [K[f"{n}/5"]["cublas_ms"] for n in names],
            "gemm_rows kernel, 5 rows": [K[f"{n}/5"]["best_ms"] for n in names],
            "gemv kernel, 1 row": [K[f"{n}/1"]["gemv_ms"] for n in names]}
    for i, (label, ys) in enumerate(bars.items()):
        a.bar([j + 0.2 * i for j in range(len(names))], [y / K[f"{n}/5"]["ideal_ms"]
              for y, n in zip(ys, names)], 0.2, label=label)
    a.set_xticks([j + 0.3 for j in range(len(names))],
                 [n + ("\n(stays cuBLAS)" if K[f"{n}/5"].get("used") == "cublas" else "") for n in names])
    a.set_ylabel("time / ideal (lower is better)")
    a.set_title(f"8B projections, {R['device']}")
    a.legend(fontsize=8)
    w = list(range(1, 10))
    for rows, label in ((16, "gemm_rows kernel up to 16 rows"), (1, "cuBLAS beyond 1 row")):
        b.plot(w, [R[f"max_rows_{rows}"][f"verify{i}"] for i in w], "o-", label=label)
    b.axhline(R["max_rows_16"]["verify1"] * 1.15, ls="--", c="gray", label="1.15 x decode step")
    b.set_xlabel("tokens in the batch-1 step (1 = decode, 5 = gamma-4 verify)")
    b.set_ylabel("ms (CUDA graph)")
    b.set_title("batch-1 step time, 8B shape")
    b.legend(fontsize=8)
    fig.tight_layout()
    out = str(Path(path).with_suffix(".png"))
    fig.savefig(out, dpi=110)
    print("wrote", out)


if __name__ == "__main__":
    if sys.argv[1:2] == ["plot"]:
        sys.exit(plot(sys.argv[2]))
    sys.exit(main())
