"""Does the demo pair embedded in 8B dimensions decode like the demo pair on the GPU, path by
path (SDPA eager, FA3 eager, FA3 + CUDA graphs, + Triton kernels)? Greedy tokens and acceptance.

    python3 scripts/gpu_embed_check.py     # on the GPU machine; writes $OUT/gpu_embed_check.json
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from transformers import AutoTokenizer

from cluster.bench.workloads import code_prompts
from cluster.engine.config import EngineConfig
from cluster.engine.drafters.model import ModelDrafter
from cluster.engine.engine import Engine
from cluster.engine.sampling import SamplingParams
from cluster.engine.scheduling.sequence import SpecParams
from cluster.engine.worker.embedded import demo_8b
from cluster.engine.worker.loader import load_model
from cluster.bench.harness import OUT

DEMO = Path(__file__).resolve().parents[1] / "cluster" / "models" / "demo"


def run(target, draft, tok, **kw):
    cfg = EngineConfig(max_num_seqs=4, max_model_len=512, device="cuda", dtype="bfloat16", **kw)
    eng = Engine(target, tok, cfg, {"model": ModelDrafter(draft, 6, 512)}, "model")
    prompts = code_prompts(3, seed=11)
    p = SamplingParams(max_tokens=64, ignore_eos=True)
    plain = [r["token_ids"] for r in eng.generate(prompts, p, SpecParams("off"))]
    spec = eng.generate(prompts, p, SpecParams("fixed", 4))
    acc = eng.totals["accepted"] / max(eng.totals["drafted"], 1)
    target.backend = draft.backend = None  # the next engine picks its own backend
    return plain, [r["token_ids"] for r in spec], acc, tok.decode(plain[0][:40])


def agree(a, b):
    return [next((i for i, (x, y) in enumerate(zip(r, s)) if x != y), min(len(r), len(s))) for r, s in zip(a, b)]


def main():
    tok = AutoTokenizer.from_pretrained(DEMO / "target")
    R = {}
    small_t = load_model(DEMO / "target", torch.bfloat16, "cuda")
    small_d = load_model(DEMO / "draft", torch.bfloat16, "cuda")
    ref = run(small_t, small_d, tok, attention="sdpa", cuda_graphs=False)
    R["small_sdpa"] = {"acceptance": ref[2], "text": ref[3]}
    print("small", R["small_sdpa"], flush=True)
    big_t, big_d = demo_8b(DEMO / "target", DEMO / "draft")
    for name, kw in (("big_sdpa", dict(attention="sdpa", cuda_graphs=False)),
                     ("big_fa3", dict(attention="fa3", cuda_graphs=False)),
                     ("big_fa3_graphs", dict(attention="fa3")),
                     ("big_fa3_graphs_compiled", dict(attention="fa3", compile=True))):
        out = run(big_t, big_d, tok, **kw)
        R[name] = {"acceptance": out[2], "text": out[3], "plain_agrees_with_small_for": agree(out[0], ref[0]),
                   "spec_agrees_with_plain_for": agree(out[1], out[0])}
        print(name, R[name], flush=True)
    with open(os.path.join(OUT, "gpu_embed_check.json"), "w") as f:
        json.dump(R, f, indent=2)


if __name__ == "__main__":
    main()
