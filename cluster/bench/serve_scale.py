"""The served endpoint against the in-process engine on the same GPU: the 8B-shaped demo pair
(bf16, compile, CUDA graphs, max_num_seqs 256, colocated draft model), ~600-token code
prompts, 128 greedy tokens, 2c requests at c in flight (c = 1: 16 requests).

    bash scripts/gpu_serve_scale.sh        # on a GPU machine; writes $OUT/serve_scale.json and .png
    spec-cluster bench serve-scale --device cpu --levels 32 --specs off,auto --out DIR   # the small pair

1. Through `spec-cluster up` (the same engine config in one Verifier replica, its engine in
   an engine-core actor): gRPC streams and the OpenAI API's SSE streams, driven by
   cluster.bench.streams from 4 client processes, with the verifier's `running` sampled
   every 0.1 s (GetStats).
2. In process: `run_engine` at each level and speculation mode, after the endpoint has gone
   (its processes free their GPU memory when they end).
Every path and speculation setting of a level runs the same prompts; prefix caching is off.
Each point's tokens/s, the endpoint / engine ratio, TTFT, chunk gap and ITL p50/p99 (client
clocks). LEVELS (default 1,64,128,256), SPECS (default off,4,auto) and APIS (grpc,http) as
comma lists; STREAM_MS sets router.stream_interval_ms (or the same as flags); OVERRIDES, JSON,
is merged into the config. DEVICE=cpu runs
the small demo pair (max_num_seqs 32) on the CPU. ACTOR=1 runs the in-process part inside a Ray
actor of no CPUs, as the engine core runs.
"""

from __future__ import annotations

import json
import os
import threading
import time
from pathlib import Path

from cluster.bench.harness import COMPILE_CACHE, OUT

LEVELS = [int(x) for x in os.environ.get("LEVELS", "1,64,128,256").split(",")]
SPECS = os.environ.get("SPECS", "off,4,auto").split(",")
APIS = os.environ.get("APIS", "grpc,http").split(",")
NEW_TOKENS, PROMPT_TOKENS = 128, 600
CONFIG = {"models": {"target": "demo-8b-target", "draft": "demo-8b-draft", "dtype": "bfloat16", "device": "cuda"},
          "placement": "colocated",
          "engine": {"max_num_seqs": 256, "max_waiting": 1024, "max_model_len": 4096, "max_batch_tokens": 2048,
                     "prefill_chunk": 512, "compile": True, "gpu_memory_utilization": 0.8,
                     "prefix_caching": False,  # the paths run the same prompts (see seed)
                     "compile_cache_dir": COMPILE_CACHE},
          "speculation": {"mode": "goodput", "gamma": 4, "gamma_max": 8},
          "router": {"max_inflight": 2048, "per_client_concurrency": 2048, "max_tokens_limit": 4096},
          "verifier": {"ray_actor_options": {"num_gpus": 1}, "max_ongoing_requests": 2048},
          "kvdir": {"url": None}}


def merge(into: dict, over: dict) -> None:
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(into.get(k), dict):
            merge(into[k], v)
        else:
            into[k] = v


def configure(args) -> None:
    global OUT, LEVELS, SPECS, APIS
    OUT, LEVELS, SPECS, APIS = Path(args.out), args.levels, args.specs, args.apis
    OUT.mkdir(parents=True, exist_ok=True)
    if os.environ.get("OVERRIDES"):  # JSON merged into CONFIG, e.g. '{"engine": {"mixed_prefill": true}}'
        merge(CONFIG, json.loads(os.environ["OVERRIDES"]))
    if args.stream_ms is not None:
        CONFIG["router"]["stream_interval_ms"] = args.stream_ms
    if args.device == "cpu":
        CONFIG["models"].update(target="demo-target", draft="demo-draft", dtype="float32", device="cpu")
        CONFIG["engine"].update(compile=False, kv_cache_gb=1, max_num_seqs=32)
        # the engine's threads: two, as the in-process engine has on the 2-core machine
        CONFIG["verifier"]["ray_actor_options"] = {"num_cpus": 2}
COMMAND = "bash scripts/gpu_serve_scale.sh"
T0 = time.time()


def log(*a) -> None:
    print(f"[{time.time() - T0:6.1f}s]", *a, flush=True)


def prompts(tok, n: int, seed: int) -> list[str]:
    from cluster.bench.workloads import code_prompts

    out = []
    for t in code_prompts(4 * n, chars=4000, seed=seed):
        ids = tok.encode(t)
        if len(ids) >= PROMPT_TOKENS:
            out.append(tok.decode(ids[:PROMPT_TOKENS]))
        if len(out) == n:
            return out
    raise RuntimeError("not enough long prompts")


def seed(c: int) -> int:
    """The same prompts for every path and speculation setting at one level, so they compare
    on equal work: acceptance varies by prompt (at one stream gamma 4 ranged 231-313 tok/s
    over different prompt sets). No prefix is reused: the config turns prefix caching off."""
    return 1000 * c


def late() -> bool:
    """Past DEADLINE_S (default 540) from the start: the endpoint's remaining points are
    skipped (the in-process ones, a minute or two, still run: every ratio needs them)."""
    if time.time() - T0 > float(os.environ.get("DEADLINE_S", "540")):
        log("deadline passed: skipping the remaining points")
        return True
    return False


def spec_of(name: str):
    """The request's speculation as the clients name it: "off", "auto" or a gamma."""
    return name if name in ("off", "auto") else int(name)


TRACE_TO = 1  # levels up to this get a per-step trace of the in-process engine
TRACE_FIELDS = ["batch", "gamma", "drafted", "accepted", "pipelined", "verify_ms", "draft_ms", "step_ms"]


def requests_at(c: int) -> int:
    return 16 if c == 1 else 2 * c


def in_process(results: dict, tok) -> None:
    from cluster.bench.load import run_engine
    from cluster.config import parse_config
    from cluster.engine.scheduling.sequence import SpecParams
    from cluster.serve.build import build_engine

    engine = build_engine(parse_config(CONFIG))
    log("engine up", json.dumps({k: round(v, 1) for k, v in engine.startup.items()}))
    run_engine(engine, prompts(tok, 16, 99), 16, NEW_TOKENS, SpecParams("off"))  # warm
    for c in LEVELS:
        for s in SPECS:
            spec = SpecParams(s) if s in ("off", "auto") else SpecParams("fixed", int(s))
            before, t0 = engine.stats(), time.perf_counter()
            trace: list = []  # per step, at low load: what the controller saw
            if c <= TRACE_TO:
                engine.on_verify = lambda o: trace.append(  # noqa: B023 - cleared below
                    (o.batch_size, o.gamma, o.drafted, sum(o.accepted_per_position), int(o.pipelined),
                     round(1e3 * o.verify_s, 2), round(1e3 * o.draft_s, 2), round(1e3 * o.step_s, 2)))
            done, wall = run_engine(engine, prompts(tok, requests_at(c), seed(c)), c, NEW_TOKENS, spec)
            engine.on_verify = None
            tps = sum(len(r["token_ids"]) for r in done) / wall
            point = results.setdefault(f"{c}/{s}", {})
            point["engine_tok_s"] = round(tps, 1)
            after = engine.stats()
            point["engine_preemptions"] = after["preemptions"] - before["preemptions"]
            steps = after["steps"] - before["steps"]
            point["engine_core"] = {"steps": steps, "prefill_steps": after["prefill_steps"] - before["prefill_steps"],
                                    "step_ms": round(1e3 * (time.perf_counter() - t0) / max(1, steps), 2)}
            point["engine_kv_blocks"] = engine.stats()["kv_blocks_total"]
            if trace:
                point["engine_trace"] = {"fields": TRACE_FIELDS, "steps": trace}
            if s == "auto" and engine.controller is not None:
                point["engine_controller"] = engine.controller.snapshot()
            save(results)
            log(f"engine c={c} spec={s}: {tps:.0f} tok/s, {point['engine_preemptions']} preemptions, "
                f"{point['engine_core']}")
    engine.close()


def in_actor(tok) -> dict:
    """The in-process sweep inside a Ray actor of no CPUs (ACTOR=1), as the engine core runs:
    what the actor's process costs a step, apart from Serve and the sockets."""
    import ray

    ray.init(include_dashboard=False, logging_level="ERROR")

    @ray.remote(num_cpus=0, num_gpus=1 if CONFIG["models"]["device"] == "cuda" else 0)
    def sweep(tok, config: dict, out: str, levels: list, specs: list) -> dict:
        global OUT, LEVELS, SPECS
        CONFIG.clear()
        CONFIG.update(config)
        OUT, LEVELS, SPECS = Path(out), levels, specs
        results: dict = {}
        in_process(results, tok)
        return results

    try:
        return ray.get(sweep.remote(tok, CONFIG, str(OUT), LEVELS, SPECS))
    finally:
        ray.shutdown()


def endpoint(results: dict, tok) -> None:
    from cluster.bench.served import served
    from cluster.bench.streams import run_streams
    from cluster.client import Client

    with served(CONFIG, echo=lambda line: None) as up:
        log(f"endpoint ready in {up.ready_s:.0f} s")
        targets = {"grpc": up.grpc, "http": up.http}
        model = CONFIG["models"]["target"]
        run_streams("grpc", up.grpc, prompts(tok, 16, 98), 16, NEW_TOKENS, "off", model)  # warm
        for c in LEVELS:
            for s in SPECS:
                for api in APIS:
                    if late():
                        return
                    ps = prompts(tok, requests_at(c), seed(c))
                    running, held, stop, last = [], [], threading.Event(), {}
                    t0 = time.time()

                    def watch():
                        with Client(up.grpc) as cl:
                            while not stop.is_set():
                                st = cl.stats()
                                at = round(time.time() - t0, 2)
                                running.append((at, sum(r.running for r in st.replicas)))
                                held.append((at, sum(r.running + r.waiting for r in st.replicas)))
                                last.update(preemptions=sum(r.preemptions for r in st.replicas),
                                            kv_blocks=sum(r.kv_blocks_total for r in st.replicas),
                                            at=time.time(), **{k: st.metrics[k] for k in CORE if k in st.metrics})
                                stop.wait(SAMPLE_S)

                    w = threading.Thread(target=watch, daemon=True)
                    w.start()
                    while not last and w.is_alive():  # the counts before the point
                        time.sleep(0.05)
                    before = dict(last)
                    m = run_streams(api, targets[api], ps, c, NEW_TOKENS, spec_of(s), model)
                    stop.set()
                    w.join()
                    point = results.setdefault(f"{c}/{s}", {})
                    m["running"] = running
                    m["preemptions"] = last.get("preemptions", 0) - before.get("preemptions", 0)
                    m["kv_blocks"] = last.get("kv_blocks")
                    m["core"] = core_figures(before, last)
                    m["reached_s"] = next((t for t, n in running if n >= min(c, 256)), None)
                    # requests in the engine (running or waiting for their prefill): every one
                    # the clients sent has reached it
                    m["held"] = held
                    m["held_reached_s"] = next((t for t, n in held if n >= c), None)
                    # counted from when the last client process began sending (every stream's
                    # first request then out); GetStats reads a board the replica refreshes
                    # every REPORT_S, so this is an upper bound, late by up to that and a sample
                    sent = max(m.pop("sent_at")) - t0
                    m["sent_s"] = round(sent, 2)
                    m["reached_after_sent_s"] = None if m["reached_s"] is None else round(m["reached_s"] - sent, 2)
                    point[api] = m
                    save(results)
                    log(f"{api} c={c} spec={s}: {m['tok_s']:.0f} tok/s, {m['preemptions']} preemptions, core {m['core']}, "
                        f"ttft p50 {m['ttft_ms_p50']} ms (path {m['path_ms_p50']} ms), itl p50 {m['itl_ms_p50']} ms, "
                        f"{m['tokens_per_chunk']} tok/chunk, errors {m['errors']}, running reached {min(c, 256)} "
                        f"at {m['reached_s']} s, {m['reached_after_sent_s']} s after the last client began (held {c} at {m['held_reached_s']} s), "
                        f"peak {max((n for _, n in running), default=0)}")


SAMPLE_S = 0.1  # GetStats sampling period while a point runs
CORE = ("steps", "prefill_steps", "step_busy_s", "core_host_s", "step_messages", "step_lag_s")


def core_figures(before: dict, after: dict) -> dict:
    """The engine core over one point (GetStats counters, up to a report period late)."""
    d = {k: after.get(k, 0) - before.get(k, 0) for k in CORE}
    wall = after.get("at", 0) - before.get("at", 0)
    steps = d["steps"] or 1
    return {"steps": int(d["steps"]), "prefill_steps": int(d["prefill_steps"]),
            "step_ms": round(1e3 * d["step_busy_s"] / steps, 2), "host_ms": round(1e3 * d["core_host_s"] / steps, 2),
            "busy_fraction": round(d["step_busy_s"] / wall, 3) if wall > 0 else None,
            "lag_ms": round(1e3 * d["step_lag_s"] / d["step_messages"], 2) if d["step_messages"] else None}


def ratios(results: dict) -> None:
    """Each path against the engine at the same point, and auto against the better of off and
    gamma 4 through each path at every level."""
    for key, point in results.items():
        for api in APIS:
            if point.get("engine_tok_s") and api in point:
                point[api]["over_engine"] = round(point[api]["tok_s"] / point["engine_tok_s"], 3)
                log(f"{key} {api}: {point[api]['over_engine']} of the engine")
    for c in LEVELS:
        for path in ["engine"] + APIS:
            def tps(s):
                p = results.get(f"{c}/{s}", {})
                return p.get("engine_tok_s") if path == "engine" else p.get(path, {}).get("tok_s")
            if tps("auto") and tps("off") and tps("4"):
                r = round(tps("auto") / max(tps("off"), tps("4")), 3)
                results.setdefault(f"{c}/auto", {})[f"{path}_auto_over_best"] = r
                log(f"{path} c={c}: auto / best fixed {r}")


def plot(results: dict) -> None:
    from cluster.bench.report import figure

    plt = figure()
    fig, axes = plt.subplots(1, len(SPECS), figsize=(4 * len(SPECS), 3.6), squeeze=False)
    for ax, s in zip(axes[0], SPECS):
        for path in APIS:
            ax.plot(LEVELS, [(results.get(f"{c}/{s}", {}).get(path) or {}).get("over_engine") or 0 for c in LEVELS],
                    marker="o", label=path)
        ax.axhline(0.9, color="grey", ls=":", lw=1)
        ax.set_xscale("log", base=2)
        ax.set_ylim(0, 1.2)
        ax.set_title(f"speculation {s}")
        ax.set_xlabel("streams")
    axes[0][0].set_ylabel("endpoint / in-process tokens/s")
    axes[0][0].legend()
    m = CONFIG["models"]
    fig.suptitle(f"{m['target']} ({m['dtype']}, {m['device']}): served against in process")
    fig.tight_layout()
    fig.savefig(OUT / "serve_scale.png", dpi=120)


def save(results: dict) -> None:
    import torch

    doc = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "levels": LEVELS,
           "specs": SPECS, "apis": APIS, "new_tokens": NEW_TOKENS, "prompt_tokens": PROMPT_TOKENS, "config": CONFIG,
           "results": results, "command": COMMAND,
           "stream_interval_ms": CONFIG["router"].get("stream_interval_ms", "default")}
    (OUT / "serve_scale.json").write_text(json.dumps(doc, indent=1))


def main(argv: list[str] | None = None) -> int:
    import argparse

    def ints(v):
        return [int(x) for x in v.split(",")]

    ap = argparse.ArgumentParser(prog="spec-cluster bench serve-scale", description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default=os.environ.get("DEVICE", "cuda"), choices=["cuda", "cpu"])
    ap.add_argument("--levels", type=ints, default=LEVELS)
    ap.add_argument("--specs", type=lambda v: v.split(","), default=SPECS)
    ap.add_argument("--apis", type=lambda v: v.split(","), default=APIS)
    ap.add_argument("--stream-ms", type=float, default=float(os.environ["STREAM_MS"]) if os.environ.get("STREAM_MS") else None)
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args(argv)
    configure(args)
    if argv:  # from `spec-cluster bench serve-scale`; the GPU script passes none
        global COMMAND
        COMMAND = "spec-cluster bench serve-scale " + " ".join(argv)

    from cluster.config import resolve_model_path
    from cluster.engine.worker.loader import load_tokenizer

    tok = load_tokenizer(resolve_model_path("demo-target"))
    results: dict = {}
    # the endpoint first: its processes are gone when it stops, so the in-process engine then
    # gets the same free memory (an engine freed in this process leaves some behind)
    if os.environ.get("ENDPOINT", "1") != "0":
        endpoint(results, tok)
    if os.environ.get("ENGINE", "1") != "0":  # ENGINE=0: the endpoint only
        if os.environ.get("ACTOR") == "1":
            results.update(in_actor(tok))
        else:
            in_process(results, tok)
    save(results)
    ratios(results)
    save(results)
    plot(results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
