"""EAGLE-3 against the draft model at the 8B shape, batch 1, one GPU (issue 40): the demo target
in Llama-3.1-8B dimensions (demo-8b-target), its draft model (demo-8b-draft) and its trained
EAGLE-3 head in an 8B head's shape (demo-8b-eagle3, cluster/engine/drafters/eagle3_embed.py),
colocated, bf16, the fused kernels and CUDA graphs.

    bash scripts/gpu_py.sh gpu_eagle3.py                      # device: $OUT/gpu_eagle3.json (+ .png here)
    PYTHONPATH=. python3 scripts/gpu_eagle3.py --cpu-smoke    # here: the demo pair, orchestration only

For plain decoding, the draft model (demo-8b-draft, 2 layers of 256: far smaller than a real 8B
drafter), the same drafter at Llama-3.2-1B's size (demo-8b-draft-1b: its tokens, a 1B's step
time) and the EAGLE-3 chain at each gamma in GAMMAS (default 2,4,6): decode tokens/s of one stream, mean accepted length, speedup over plain and the ideal
E[N] * t_decode / (t_decode + t_draft_step) (gpu_bench.py's formula; t_draft_step timed around
the drafter's propose calls in a short run of its own), and whether the greedy tokens equal plain's (else the
target's top-2 margin at the first difference, cluster.bench.harness.agreement). Not here yet:
EAGLE-3 trees (the paged Triton kernel has no tree masks: an SDPA engine of their own). The
head in a drafter replica: scripts/gpu_eagle3_served.py.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

from cluster.bench.harness import cuda_time, decode_rate, drop_ids, dumps, log, spec_point, step_calls
from cluster.bench.workloads import code_prompts
from cluster.config import parse_config
from cluster.engine.scheduling.sequence import SpecParams
from cluster.serve.build import build_engine


def timed_proposals(drafter) -> list[float]:
    """Wall seconds of each propose call from now on, to the end of its work on the stream it
    ran on (a drafter with a stream of its own drafts beside the verify pass)."""
    times: list[float] = []
    propose = drafter.propose

    def timed(requests):
        t = time.perf_counter()
        out = propose(requests)
        if torch.cuda.is_available():
            torch.cuda.current_stream().synchronize()
        times.append(time.perf_counter() - t)
        return out

    drafter.propose = timed
    return times


def run(engine, a, R: dict) -> None:
    one = a.prompts[:1]
    decode_rate(engine, one, SpecParams("off"), new=a.warm)
    plain = decode_rate(engine, one, SpecParams("off"), new=a.new)
    ids = engine.tokenizer.encode(a.prompts[1])
    h, step = step_calls(engine, (ids * (a.ctx // max(len(ids), 1) + 1))[: a.ctx], (1,))
    t_dec = cuda_time(step[1], a.iters) if torch.cuda.is_available() else a.cpu_step_s
    engine.kv.close(h)
    R["plain"] = {**drop_ids(plain), "decode_ms": 1e3 * t_dec}
    log("plain:", R["plain"])
    for name in ("model", "model-1b", "eagle3"):
        if name not in engine.drafters:
            continue
        out = R.setdefault("by_drafter", {}).setdefault(name, {})
        for g in a.gammas:
            decode_rate(engine, one, SpecParams("fixed", g), name, new=a.warm)
            s = decode_rate(engine, one, SpecParams("fixed", g), name, new=a.new)
            times = timed_proposals(engine.drafters[name])  # a run of its own: the timing syncs
            decode_rate(engine, one, SpecParams("fixed", g), name, new=2 * a.warm)
            del engine.drafters[name].propose  # back to the class's method
            r = out[g] = spec_point(engine, one[0], s, plain, t_dec, sum(times) / max(len(times), 1))
            log(f"{name} g{g}:", r)
        best = max(out, key=lambda g: out[g]["tokens_per_s"])
        R.setdefault("best", {})[name] = {"gamma": best, **out[best]}
    R["eagle3_over_draft_model"] = R["best"]["eagle3"]["tokens_per_s"] / R["best"]["model"]["tokens_per_s"]
    if "model-1b" in R["best"]:
        R["eagle3_over_draft_model_1b"] = R["best"]["eagle3"]["tokens_per_s"] / R["best"]["model-1b"]["tokens_per_s"]
    log("best:", {k: (v["gamma"], round(v["speedup"], 2)) for k, v in R["best"].items()},
        "EAGLE-3 / draft model:", round(R["eagle3_over_draft_model"], 3),
        "EAGLE-3 / 1B-size draft model:", round(R.get("eagle3_over_draft_model_1b", 0), 3))


def plot(R: dict, png: str) -> None:
    try:
        from cluster.bench.report import figure

        plt = figure()
    except ImportError:  # the GPU image has no matplotlib: redraw here with --replot
        return
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for name, label in (("model", "draft model (demo size)"), ("model-1b", "draft model (Llama-3.2-1B size)"),
                        ("eagle3", "EAGLE-3 chain")):
        if name not in R["by_drafter"]:
            continue
        pts = R["by_drafter"][name]
        gs = sorted(pts, key=int)
        ax.plot([int(g) for g in gs], [pts[g]["speedup"] for g in gs], "o-", label=label)
    ax.axhline(1.0, color="k", ls="--", lw=0.8)
    ax.set(xlabel="gamma", ylabel="speedup over plain (batch 1)", title=f"{R['label']} ({R['device']})")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--gammas", default=os.environ.get("GAMMAS", "2,4,6"))
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--replot", metavar="JSON", help="only redraw this result file's figure beside it")
    p.add_argument("--cpu-smoke", action="store_true", help="the demo pair and head on the CPU, a few tokens")
    a = p.parse_args(argv)
    if a.replot:
        import json

        plot(json.loads(Path(a.replot).read_text()), str(Path(a.replot).with_suffix(".png")))
        return 0
    a.gammas = [int(g) for g in a.gammas.split(",")]
    cpu = a.cpu_smoke
    a.new, a.warm, a.iters, a.ctx, a.cpu_step_s = (8, 2, 2, 32, 0.01) if cpu else (128, 16, 30, 512, 0.0)
    models = ({"target": "demo-target", "draft": "demo-draft", "device": "cpu", "dtype": "float32"} if cpu else
              {"target": "demo-8b-target", "draft": "demo-8b-draft", "eagle3": "demo-8b-eagle3", "device": "cuda",
               "dtype": "bfloat16"})
    cfg = parse_config({"models": {**models, "drafter": "eagle3"}, "placement": "colocated",
                        "engine": {"max_num_seqs": 16, "max_model_len": 2048, "compile": not cpu,
                                   **({} if cpu else {"gpu_memory_utilization": 0.5})}})
    name = "gpu_eagle3" + ("_cpu_smoke" if cpu else "")
    R: dict = {"label": ("CPU smoke (orchestration, NOT a speed): " if cpu else "") + "8B shape, batch 1, colocated",
               "device": torch.cuda.get_device_name() if torch.cuda.is_available() and not cpu else "cpu",
               "command": " ".join(["python3", "scripts/gpu_eagle3.py", *(argv or sys.argv[1:])]),
               "models": cfg.models.model_dump(), "gammas": a.gammas}
    t = time.time()
    engine = build_engine(cfg)
    R["start_s"], R["startup"] = time.time() - t, engine.startup
    if not cpu:  # the demo drafter at a real 8B drafter's size (Llama-3.2-1B): its tokens, a 1B's step time
        from cluster.config import resolve_model_path
        from cluster.engine.drafters.model import ModelDrafter
        from cluster.engine.worker.loader import load_model

        d = engine.drafters["model-1b"] = ModelDrafter(load_model(resolve_model_path("demo-8b-draft-1b"), torch.bfloat16,
                                                                  "cuda"), 16, 2048)
        d.warm_up(engine.cfg.gamma_max + 1)  # as the engine warms its own drafters
        R["models"]["draft_1b"] = "demo-8b-draft-1b"
    R["head"] = {k: v for k, v in vars(engine.drafters["eagle3"].head.cfg).items() if k != "aux_layers"}
    R["head"]["aux_layers"] = list(engine.drafters["eagle3"].head.cfg.aux_layers)
    log("engine up:", R["start_s"], "head:", R["head"])
    a.prompts = code_prompts(3, seed=11)
    try:
        run(engine, a, R)
    finally:
        out = Path(a.out, name + ".json")
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(dumps(R))
        plot(R, str(out.with_suffix(".png")))
        log("wrote", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
