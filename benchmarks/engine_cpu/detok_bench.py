"""Streaming detokenization cost a token (cluster.engine.stopping.Detokenizer), on CPU.

    PYTHONPATH=. python3 benchmarks/engine_cpu/detok_bench.py --code before=/tmp/ds-base,after=. \
        --out benchmarks/engine_cpu/detokenize/decode_stream

50 held-out code texts (~3,000 characters each) through the demo tokenizer; each token is
added and its text delta taken, as the engine (in process) or the serving client does a step.
Without stop strings (`add` only appends) and with one (every token decoded for the check).
Best of 3 rounds per checkout, each checkout in its own process. Writes decode_stream.json
and decode_stream.png in --out.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path


def measure() -> dict:
    from cluster.bench.workloads import code_prompts
    from cluster.engine.stopping import Detokenizer
    from cluster.engine.worker.loader import load_tokenizer

    tok = load_tokenizer("cluster/models/demo/target")
    seqs = [tok.encode(t) for t in code_prompts(50, chars=3000, seed=7)]
    out = {}
    for name, stop in (("no_stop", []), ("stop_string", ["\n\n\n\n"])):
        best, n = float("inf"), 0
        for _ in range(3):
            t, n = time.perf_counter(), 0
            for ids in seqs:
                d = Detokenizer(tok, stop)
                for x in ids:
                    if d.add(x):
                        break
                    d.delta(False)
                    n += 1
            best = min(best, time.perf_counter() - t)
        out[name] = {"us_per_token": 1e6 * best / n, "tokens": n}
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--code", default="this=.", help="label=checkout,... (each run with PYTHONPATH=checkout)")
    ap.add_argument("--out", default="benchmarks/engine_cpu/detokenize/decode_stream")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        print(json.dumps(measure()))
        return 0
    results = {}
    for item in args.code.split(","):
        label, path = item.split("=", 1)
        env = {**os.environ, "PYTHONPATH": str(Path(path).resolve())}
        run = subprocess.run([sys.executable, __file__, "--worker"], env=env, capture_output=True, text=True, check=True)
        results[label] = json.loads(run.stdout.strip().splitlines()[-1])
        print(label, results[label])
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "decode_stream.json").write_text(json.dumps({"command": " ".join(sys.argv), "results": results}, indent=2))
    from cluster.bench.report import figure, save_figure  # here: workers import another checkout

    plt = figure()
    modes = ["no_stop", "stop_string"]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    width = 0.8 / len(results)
    for i, (label, r) in enumerate(results.items()):
        ax.bar([m + i * width for m in range(len(modes))], [r[m]["us_per_token"] for m in modes], width, label=label)
    ax.set_xticks([m + width * (len(results) - 1) / 2 for m in range(len(modes))], modes)
    ax.set(ylabel="us a token (add + delta)", title="Streaming detokenization, demo tokenizer, CPU")
    save_figure(fig, out / "decode_stream.png", ax)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
