"""Host (Python) time of one engine step at 64-256 sequences, by phase, on CPU.

    PYTHONPATH=. python3 benchmarks/engine_cpu/host_step.py --code main=/work/main,branch=. --reps 5

The model is a tiny random Llama (2 layers, hidden 64) over the demo tokenizer's 4,096 ids,
so its pass is cheap and what is left of a step is the engine's own work: scheduling, block
tables, building the step's inputs, acceptance, stop checks, detokenizing, outputs. Every
sequence holds a 640-token code prompt (as scripts/gpu_scale.py) and decodes greedily with
`ignore_eos`; all B are prefilled first, then `--steps` steps are timed with no arrivals or
finishes (the steady state). Modes: `decode` (speculation off) and `verify` (fixed gamma 4
with the n-gram drafter); `verify_model` drafts with a one-layer draft model; a `_sampled`
suffix samples at temperature 0.7 with a seed a row, `_sampled_unseeded` without seeds.

Phases are timed by wrapping the engine's methods (exclusive time: a phase's callee that is
itself a phase counts there), so the same script times any checkout of the code: `--code
label=path,...` runs each in its own process, labels alternating over `--reps` rounds (the
machine is shared and noisy: compare medians over rounds, and only numbers of one run).
Writes host_step.json and host_step.png in --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEMO = "cluster/models/demo/target"
# phase -> (module, class or None, attribute): the first that exists in a checkout is wrapped
PHASES = {
    "schedule": [("cluster.engine.scheduling.scheduler", "Scheduler", "schedule"),
                 ("cluster.engine.engine", "Engine", "_gammas")],
    # a launch's finish (drafts left on the device, read while the verify pass runs) is "other"
    "draft": [("cluster.engine.spec.drafting", "DraftPlanner", "draft"),
              ("cluster.engine.spec.drafting", "DraftPlanner", "launch"),
              ("cluster.engine.spec.drafting", "DraftPlanner", "ask_ahead")],
    "inputs": [("cluster.engine.worker.runner", "Runner", "forward"),
               ("cluster.engine.scheduling.kv_cache", "KVCache", "sync")],
    # every eager pass, the target's and the draft model's (its chain steps are `decode`s)
    "model": [("cluster.engine.worker.runner", "Runner", "run"),
              ("cluster.engine.worker.runner", "Runner", "decode")],
    "acceptance": [("cluster.engine.engine", "Engine", "_acceptance")],
    "accept_stop": [("cluster.engine.engine", "Engine", "_accept"),
                    ("cluster.engine.engine", "Engine", "_keep_hidden")],
    "outputs": [("cluster.engine.engine", "Engine", "_output")],
}
ORDER = ["schedule", "draft", "inputs", "model", "acceptance", "accept_stop", "outputs", "other"]


class Timers:
    """Exclusive seconds per phase: time in a nested phase is taken off its caller's."""

    def __init__(self):
        self.total: dict[str, float] = {}
        self.stack: list[list] = []

    def wrap(self, phase: str, fn):
        def timed(*a, **kw):
            frame = [time.perf_counter(), 0.0]
            self.stack.append(frame)
            try:
                return fn(*a, **kw)
            finally:
                self.stack.pop()
                dt = time.perf_counter() - frame[0]
                self.total[phase] = self.total.get(phase, 0.0) + dt - frame[1]
                if self.stack:
                    self.stack[-1][1] += dt
        return timed


def install(timers: Timers) -> list[str]:
    import importlib
    import inspect

    found = []
    for phase, targets in PHASES.items():
        for mod, cls, attr in targets:
            owner = importlib.import_module(mod)
            owner = getattr(owner, cls, None) if cls else owner
            if owner is not None and hasattr(owner, attr):
                raw = inspect.getattr_static(owner, attr)
                timed = timers.wrap(phase, getattr(owner, attr))
                setattr(owner, attr, staticmethod(timed) if isinstance(raw, staticmethod) else timed)
                found.append(f"{cls}.{attr}")
    return found


def build_engine(max_seqs: int):
    import torch
    from transformers import LlamaConfig

    from cluster.engine.config import EngineConfig
    from cluster.engine.drafters.ngram import NgramDrafter
    from cluster.engine.engine import Engine
    from cluster.engine.worker.embedded import random_model
    from cluster.engine.worker.loader import load_tokenizer

    torch.manual_seed(0)
    tok = load_tokenizer(DEMO)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, intermediate_size=128, max_position_embeddings=2048,
                      tie_word_embeddings=False)
    model = random_model(cfg, "cpu", torch.float32, seed=0)
    ecfg = EngineConfig(max_num_seqs=max_seqs, max_model_len=1024, max_waiting=1024, max_batch_tokens=2048,
                        prefill_chunk=512, gamma=4, gamma_max=8)
    drafters = {"ngram": NgramDrafter()}
    try:  # verify_model: a draft model (one layer) of the same tiny size; older checkouts may lack it
        from cluster.engine.drafters.model import ModelDrafter

        dcfg = LlamaConfig(**{**cfg.to_dict(), "num_hidden_layers": 1})
        drafters["model"] = ModelDrafter(random_model(dcfg, "cpu", torch.float32, seed=1), max_seqs, 1024)
    except (ImportError, TypeError):
        pass
    return Engine(model, tok, ecfg, drafters, "ngram", identity="host-step-tiny")


def prompts(tok, n: int, seed: int, length: int = 640) -> list[list[int]]:
    from cluster.bench.workloads import code_prompts

    out: list[list[int]] = []
    while len(out) < n:
        for text in code_prompts(2 * n, chars=4000, seed=seed):
            ids = tok.encode(text)
            if len(ids) >= length:
                out.append(ids[:length])
        seed += 1000
    return out[:n]


def measure(engine, timers: Timers, batch: int, mode: str, steps: int, seed: int, prof=None) -> dict:
    from cluster.engine.sampling import SamplingParams
    from cluster.engine.scheduling.sequence import SpecParams

    spec = SpecParams("off") if mode.startswith("decode") else SpecParams("fixed", 4)
    sampled = "_sampled" in mode  # temperature 0.7, a seed a row (`_unseeded`: none)
    seeded = sampled and not mode.endswith("_unseeded")
    drafter = "model" if mode.startswith("verify_model") else None  # verify: the n-gram drafter
    ids = []
    for i, p in enumerate(prompts(engine.tokenizer, batch, seed)):
        params = SamplingParams(max_tokens=300, ignore_eos=True, **({"temperature": 0.7, "seed": i if seeded else None} if sampled else {}))
        ids.append(engine.add_request(p, params, spec, drafter))
    while engine.scheduler.waiting or not all(s.prefilled for s in engine.scheduler.running):
        engine.step()
    for _ in range(3):  # warm-up
        engine.step()
    per_step, phases = [], {k: [] for k in ORDER}
    tokens0 = engine.totals["tokens"]
    if prof is not None:
        prof.enable()
    for _ in range(steps):
        timers.total.clear()
        t = time.perf_counter()
        engine.step()
        dt = time.perf_counter() - t
        per_step.append(dt)
        for k in ORDER[:-1]:
            phases[k].append(timers.total.get(k, 0.0))
        phases["other"].append(dt - sum(timers.total.values()))
    if prof is not None:
        prof.disable()
    tokens = engine.totals["tokens"] - tokens0
    assert len(engine.scheduler.running) == batch and not engine.scheduler.waiting, "not the steady state"
    for sid in ids:
        engine.abort(sid)
    ms = lambda xs: 1e3 * statistics.median(xs)  # noqa: E731
    return {"batch": batch, "mode": mode, "steps": steps, "step_ms": ms(per_step),
            "host_ms": ms([s - m for s, m in zip(per_step, phases["model"])]),
            "tokens_per_step": tokens / steps, "phases_ms": {k: ms(v) for k, v in phases.items()}}


def worker(args) -> None:
    """One checkout (the one on sys.path): every (batch, mode) once, JSON lines on stdout."""
    import torch

    torch.set_num_threads(args.threads)
    timers = Timers()
    wrapped = install(timers)
    batches = [int(b) for b in args.batches.split(",")]
    engine = build_engine(max(batches))
    engine.detokenize = args.detokenize == "on"  # off: as the serving core runs it (cluster.serve.core)
    print(json.dumps({"wrapped": wrapped}), flush=True)
    prof = None
    if args.profile:
        import cProfile

        prof = cProfile.Profile()
    for i, b in enumerate(batches):
        for j, mode in enumerate(args.modes.split(",")):
            r = measure(engine, timers, b, mode, args.steps, seed=100 * i + j,
                        prof=prof if b == batches[-1] else None)
            print(json.dumps(r), flush=True)
    if prof is not None:
        import pstats

        pstats.Stats(prof, stream=sys.stderr).sort_stats("tottime").print_stats(35)


def run(args) -> None:
    codes = [c.split("=", 1) for c in args.code.split(",")]
    results: dict[str, list] = {label: [] for label, _ in codes}
    for rep in range(args.reps):
        for label, path in codes:
            env = {**os.environ, "PYTHONPATH": str(Path(path).resolve())}
            cmd = [sys.executable, __file__, "--worker", "--batches", args.batches, "--modes", args.modes,
                   "--steps", str(args.steps), "--threads", str(args.threads), "--detokenize", args.detokenize] + \
                (["--profile"] if args.profile else [])
            out = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=Path(path).resolve())
            if out.returncode:
                sys.exit(f"{label} failed:\n{out.stderr[-3000:]}")
            if args.profile:
                print(f"---- profile {label}\n{out.stderr[-12000:]}")
            lines = [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]
            results[label].append([r for r in lines if "batch" in r])
            for r in lines[1:]:
                print(f"rep {rep} {label:8s} B={r['batch']:3d} {r['mode']:6s} step {r['step_ms']:7.2f} ms, "
                      f"host {r['host_ms']:6.2f} ms  " +
                      " ".join(f"{k} {v:.2f}" for k, v in r["phases_ms"].items()), flush=True)
    summary = {label: summarise(runs) for label, runs in results.items()}
    from cluster.bench.report import write_json

    path = write_json(args.out, "host_step", {"batches": args.batches, "modes": args.modes, "steps": args.steps,
                                              "reps": args.reps, "detokenize": args.detokenize, "code": dict(codes), "summary": summary,
                                              "runs": results})
    plot(path, summary)


def summarise(runs: list[list[dict]]) -> list[dict]:
    """Per (batch, mode): each phase's median over rounds of each round's median, and host_ms,
    their sum without the model pass (a sum of medians: one slow phase in one step of a busy
    machine moves it less than the median of whole steps, `host_ms_step`)."""
    out = []
    for i, first in enumerate(runs[0]):
        rs = [r[i] for r in runs]
        med = lambda f: statistics.median(f(r) for r in rs)  # noqa: E731
        phases = {k: med(lambda r: r["phases_ms"][k]) for k in ORDER}  # noqa: B023
        out.append({"batch": first["batch"], "mode": first["mode"], "step_ms": med(lambda r: r["step_ms"]),
                    "host_ms": sum(v for k, v in phases.items() if k != "model"),
                    "host_ms_step": med(lambda r: r["host_ms"]),
                    "host_ms_rounds": [sum(v for k, v in r["phases_ms"].items() if k != "model") for r in rs],
                    "tokens_per_step": first["tokens_per_step"], "phases_ms": phases})
    return out


def plot(path: Path, summary: dict) -> None:
    from cluster.bench.report import figure

    plt = figure()
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.4))
    modes = sorted({r["mode"] for rs in summary.values() for r in rs})
    for label, rs in summary.items():
        for mode, style in zip(modes, ("o-", "s--")):
            pts = [r for r in rs if r["mode"] == mode]
            a.plot([r["batch"] for r in pts], [r["host_ms"] for r in pts], style, label=f"{label}, {mode}")
    batches = sorted({r["batch"] for rs in summary.values() for r in rs})
    a.set(xscale="log", yscale="log", xlabel="sequences in the step",
          ylabel="host ms per step (phases but the model pass)", title="Engine host time per step, CPU, tiny model")
    a.set_xticks(batches, [str(x) for x in batches])
    a.set_xticks([], minor=True)
    # stacked phases at the largest batch, each label and mode a bar
    bars = [(f"{label}\n{r['mode']}", r) for label, rs in summary.items() for r in rs if r["batch"] == batches[-1]]
    bottom = [0.0] * len(bars)
    for k in ORDER:
        if k == "model":
            continue
        vals = [r["phases_ms"][k] for _, r in bars]
        b.bar(range(len(bars)), vals, bottom=bottom, label=k)
        bottom = [x + y for x, y in zip(bottom, vals)]
    b.set_xticks(range(len(bars)), [n for n, _ in bars], fontsize=8)
    b.set(ylabel="ms per step", title=f"Host time by phase at {batches[-1]} sequences (model pass left out)")
    for ax in (a, b):
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=110)
    print(f"wrote {path} and {path.with_suffix('.png')}")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--code", default="branch=.", help="label=checkout,... (each run with PYTHONPATH=checkout)")
    ap.add_argument("--batches", default="64,128,256")
    ap.add_argument("--modes", default="decode,verify")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--detokenize", choices=("on", "off"), default="on",
                    help="off: text left to the consumer but where stop strings need it, as the serving core runs")
    ap.add_argument("--profile", action="store_true", help="cProfile the largest batch; top functions to stdout")
    ap.add_argument("--out", default=str(HERE))
    ap.add_argument("--replot", help="a host_step.json to summarise and plot again")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.replot:  # summary and plot again from a written JSON's rounds
        path = Path(args.replot)
        data = json.loads(path.read_text())
        data["summary"] = {label: summarise(runs) for label, runs in data["runs"].items()}
        path.write_text(json.dumps(data, indent=2))
        plot(path, data["summary"])
    else:
        worker(args) if args.worker else run(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
