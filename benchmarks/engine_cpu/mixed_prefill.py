"""Mixed prefill on CPU: 16 decoding streams while 8 new 200-token prompts arrive, with
EngineConfig.mixed_prefill on and off.

    PYTHONPATH=. python3 benchmarks/engine_cpu/mixed_prefill.py --reps 3

The demo pair (cluster/models/demo, target 6 layers x 256, fp32), one torch thread. 16
streams of 64-token prompts are prefilled, then decode 96 tokens each (greedy, ignore_eos);
from their first decoding step on, one 200-token prompt (distinct text, so no prefix hits)
arrives every 4 steps and decodes 32 tokens. Two modes: `plain` (speculation off) and
`draft` (the draft model, fixed gamma 4). Reports wall seconds and steps for the whole
workload, mixed steps, the decoding streams' worst inter-token gap (a prefill step stalls
them) and the arrivals' mean time to first token. Settings alternate within each round;
medians over rounds. CPU only: the point of mixing on a GPU (reading the weights once for
the chunk and the rows) is not what a CPU measures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
TARGET, DRAFT = "cluster/models/demo/target", "cluster/models/demo/draft"


def prompts(tok, n: int, length: int, start: int) -> list[list[int]]:
    text = (HERE.parents[1] / "README.md").read_text()
    ids = tok.encode(text)
    return [ids[start + i * length:start + (i + 1) * length] for i in range(n)]


def run(mixed: bool, mode: str) -> dict:
    from cluster.engine.config import EngineConfig
    from cluster.engine.engine import Engine
    from cluster.engine.sampling import SamplingParams
    from cluster.engine.scheduling.sequence import SpecParams

    cfg = EngineConfig(max_num_seqs=32, max_model_len=512, mixed_prefill=mixed)
    engine = Engine.from_pretrained(TARGET, DRAFT, "model", cfg)
    spec = SpecParams("off") if mode == "plain" else SpecParams("fixed", 4)
    streams = [engine.add_request(p, SamplingParams(max_tokens=96, ignore_eos=True), spec)
               for p in prompts(engine.tokenizer, 16, 64, 0)]
    late = prompts(engine.tokenizer, 8, 200, 16 * 64)
    arrived: dict[str, float] = {}
    first: dict[str, float] = {}
    last_seen: dict[str, float] = {}
    gaps: list[float] = []
    while not all(engine.seqs[s].num_output for s in streams):  # prefill the 16 streams (untimed)
        engine.step()
    t0, steps0, mixed0 = time.perf_counter(), engine.totals["steps"], engine.totals["mixed_steps"]
    step = 0
    while engine.has_work or late:
        if late and step % 4 == 0:
            sid = engine.add_request(late.pop(0), SamplingParams(max_tokens=32, ignore_eos=True), spec)
            arrived[sid] = time.perf_counter()
        for o in engine.step():
            now = time.perf_counter()
            if o.seq_id in arrived and o.seq_id not in first and o.token_ids:
                first[o.seq_id] = now
            if o.seq_id in streams and o.token_ids:
                if o.seq_id in last_seen:
                    gaps.append(now - last_seen[o.seq_id])
                last_seen[o.seq_id] = now
        step += 1
    wall = time.perf_counter() - t0
    return {"wall_s": wall, "steps": engine.totals["steps"] - steps0,
            "mixed_steps": engine.totals["mixed_steps"] - mixed0,
            "stream_max_gap_ms": 1e3 * max(gaps), "stream_mean_gap_ms": 1e3 * statistics.mean(gaps),
            "arrival_ttft_ms": 1e3 * statistics.mean(first[s] - arrived[s] for s in arrived)}


def plot(median: dict, path: Path) -> None:
    """Separate vs mixed for each mode: wall time, steps, the streams' worst gap, arrivals' TTFT."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = sorted({k.split("/")[0] for k in median})
    fields = [("wall_s", "wall s"), ("steps", "steps"), ("stream_max_gap_ms", "streams' worst gap ms"),
              ("arrival_ttft_ms", "arrivals' TTFT ms")]
    fig, axes = plt.subplots(1, len(fields), figsize=(4 * len(fields), 3.4))
    for ax, (f, label) in zip(axes, fields):
        for j, setting in enumerate(("separate", "mixed")):
            ax.bar([i + 0.4 * j for i in range(len(modes))], [median[f"{m}/{setting}"][f] for m in modes], 0.4,
                   label=setting)
        ax.set_xticks([i + 0.2 for i in range(len(modes))], modes)
        ax.set_title(label)
    axes[0].legend()
    fig.suptitle("mixed prefill on CPU: 16 decoding streams, 8 arriving 200-token prompts (medians)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--modes", default="plain,draft")
    ap.add_argument("--out", default=str(HERE / "mixed_prefill.json"))
    ap.add_argument("--plot-only", action="store_true", help="redraw the plot from --out's JSON")
    args = ap.parse_args()
    if args.plot_only:
        plot(json.loads(Path(args.out).read_text())["median"], Path(args.out).with_suffix(".png"))
        return
    torch.set_num_threads(1)
    runs: dict[str, list[dict]] = {}
    for r in range(args.reps):
        for mode in args.modes.split(","):
            for mixed in ((False, True) if r % 2 == 0 else (True, False)):
                key = f"{mode}/{'mixed' if mixed else 'separate'}"
                runs.setdefault(key, []).append(run(mixed, mode))
                print(key, json.dumps(runs[key][-1]), flush=True)
    median = {k: {f: statistics.median(x[f] for x in v) for f in v[0]} for k, v in runs.items()}
    Path(args.out).write_text(json.dumps({"median": median, "runs": runs}, indent=1))
    plot(median, Path(args.out).with_suffix(".png"))
    for k, v in median.items():
        print(k, {f: round(x, 2) for f, x in v.items()})


if __name__ == "__main__":
    main()
