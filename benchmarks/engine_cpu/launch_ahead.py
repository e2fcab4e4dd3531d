"""How many launched-ahead decode passes a step uses, under arrivals and finishes, on CPU.

    PYTHONPATH=. python3 benchmarks/engine_cpu/launch_ahead.py --levels 16,64,128 --label after

The launch-ahead path (cluster.engine.worker.pipeline) with the CPU stand-in for CUDA graphs:
only the capture and replay calls are eager, so which launches are used or dropped is what a
GPU would see. The workload is `scripts/gpu_scale.py`'s sweep scaled to a tiny random Llama
(2 layers, hidden 64, the demo tokenizer's ids): c requests in flight over 2c, each its own
640-token code prompt and 64-192 greedy tokens (`ignore_eos`), the Hopper config's step shape
(2048 tokens a step, prefill chunks of 512). Counted: decode steps, passes launched ahead, those
used, and the decode passes the target ran (a miss runs the step afresh; a dropped launch
was a pass for nothing). Adds this checkout's results under --label to launch_ahead.json in
--out and redraws launch_ahead.png from every label there; run it once per checkout:

    git archive <commit> | tar -x -C /tmp/before
    PYTHONPATH=/tmp/before python3 benchmarks/engine_cpu/launch_ahead.py --label before
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from host_step import prompts  # noqa: E402 - this folder's own helper


def build_engine(max_seqs: int):
    import torch
    from transformers import LlamaConfig

    from cluster.engine.config import EngineConfig
    from cluster.engine.engine import Engine
    from cluster.engine.worker.capture import eager_on_cpu
    from cluster.engine.worker.embedded import random_model
    from cluster.engine.worker.loader import load_tokenizer

    torch.manual_seed(0)
    tok = load_tokenizer("cluster/models/demo/target")
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=128, max_position_embeddings=2048,
                      tie_word_embeddings=False)
    model = random_model(cfg, "cpu", torch.float32, seed=0)
    ecfg = EngineConfig(max_num_seqs=max_seqs, max_model_len=1024, max_waiting=4096, max_batch_tokens=2048,
                        prefill_chunk=512, gamma_max=4)
    with eager_on_cpu():
        engine = Engine(model, tok, ecfg, {}, None, identity="launch-ahead-tiny")
    assert engine.pipeline is not None
    return engine


def measure(engine, c: int, seed: int) -> dict:
    from cluster.bench.load import run_engine
    from cluster.engine.scheduling.sequence import SpecParams

    n = max(16, 2 * c)
    rng = random.Random(5)
    lengths = [rng.randint(64, 192) for _ in range(n)]
    p, t = engine.pipeline, engine.totals
    # counters an older checkout may lack count as None
    counts = lambda: (t["steps"], t["prefill_steps"], p.launched, p.hits,  # noqa: E731
                      getattr(p, "dropped_rows", None), getattr(p, "deferred_rows", None))
    before = counts()
    t0 = time.perf_counter()
    done, _ = run_engine(engine, prompts(engine.tokenizer, n, seed), c, lengths, SpecParams("off"))
    wall = time.perf_counter() - t0
    steps, prefill, launched, hits, dropped_rows, deferred_rows = (
        None if a is None else a - b for a, b in zip(counts(), before))
    decode = steps - prefill
    fresh = decode - hits  # every decode step here is plain and greedy: launched ahead, or not
    assert sorted(len(r["token_ids"]) for r in done) == sorted(lengths), "tokens lost"
    return {"concurrency": c, "requests": n, "steps": steps, "prefill_steps": prefill, "decode_steps": decode,
            "launched": launched, "used": hits, "dropped": launched - hits, "fresh": fresh,
            "decode_passes": fresh + launched, "fresh_of_decode_steps": fresh / max(decode, 1),
            "passes_per_decode_step": (fresh + launched) / max(decode, 1),
            "dropped_rows": dropped_rows, "deferred_rows": deferred_rows, "wall_s": wall}


def plot(runs: dict[str, list[dict]], path: Path) -> None:
    """Decode steps by kind at each level, one bar per checkout (label)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.8))
    levels = [r["concurrency"] for r in next(iter(runs.values()))]
    width = 0.8 / len(runs)
    for k, (label, results) in enumerate(runs.items()):
        xs = [i + k * width for i in range(len(levels))]
        used = [r["used"] for r in results]
        ax.bar(xs, used, width, color="C0", label="launched ahead, used" if k == 0 else None)
        ax.bar(xs, [r["dropped"] for r in results], width, bottom=used, color="C3",
               label="launched ahead, dropped" if k == 0 else None)
        ax.bar(xs, [r["fresh"] for r in results], width, bottom=[r["launched"] for r in results], color="C1",
               label="run afresh (host waits)" if k == 0 else None)
        for x, r in zip(xs, results):
            ax.text(x, r["decode_passes"], label, ha="center", va="bottom", fontsize=7)
    ax.set_xticks([i + width * (len(runs) - 1) / 2 for i in range(len(levels))], [str(c) for c in levels])
    ax.set(xlabel="requests in flight", ylabel="decode passes",
           title="Launch-ahead decode passes, arrivals and finishes (CPU stand-in)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--levels", default="16,64,128")
    ap.add_argument("--out", default=str(HERE))
    ap.add_argument("--label", default="branch", help="this checkout's name in launch_ahead.json")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    levels = [int(x) for x in args.levels.split(",")]
    engine = build_engine(max(levels))
    results = []
    for i, c in enumerate(levels):
        r = measure(engine, c, seed=100 + i)
        print(json.dumps(r), flush=True)
        results.append(r)
    out = Path(args.out)
    path = out / "launch_ahead.json"
    kept = json.loads(path.read_text()) if path.exists() else {}
    kept[args.label] = {"command": " ".join(["python3", "benchmarks/engine_cpu/launch_ahead.py", *sys.argv[1:]]),
                        "code": os.environ.get("PYTHONPATH", "."), "results": results}
    path.write_text(json.dumps(kept, indent=1) + "\n")
    plot({k: v["results"] for k, v in kept.items()}, out / "launch_ahead.png")


if __name__ == "__main__":
    main()
