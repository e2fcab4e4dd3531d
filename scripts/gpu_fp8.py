"""FP8 KV cache (`engine.kv_cache_dtype: fp8`, attention in fp8 on FA3) against the bf16 cache
on the 8B-shaped demo pair (H100/H200): accuracy and speed from one run.

    bash .device-bundle/unpack.sh; export PYTHONPATH=/tmp/site:$PWD; python3 scripts/gpu_fp8.py
    python3 scripts/gpu_fp8.py plot fp8.json        # the PNG again from the JSON

Accuracy: teacher-forced next-token distributions over held-out code (top-1 agreement and KL
against the bf16 cache), greedy output agreement, and the demo drafter's acceptance. Speed:
batch-1 decode and speculation at short context, and the step time of decode (batch 1) and
gamma-4 verify (batch 32) at 4k context, where attention's reads of the cache count.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from pathlib import Path

import torch

from cluster.bench.harness import DEMO, cuda_time, decode_rate, drop_ids, log, write_json

SMOKE = os.environ.get("SMOKE") == "1"  # the small demo pair on CPU: checks the script, not the numbers
CTX, BATCH, DEV = (256, 4, "cpu") if SMOKE else (4096, 32, "cuda")


def teacher_forced(engine, seqs: list[list[int]]) -> list[torch.Tensor]:
    """Log-probabilities [T, V] at every position of each sequence (one prefill each, on CPU)."""
    out = []
    for ids in seqs:
        h = engine.kv.open()
        try:
            engine.kv.grow(h, len(ids))
            out.append(engine.runner.forward([h.row], [0], [ids], last_only=False)[0].log_softmax(-1).cpu())
        finally:
            engine.kv.close(h)
    return out


def step_ms(engine, batch: int, width: int, ctx: int) -> float:
    """Median ms of one step (graph replay) with `ctx` tokens cached in each of `batch` slots
    (the cache's contents do not change the kernels' work)."""
    def wall(fn):
        t = time.perf_counter()
        fn()
        return time.perf_counter() - t

    handles = [engine.kv.open() for _ in range(batch)]
    for h in handles:
        engine.kv.grow(h, ctx + width)
    rows = [h.row for h in handles]
    run = lambda: engine.runner.forward(rows, [ctx] * batch, [[5] * width] * batch, last_only=False)  # noqa: E731
    try:
        return 1e3 * (wall if SMOKE else cuda_time)(run)
    finally:
        for h in handles:
            engine.kv.close(h)


def measure(kv_dtype: str, target, draft, tok, prompts, seqs) -> dict:
    from cluster.engine.config import EngineConfig
    from cluster.engine.drafters.model import ModelDrafter
    from cluster.engine.engine import Engine
    from cluster.engine.scheduling.sequence import SpecParams

    cfg = EngineConfig(max_num_seqs=BATCH, max_model_len=CTX + 64, max_batch_tokens=4096, prefill_chunk=512,
                       gamma=4, gamma_max=4, device=DEV, dtype="float32" if SMOKE else "bfloat16",
                       compile=not SMOKE, kv_cache_dtype=kv_dtype)
    drafter = ModelDrafter(draft, cfg.max_num_seqs + 2, 1024)
    t = time.time()
    engine = Engine(target, tok, cfg, {"model": drafter}, "model", identity="demo-8b")
    r = {"start_s": time.time() - t, "kv_bytes": engine.kv.k.numel() * engine.kv.k.element_size() * 2,
         "kv_bytes_per_token": 2 * target.shape.layers * target.shape.kv_heads * target.shape.head_dim
         * engine.kv.k.element_size()}
    if engine.kv.scales is not None:
        r["scales_qkv"] = engine.kv.scales.tolist()  # per layer: q, k, v
    log(kv_dtype, "engine up", r["start_s"])
    r["logprobs"] = teacher_forced(engine, seqs)
    one = prompts[:1]
    decode_rate(engine, one, SpecParams("off"), new=16)
    plain = decode_rate(engine, one, SpecParams("off"))
    decode_rate(engine, one, SpecParams("fixed", 4), "model", new=16)
    spec = decode_rate(engine, one, SpecParams("fixed", 4), "model")
    r["plain_batch1"], r["spec_g4_batch1"] = drop_ids(plain), drop_ids(spec)
    r["plain_ids"], r["spec_same_as_plain"] = plain["token_ids"][0], spec["token_ids"] == plain["token_ids"]
    many = decode_rate(engine, prompts[:BATCH // 2], SpecParams("fixed", 4), "model", new=128)
    r["spec_g4_many"] = drop_ids(many)
    log(kv_dtype, "plain", r["plain_batch1"], "spec", r["spec_g4_batch1"], "many prompts", r["spec_g4_many"])
    r["step_ms"] = {f"decode_b1_ctx{CTX}": step_ms(engine, 1, 1, CTX),
                    f"verify5_b1_ctx{CTX}": step_ms(engine, 1, 5, CTX),
                    f"decode_b{BATCH}_ctx{CTX}": step_ms(engine, BATCH, 1, CTX),
                    f"verify5_b{BATCH}_ctx{CTX}": step_ms(engine, BATCH, 5, CTX)}
    log(kv_dtype, "steps", r["step_ms"])
    del engine, drafter
    gc.collect()
    torch.cuda.empty_cache()
    return r


def compare(a: list[torch.Tensor], b: list[torch.Tensor]) -> dict:
    agree, kls = [], []
    for x, y in zip(a, b):
        agree.append((x.argmax(-1) == y.argmax(-1)).float())
        kls.append((x.exp() * (x - y)).sum(-1))  # KL(bf16 || fp8) per position
    agree, kls = torch.cat(agree), torch.cat(kls)
    return {"positions": agree.numel(), "top1_agreement": agree.mean().item(), "kl_mean": kls.mean().item(),
            "kl_p99": kls.quantile(0.99).item(), "kl_max": kls.max().item()}


def main() -> int:
    from transformers import AutoTokenizer

    from cluster.bench.workloads import code_prompts
    from cluster.engine.worker.embedded import demo_8b

    if SMOKE:
        from cluster.engine.worker.loader import load_model

        target, draft = (load_model(DEMO / n, torch.float32, "cpu") for n in ("target", "draft"))
    else:
        target, draft = demo_8b(DEMO / "target", DEMO / "draft")
    tok = AutoTokenizer.from_pretrained(DEMO / "target")
    prompts = code_prompts(64, seed=11)
    seqs = [tok.encode(p) for p in code_prompts(4 if SMOKE else 16, chars=2000, seed=21)]
    R = {"device": "cpu (smoke)" if SMOKE else torch.cuda.get_device_name(), "torch": torch.__version__,
         "model": "demo target embedded in Llama-3.1-8B dimensions (bf16), demo drafter; FA3"}
    res = {k: measure(k, target, draft, tok, prompts, seqs) for k in ("auto", "fp8")}
    R["teacher_forced"] = compare(res["auto"].pop("logprobs"), res["fp8"].pop("logprobs"))
    pa, pf = res["auto"].pop("plain_ids"), res["fp8"].pop("plain_ids")
    R["greedy_same_tokens"] = pa == pf
    R["greedy_first_difference"] = next((i for i, (x, y) in enumerate(zip(pa, pf)) if x != y), None)
    R["bf16"], R["fp8"] = res["auto"], res["fp8"]
    R["fp8_over_bf16_step"] = {k: res["fp8"]["step_ms"][k] / res["auto"]["step_ms"][k] for k in res["fp8"]["step_ms"]}
    log("teacher forced", R["teacher_forced"], "greedy first difference", R["greedy_first_difference"])
    log("fp8/bf16 step", R["fp8_over_bf16_step"])
    plot(write_json(R, "fp8.json"))
    return 0


def plot(path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    R = json.loads(Path(path).read_text())
    keys = list(R["bf16"]["step_ms"])
    fig, ax = plt.subplots(figsize=(8, 4.2))
    x = range(len(keys))
    for off, (name, lab) in zip((-0.2, 0.2), (("bf16", "bf16 KV cache"), ("fp8", "fp8 KV cache (FA3 fp8)"))):
        ax.bar([i + off for i in x], [R[name]["step_ms"][k] for k in keys], 0.4, label=lab)
    ax.set_xticks(list(x), [k.replace("_", "\n", 1) for k in keys])
    ax.set_ylabel("ms per step (CUDA graph replay)")
    tf = R["teacher_forced"]
    acc = (R["bf16"]["spec_g4_many"]["acceptance_rate"], R["fp8"]["spec_g4_many"]["acceptance_rate"])
    ax.set_title(f"{R['device']}, 8B shape: top-1 agreement {tf['top1_agreement']:.4f}, KL {tf['kl_mean']:.2g}; "
                 f"acceptance {acc[0]:.3f} bf16 / {acc[1]:.3f} fp8", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(Path(path).with_suffix(".png"), dpi=120)


if __name__ == "__main__":
    if sys.argv[1:2] == ["plot"]:
        plot(sys.argv[2])
        sys.exit(0)
    sys.exit(main())
