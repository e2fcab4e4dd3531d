"""Rank 0 of a tensor-parallel engine in its own process, for tests that need a fresh process
group (a process holds one): `python -m tests.engine.tp_rank0 MODE TARGET DRAFT TP`.

generate: prints the greedy and seeded-sampled token ids of PROMPTS as JSON (plain decoding).
kill: starts a generation, SIGKILLs rank 1 after a few steps, and prints how rank 0's next
steps ended (the exception's type and message, and the seconds it took) as JSON.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import torch

from cluster.engine.config import EngineConfig
from cluster.engine.engine import Engine
from cluster.engine.loader import load_model
from cluster.engine.ranks import start_ranks
from cluster.engine.sampling import SamplingParams
from cluster.engine.sequence import SpecParams
from tests.engine.conftest import CharTokenizer

PROMPTS = ["def f(x):\n    return f(x)\n\ndef f(", "abcabcabcabcabc", "the quick brown fox " * 6]
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)
SAMPLED = SamplingParams(max_tokens=16, temperature=0.8, top_p=0.9, seed=5, ignore_eos=True)


def config(tp: int) -> EngineConfig:
    return EngineConfig(max_num_seqs=8, max_model_len=256, block_size=4, max_batch_tokens=64, tensor_parallel_size=tp)


def engine(target: str, tp: int, step_timeout_s: float = 120.0) -> Engine:
    cfg = config(tp)
    group = start_ranks(target, cfg, step_timeout_s) if tp > 1 else None
    return Engine(load_model(target, torch.float32, "cpu", group), CharTokenizer(), cfg)


def main(mode: str, target: str, tp: int) -> dict:
    if mode == "generate":
        e = engine(target, tp)
        try:
            greedy = [r["token_ids"] for r in e.generate(PROMPTS, GREEDY, SpecParams("off"))]
            sampled = [r["token_ids"] for r in e.generate(PROMPTS, SAMPLED, SpecParams("off"))]
            return {"greedy": greedy, "sampled": sampled, "held": list(e.kv.held())}
        finally:
            e.close()
    e = engine(target, tp, step_timeout_s=30.0)
    for p in PROMPTS:
        e.add_request(p, SamplingParams(max_tokens=200, ignore_eos=True), SpecParams("off"))
    for _ in range(3):
        e.step()
    os.kill(e.runner.group.procs[0].pid, signal.SIGKILL)
    t0 = time.perf_counter()
    try:
        while e.has_work:
            e.step()
        return {"error": None}
    except Exception as ex:  # noqa: BLE001 - the test judges what it was
        return {"error": type(ex).__name__, "message": str(ex), "seconds": time.perf_counter() - t0}
    finally:
        e.close()


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], sys.argv[2], int(sys.argv[3]))))
