"""Every GPU path once, one PASS/FAIL line each: the gate before an issue that touches
cluster/engine or cluster/serve is resolved.

    bash scripts/gpu_smoke.sh        # on a GPU machine (device tool); writes $OUT/smoke.json

A path passes when it runs, uses what it claims to (graph replays, steps launched ahead,
drafts, preemptions) and its greedy tokens are the target's own: each output token is the
argmax, up to `tol` logits, of an eager pass of the same engine over prompt + output (teacher
forcing). That holds wherever bf16 rounding makes two paths part ways at a near-tie, and a
stale block table or a wrong graph input fails it by whole logits.

PARTS (comma-separated, default all): start, 8b, e3, demo, tree, mixed, fp8, preempt, serve, tp.
e3: the demo head embedded at an 8B head's shape (demo-8b-eagle3) over demo-8b-target.
`start` alone (a second process) measures the warm start of the 8B engine. DEVICE=cpu runs
the small-model parts on a CPU (fp32, SDPA), to try the script itself.
"""

from __future__ import annotations

import gc
import json
import os
import time
import traceback
import urllib.request

import torch

from cluster.config import parse_config
from cluster.engine.sampling import SamplingParams
from cluster.engine.scheduling.sequence import SpecParams
from cluster.serve.build import build_engine
from cluster.bench.harness import COMPILE_CACHE, OUT, log

PARTS = os.environ.get("PARTS", "start,8b,e3,demo,tree,mixed,fp8,preempt,serve,tp").split(",")
RESULTS: dict[str, dict] = {}
PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n\ndef main(argv):\n", "class Stack:\n    def __init__(self",
           "for i in range(10):\n    print(", "    def __repr__(self):\n        return"]
GREEDY = SamplingParams(max_tokens=64, ignore_eos=True)
DEVICE = os.environ.get("DEVICE", "cuda")
GPU = DEVICE == "cuda"


def check(name: str, fn) -> None:
    t = time.time()
    try:
        detail = fn() or {}
        RESULTS[name] = {"status": "PASS", "s": round(time.time() - t, 1), **detail}
        print(f"PASS {name} ({time.time() - t:.1f} s) {json.dumps(detail)}", flush=True)
    except Exception as e:  # noqa: BLE001 - the smoke reports every failure and goes on
        first = (str(e).splitlines() or [type(e).__name__])[0]
        RESULTS[name] = {"status": "FAIL", "s": round(time.time() - t, 1), "error": f"{type(e).__name__}: {first}"}
        print(f"FAIL {name}: {type(e).__name__}: {first}", flush=True)
        traceback.print_exc()


def engine_for(models: dict, engine: dict | None = None, **top):
    cfg = {"models": {"dtype": "bfloat16" if GPU else "float32", "device": DEVICE, **models}, "placement": "colocated",
           "engine": {"compile": GPU, "compile_cache_dir": COMPILE_CACHE, **(engine or {})}, **top}
    return build_engine(parse_config(cfg))


def engine_8b():
    """The demo pair in Llama-3.1-8B dimensions with the Hopper config's engine shape."""
    return engine_for({"target": "demo-8b-target", "draft": "demo-8b-draft"},
                      {"max_num_seqs": 256, "max_model_len": 4096, "max_batch_tokens": 2048, "prefill_chunk": 512,
                       "gpu_memory_utilization": 0.5}, speculation={"gamma_max": 8})


def need(ok: bool, why: str) -> None:
    if not ok:
        raise AssertionError(why)


def margins(engine, prompt: list[int], out: list[int]) -> list[float]:
    """For each output token: the eager pass's top logit minus that token's logit at its position."""
    ids, kv, r = prompt + out, engine.kv, engine.runner
    h = kv.open()
    graphs, r.graphs = r.graphs, None
    try:
        kv.grow(h, len(ids) + 1)
        logits = r.forward([h.row], [0], [ids[:-1]], last_only=False)[0, len(prompt) - 1:].float()
    finally:
        r.graphs = graphs
        kv.close(h)
    top = logits.max(-1).values
    return (top - logits[torch.arange(len(out)), torch.tensor(out, device=logits.device)]).tolist()


def greedy_run(engine, prompts, spec: SpecParams, drafter: str | None = None, tol: float = 0.5,
               params: SamplingParams = GREEDY) -> dict:
    tok = engine.tokenizer
    out = engine.generate(prompts, params, spec, drafter)
    worst = 0.0
    for p, r in zip(prompts, out):
        ids = tok.encode(p) if isinstance(p, str) else p
        assert len(r["token_ids"]) == params.max_tokens, f"{len(r['token_ids'])} tokens, not {params.max_tokens}"
        worst = max(worst, max(margins(engine, ids, r["token_ids"])))
    assert worst <= tol, f"a token {worst:.2f} logits below the eager pass's argmax (tol {tol})"
    spec_d = [r["spec"] for r in out]
    return {"max_margin": round(worst, 3), "drafted": sum(s["drafted"] for s in spec_d),
            "accepted": sum(s["accepted"] for s in spec_d)}


def staggered_run(engine, prompts: list[list[int]], lengths: list[int], concurrency: int, tol: float = 0.5) -> dict:
    """Greedy plain requests kept `concurrency` in flight, each its own length: rows finish and
    arrive while steps run ahead. Every token checked as greedy_run does, and the launch-ahead
    counters: a step runs afresh only when no launch covered any of its rows."""
    p = engine.pipeline
    before = (p.hits, p.fresh, p.deferred_rows, p.dropped_rows)
    queue, live, out = list(zip(prompts, lengths)), set(), {}
    while queue or live:
        while queue and len(live) < concurrency:
            ids, n = queue.pop(0)
            sid = engine.add_request(ids, SamplingParams(max_tokens=n, ignore_eos=True), SpecParams("off"))
            live.add(sid)
            out[sid] = (ids, n, [])
        for o in engine.step():
            out[o.seq_id][2].extend(o.token_ids)
            if o.finished:
                live.discard(o.seq_id)
    worst = 0.0
    for ids, n, got in out.values():
        assert len(got) == n, f"{len(got)} tokens, not {n}"
        worst = max(worst, max(margins(engine, ids, got)))
    assert worst <= tol, f"a token {worst:.2f} logits below the eager pass's argmax (tol {tol})"
    hits, fresh, deferred, dropped = (a - b for a, b in zip((p.hits, p.fresh, p.deferred_rows, p.dropped_rows), before))
    need(deferred > 0 and dropped > 0, f"no row joined ({deferred}) or left ({dropped}) a launch")
    need(fresh <= 2, f"{fresh} steps ran afresh (the first two only, expected)")
    return {"max_margin": round(worst, 3), "hits": hits, "fresh": fresh, "deferred_rows": deferred,
            "dropped_rows": dropped}


def sync() -> None:
    if GPU:
        torch.cuda.synchronize()


def tok_s(engine, spec: SpecParams, drafter: str | None = None, n: int = 128) -> float:
    sync()
    t = time.perf_counter()
    engine.generate(PROMPTS[:1], SamplingParams(max_tokens=n, ignore_eos=True), spec, drafter)
    sync()
    return round(n / (time.perf_counter() - t), 1)


def free(engine) -> None:
    engine.close()
    del engine
    gc.collect()
    if GPU:
        torch.cuda.empty_cache()


def part_8b() -> None:
    t = time.time()
    e = engine_8b()
    RESULTS["start_8b_cold"] = {"status": "PASS", "s": round(time.time() - t, 1), "phases": e.startup}
    log("8B engine up:", json.dumps(e.startup))

    def plain():
        d = greedy_run(e, PROMPTS, SpecParams("off"))
        assert e.pipeline.hits > 0, "no step was launched ahead"
        return {**d, "launched_ahead": e.pipeline.launched, "hits": e.pipeline.hits}

    check("plain_graphs_launch_ahead", plain)

    def batch64():
        from cluster.bench.workloads import code_prompts

        prompts = [e.tokenizer.encode(t)[:200] for t in code_prompts(64, chars=2000, seed=3)]
        return greedy_run(e, prompts, SpecParams("off"), params=SamplingParams(max_tokens=32, ignore_eos=True))

    check("plain_batch_64", batch64)

    def arrivals():
        from cluster.bench.workloads import code_prompts

        prompts = [e.tokenizer.encode(t)[:200] for t in code_prompts(24, chars=2000, seed=5)]
        e.pipeline.interrupt()  # as a fresh engine: the first two decode steps launch nothing ahead
        return staggered_run(e, prompts, [16 + 8 * (i % 4) for i in range(24)], 8)

    check("plain_arrivals_launch_ahead", arrivals)

    def ragged():
        """Prompt chunks of unequal widths in one prefill pass: run as segments (Runner._forward_ragged)."""
        from cluster.bench.workloads import code_prompts

        texts = code_prompts(5, chars=4000, seed=7)
        prompts = [e.tokenizer.encode(t)[:n] for t, n in zip(texts, (700, 130, 520, 90, 300))]
        calls, seg = [], e.runner._forward_ragged
        e.runner._forward_ragged = lambda *a: calls.append(1) or seg(*a)
        try:
            d = greedy_run(e, prompts, SpecParams("off"), params=SamplingParams(max_tokens=16, ignore_eos=True))
        finally:
            del e.runner._forward_ragged
        need(bool(calls), "no prefill pass ran as segments")
        return {**d, "segmented_passes": len(calls)}

    check("ragged_prefill", ragged)
    for name, drafter, g in (("draft_model", "model", 4), ("ngram", "ngram", 4), ("early_exit", "early-exit", 3)):
        check(name, lambda d=drafter, g=g: greedy_run(e, PROMPTS, SpecParams("fixed", g), d))

    def sampled():
        """Seeded rows at temperature 0.8, plain and gamma 4 (draft model): their draws come
        from each request's generator on the device, and the same seeds give the same tokens
        twice. Prefix caching off here: a second run's prompt hits would compute the last
        prompt positions alone, whose bf16 logits differ from a whole prefill's in the last
        bits, enough to move a sampled token now and then (the draws are not at fault)."""
        from cluster.bench.workloads import code_prompts

        prompts = [e.tokenizer.encode(t)[:200] for t in code_prompts(16, chars=2000, seed=9)]
        params = [SamplingParams(max_tokens=48, temperature=0.8, seed=i, ignore_eos=True) for i in range(16)]
        sid = e.add_request(prompts[0], params[0], SpecParams("off"))
        device = str(e.seqs[sid].generator.device)
        e.abort(sid)
        need(device == str(e.kv.tables.device), f"a request's generator is on {device}")
        from cluster.engine.drafters.base import draft_uniforms

        keys, at = torch.randint(0, 2**63 - 1, (4096,)), torch.randint(0, 2**20, (4096,))
        need(torch.equal(draft_uniforms(keys.to(device), at.to(device)).cpu(), draft_uniforms(keys, at)),
             "draft draws hash differently on the GPU")  # int64 products wrap there as on the host
        out = {"generator_device": device}
        for name, spec, d in (("plain", SpecParams("off"), None), ("gamma4", SpecParams("fixed", 4), "model")):
            t = time.perf_counter()
            e.kv.pool.prefix_caching = False
            try:
                first = [r["token_ids"] for r in e.generate(prompts, params, spec, d)]
                secs = time.perf_counter() - t
                again = [r["token_ids"] for r in e.generate(prompts, params, spec, d)]
            finally:
                e.kv.pool.prefix_caching = True
            diff = [(i, next(j for j, (x, y) in enumerate(zip(a, b)) if x != y))
                    for i, (a, b) in enumerate(zip(first, again)) if a != b]
            need(not diff, f"{name}: the same seeds gave other tokens (row, first position): {diff}")
            need(all(len(x) == 48 for x in first), f"{name}: a row stopped short")
            out[f"{name}_tok_s"] = round(16 * 48 / secs, 1)
        return out

    check("sampled_seeded", sampled)

    def speed():
        return {"plain_tok_s": tok_s(e, SpecParams("off")), "gamma4_model_tok_s": tok_s(e, SpecParams("fixed", 4), "model")}

    check("batch1_speed_8b", speed)
    free(e)


def part_e3() -> None:
    if not GPU:  # the 8B shape is 32 GB in fp32
        RESULTS["eagle3_8b_chain"] = {"status": "SKIP", "why": "not a GPU"}
        print("SKIP eagle3_8b_chain: not a GPU", flush=True)
        return
    e = engine_for({"target": "demo-8b-target", "draft": None, "eagle3": "demo-8b-eagle3", "drafter": "eagle3"},
                   {"max_num_seqs": 16, "max_model_len": 2048, "gpu_memory_utilization": 0.5})
    need(e.drafters["eagle3"].head.cfg.hidden == e.runner.model.shape.hidden, "the head is not at the 8B shape")
    check("eagle3_8b_chain", lambda: eagle3_chain(e))
    free(e)


def eagle3_chain(e) -> dict:
    """The EAGLE-3 chain at gamma 4, on the head's CUDA graphs where there is a GPU."""
    d = greedy_run(e, PROMPTS, SpecParams("fixed", 4), "eagle3")
    graphs = e.drafters["eagle3"].graphs
    need(graphs is not None or not GPU, "the head has no CUDA graphs")
    return {**d, "head_graph_buckets": sorted(graphs.steps) if graphs else []}


def part_demo() -> None:
    e = engine_for({"target": "demo-target", "draft": "demo-draft"}, {"max_num_seqs": 32, "kv_cache_gb": 2})
    check("medusa", lambda: greedy_run(e, PROMPTS, SpecParams("fixed", 3), "medusa"))
    check("eagle3_chain", lambda: eagle3_chain(e))
    free(e)


def part_tree() -> None:
    from cluster.engine.drafters.eagle3 import Eagle3Drafter

    # the paged Triton kernel has no tree masks: trees verify with SDPA (eager passes)
    e = engine_for({"target": "demo-target", "draft": "demo-draft", "attention": "sdpa"}, {"max_num_seqs": 32, "kv_cache_gb": 2})
    chain = e.drafters["eagle3"]
    e.drafters["eagle3-tree"] = Eagle3Drafter(chain.head, 16, chain.max_len, tree_width=4)
    check("eagle3_tree_sdpa", lambda: greedy_run(e, PROMPTS, SpecParams("fixed", 6), "eagle3-tree"))
    free(e)


def part_engine(name: str, engine_cfg: dict, tol: float = 0.5, n: int = 5, expect=None) -> None:
    e = engine_for({"target": "demo-target", "draft": "demo-draft"}, {"max_num_seqs": 32, **engine_cfg})

    def run():
        from cluster.bench.workloads import code_prompts

        prompts = [e.tokenizer.encode(t)[:300] for t in code_prompts(n, chars=2000, seed=4)]
        d = greedy_run(e, prompts, SpecParams("fixed", 4), "model", tol, SamplingParams(max_tokens=96, ignore_eos=True))
        stats = e.stats()
        if expect:
            expect(stats)
        return {**d, "preemptions": stats["preemptions"], "mixed_steps": stats["mixed_steps"]}

    check(name, run)
    free(e)


def part_serve() -> None:
    from cluster.bench.served import served
    from cluster.client import Client

    cfg = {"models": {"target": "demo-target", "draft": "demo-draft", "dtype": "bfloat16" if GPU else "float32",
                      "device": DEVICE},
           "engine": {"max_num_seqs": 16, "kv_cache_gb": 2, "compile_cache_dir": COMPILE_CACHE},
           "placement": "colocated", "verifier": {"ray_actor_options": {"num_gpus": 1} if GPU else {}}}

    def serve():
        with served(cfg, echo=lambda line: print(line, flush=True)) as up:
            with Client(up.grpc, timeout=60) as c:
                r = c.generate("def fibonacci(n):", max_tokens=32, speculation=4)
            assert len(r.token_ids) == 32, r
            body = json.dumps({"model": "demo-target", "prompt": "import os", "max_tokens": 16}).encode()
            req = urllib.request.Request(f"{up.http}/completions", body, {"content-type": "application/json"})
            answer = json.loads(urllib.request.urlopen(req, timeout=60).read())
            assert answer["usage"]["completion_tokens"] == 16, answer
            return {"ready_s": round(up.ready_s, 1), "grpc_tokens": len(r.token_ids)}

    check("serve_grpc_and_openai", serve)


def part_tp() -> None:
    if not GPU or torch.cuda.device_count() < 2:
        RESULTS["tp2"] = {"status": "SKIP", "why": "one GPU"}
        print("SKIP tp2: one GPU", flush=True)
        return
    e = engine_for({"target": "demo-target", "draft": "demo-draft"}, {"max_num_seqs": 16, "kv_cache_gb": 2,
                                                                         "tensor_parallel_size": 2})
    check("tp2", lambda: greedy_run(e, PROMPTS, SpecParams("fixed", 4), "model"))
    free(e)


def main() -> int:
    device = torch.cuda.get_device_name() if GPU else "cpu"
    log(device, "parts:", ",".join(PARTS))
    if PARTS == ["start"]:  # a second process: the warm start
        t = time.time()
        e = engine_8b()
        RESULTS["start_8b_warm"] = {"status": "PASS", "s": round(time.time() - t, 1), "phases": e.startup}
        log("8B engine up (warm):", json.dumps(e.startup))
    steps = {"8b": part_8b, "e3": part_e3, "demo": part_demo, "tree": part_tree, "serve": part_serve, "tp": part_tp,
             "mixed": lambda: part_engine("mixed_prefill", {"mixed_prefill": True, "kv_cache_gb": 2}, n=12,
                                          expect=lambda s: need(s["mixed_steps"] > 0, "no mixed step ran")),
             "fp8": lambda: part_engine("fp8_kv", {"kv_cache_dtype": "fp8", "kv_cache_gb": 2}, tol=1.0),
             "preempt": lambda: part_engine("preemption", {"kv_cache_gb": 0.006, "max_model_len": 512}, n=16,
                                            expect=lambda s: need(s["preemptions"] > 0, "nothing was preempted"))}
    for p in PARTS:
        try:
            if p in steps:
                steps[p]()
        except Exception as e:  # noqa: BLE001 - an engine that fails to start fails its part
            RESULTS[f"{p}_engine"] = {"status": "FAIL", "error": f"{type(e).__name__}: {(str(e).splitlines() or [''])[0]}"}
            print(f"FAIL {p}_engine: {RESULTS[f'{p}_engine']['error']}", flush=True)
            traceback.print_exc()
    name = "smoke_warm.json" if PARTS == ["start"] else os.environ.get("SMOKE_JSON", "smoke.json")
    (OUT / name).write_text(json.dumps({"device": device, "results": RESULTS}, indent=1))
    bad = [k for k, v in RESULTS.items() if v["status"] == "FAIL"]
    log(f"{len(RESULTS) - len(bad)} of {len(RESULTS)} passed" + (f"; FAIL: {', '.join(bad)}" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
