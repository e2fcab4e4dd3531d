"""What every benchmark script shares: its output folder, timestamped log lines, JSON results
written as they come (a run cut short keeps what it measured), GPU timers and rates, the
roofline, and the demo pair at the 8B shape. scripts/ holds thin entry points over this.

    from cluster.bench.harness import OUT, log, write_json, cuda_time
"""

from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

OUT = Path(os.environ.get("OUT", "."))  # the device tool brings back what lands here
# one compile cache for the GPU scripts of a call, so the second engine start loads, not compiles
COMPILE_CACHE = os.environ.get("COMPILE_CACHE", "/tmp/spec-cluster-compile")
DEMO = Path(__file__).resolve().parents[1] / "models" / "demo"
T0 = time.time()


def log(*a) -> None:
    """A line with the seconds since the script started."""
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def dumps(R: dict) -> str:
    """Indented JSON with each list of numbers on one line: a per-step trace row is one line,
    not nine (the traces of a full run are ~5000 rows)."""
    flat = lambda m: "[" + ", ".join(x.strip() for x in m.group(1).split(",")) + "]"  # noqa: E731
    return re.sub(r"\[\s+([-+\d.eE,\s]+?)\s+\]", flat, json.dumps(R, indent=2, default=str))


def write_json(R: dict, name: str) -> Path:
    """R as OUT/name (rewritten whole each call: call it after every part)."""
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / name
    path.write_text(dumps(R))
    return path


def cuda_time(fn, iters: int = 30) -> float:
    """Median seconds per call, timed with CUDA events."""
    import torch

    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return sorted(times)[len(times) // 2]


def copy_bandwidth() -> float:
    """Device copy bandwidth in bytes/s (read + write), the denominator of the decode ceiling."""
    import torch

    x = torch.empty(2 * 1024**3, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    return 2 * x.numel() / cuda_time(lambda: y.copy_(x), 20)


def matmul_rate() -> float:
    """bf16 matmul FLOP/s at 8192^3, the prefill side of the roofline."""
    import torch

    a = torch.randn((8192, 8192), dtype=torch.bfloat16, device="cuda")
    return 2 * 8192**3 / cuda_time(lambda: a @ a, 10)


def roofline(prompt_lens: list[int], out_lens: list[int], c: int, R: dict) -> float:
    """Output tokens per second if prefill ran at the matmul rate and every decode step read
    the weights and the live sequences' KV at copy bandwidth (c streams, plain decoding).
    R: param_count, param_bytes, kv_bytes_per_token, matmul_flops, copy_bandwidth."""
    prefill = sum(2 * R["param_count"] * p for p in prompt_lens) / R["matmul_flops"]
    steps = sum(out_lens) / c
    ctx = sum(p + o / 2 for p, o in zip(prompt_lens, out_lens)) / len(prompt_lens)
    step_bytes = R["param_bytes"] + c * ctx * R["kv_bytes_per_token"]
    return sum(out_lens) / (prefill + steps * step_bytes / R["copy_bandwidth"])


def closed_loop_roofline(prompt_lens: list[int], out_lens: list[int], c: int, R: dict) -> tuple[float, int]:
    """roofline's bound for the client that drives the sweep (cluster.bench.load.run_engine: c
    requests in flight, the next sent as one finishes, none after the last): the same prefill,
    and one decode step for the live rows at a time, each reading the weights and those rows'
    KV; a prompt's pass gives its first token. Requests of unequal lengths leave the tail
    steps part-empty, which `roofline` (c rows every step) does not count.
    Returns (output tokens/s, decode steps)."""
    prefill = sum(2 * R["param_count"] * p for p in prompt_lens) / R["matmul_flops"]
    queue, live, seconds, steps = list(zip(prompt_lens, out_lens)), [], 0.0, 0
    while queue or live:
        while queue and len(live) < c:
            p, n = queue.pop(0)
            live.append([p + 1, n - 1])  # cached tokens after the prompt's pass, tokens still to decode
        live = [r for r in live if r[1] > 0]  # a one-token request ends with its prompt's pass
        if live:
            seconds += (R["param_bytes"] + sum(r[0] for r in live) * R["kv_bytes_per_token"]) / R["copy_bandwidth"]
            steps += 1
            live = [[k + 1, n - 1] for k, n in live if n > 1]  # a finished row's place is free for the next
    return sum(out_lens) / (prefill + seconds), steps


def decode_rate(engine, prompts, spec, drafter=None, new: int = 256) -> dict:
    """Decode tokens/s (after each first token), acceptance and mean accepted length of one
    engine.generate over `prompts`, with the token ids for equality checks."""
    from cluster.engine.sampling import SamplingParams

    res = engine.generate(prompts, SamplingParams(max_tokens=new, ignore_eos=True), spec, drafter)
    toks = sum(len(r["token_ids"]) - 1 for r in res)  # after the first token: decode only
    secs = max((r["timing"]["total_ms"] - r["timing"]["ttft_ms"]) / 1e3 for r in res)
    d = sum(r["spec"]["drafted"] for r in res)
    a = sum(r["spec"]["accepted"] for r in res)
    vs = sum(r["spec"]["verify_steps"] for r in res)
    return {"tokens_per_s": toks / secs, "acceptance_rate": a / d if d else 0.0,
            "mean_accepted_len": (a + vs) / vs if vs else 1.0, "token_ids": [r["token_ids"] for r in res]}


def drop_ids(d: dict) -> dict:
    """A decode_rate result without its token ids (for the JSON)."""
    return {k: v for k, v in d.items() if k != "token_ids"}


def triton_interpreter_numpy24() -> None:
    """Triton 3.6's interpreter turns a scalar into an int by int(1-element array), which
    numpy >= 2.4 refuses (`range(K // BLOCK_K)` fails): the upstream fix
    (triton-lang/triton#9171, #9172), for kernels run on the CPU (TRITON_INTERPRET=1)."""
    from triton.runtime import interpreter

    patch = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = patched


def step_calls(engine, ctx_ids: list[int], widths) -> tuple[object, dict]:
    """A sequence holding `ctx_ids` and, per width w, a call that runs one w-token step after
    them (a decode step at 1, a gamma = w - 1 verify; CUDA-graph replays once captured). The
    steps write past the context and never advance it: each call times the same step."""
    h = engine.kv.open()
    n = len(ctx_ids)
    engine.kv.grow(h, n + max(widths))
    engine.runner.forward([h.row], [0], [ctx_ids], last_only=True)
    return h, {w: (lambda w=w: engine.runner.forward([h.row], [n], [[5] * w], last_only=False)) for w in widths}


def spec_point(engine, prompt: str, s: dict, plain: dict, t_decode: float, t_draft_step: float) -> dict:
    """A decode_rate result with speculation against plain decoding's: speedup, the ideal
    E[N] * t_decode / (t_decode + t_draft_step) and the fraction of it reached, and whether the
    greedy tokens are plain's (else where and by what margin they part: agreement)."""
    ideal = s["mean_accepted_len"] * t_decode / (t_decode + t_draft_step)
    speedup = s["tokens_per_s"] / plain["tokens_per_s"]
    r = {**drop_ids(s), "speedup": speedup, "draft_ms_per_step": 1e3 * t_draft_step, "ideal_speedup": ideal,
         "fraction_of_ideal": speedup / ideal, "same_tokens_as_plain": s["token_ids"] == plain["token_ids"]}
    if not r["same_tokens_as_plain"]:  # a near tie (the two best logits a rounding apart) or a bug
        r["agreement"] = agreement(engine, engine.tokenizer.encode(prompt), s["token_ids"][0], plain["token_ids"][0])
    return r


def agreement(engine, prompt: list[int], spec: list[int], plain: list[int]) -> dict:
    """Where greedy speculation's tokens first differ from plain decoding's, and by how much
    the target preferred plain's token there (one eager pass over the common prefix). The
    decode step (Triton GEMV, autotuned per run) and the verify pass (cuBLAS) round
    differently, so a token whose two best logits are a rounding apart can flip; a wide gap
    at the first difference would be a bug."""
    i = next((j for j, (a, b) in enumerate(zip(spec, plain)) if a != b), None)
    if i is None:
        return {"same_tokens": len(spec) == len(plain), "tokens": len(plain)}
    h, graphs = engine.kv.open(), engine.runner.graphs
    engine.runner.graphs = None
    try:
        engine.kv.grow(h, len(prompt) + i)
        logits = engine.runner.forward([h.row], [0], [prompt + plain[:i]], last_only=True)[0].float()
    finally:
        engine.runner.graphs = graphs
        engine.kv.close(h)
    top2 = logits.topk(2).values
    return {"same_tokens": False, "tokens": len(plain), "first_difference": i,
            "plain_minus_spec_logit": float(logits[plain[i]] - logits[spec[i]]),
            "top2_margin": float(top2[0] - top2[1]), "logit_scale": float(logits.abs().max())}
