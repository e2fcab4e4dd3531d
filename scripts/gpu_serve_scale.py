"""The served endpoint against the in-process engine on the same GPU: the 8B-shaped demo pair
(bf16, compile, CUDA graphs, max_num_seqs 256, colocated draft model), distinct ~600-token
code prompts, 128 greedy tokens, 2c requests at c in flight.

    bash scripts/gpu_serve_scale.sh        # on a GPU machine; writes $OUT/serve_scale.json and .png

1. In process: `run_engine` at each level (plain, and gamma 4 where SPECS says).
2. Through `spec-cluster up` (the same engine config in one Verifier replica): gRPC
   (cluster.client) and the OpenAI API over HTTP (aiohttp, SSE, as a client sees it), with the
   verifier's `running` sampled every 0.25 s (GetStats).
Each point's tokens/s, the endpoint / engine ratio, TTFT p50/p99 (HTTP: measured by the client).
LEVELS (default 64,256) and SPECS (default off) as comma lists. DEVICE=cpu runs the small
demo pair on a CPU, to try the script itself.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import threading
import time
from pathlib import Path

OUT = Path(os.environ.get("OUT", "."))
LEVELS = [int(x) for x in os.environ.get("LEVELS", "64,256").split(",")]
SPECS = os.environ.get("SPECS", "off").split(",")
NEW_TOKENS, PROMPT_TOKENS = 128, 600
CONFIG = {"models": {"target": "demo-8b-target", "draft": "demo-8b-draft", "dtype": "bfloat16", "device": "cuda"},
          "placement": "colocated",
          "engine": {"max_num_seqs": 256, "max_waiting": 1024, "max_model_len": 4096, "max_batch_tokens": 2048,
                     "prefill_chunk": 512, "compile": True, "gpu_memory_utilization": 0.8,
                     "compile_cache_dir": os.environ.get("COMPILE_CACHE", "/tmp/spec-cluster-compile")},
          "speculation": {"mode": "fixed", "gamma": 4, "gamma_max": 8},
          "router": {"max_inflight": 2048, "per_client_concurrency": 2048, "max_tokens_limit": 4096},
          "verifier": {"ray_actor_options": {"num_gpus": 1}, "max_ongoing_requests": 2048},
          "kvdir": {"url": None}}
if os.environ.get("DEVICE") == "cpu":
    CONFIG["models"].update(target="demo-target", draft="demo-draft", dtype="float32", device="cpu")
    CONFIG["engine"].update(compile=False, kv_cache_gb=1, max_num_seqs=32)
    CONFIG["verifier"]["ray_actor_options"] = {}
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


def spec_of(name: str):
    return "off" if name == "off" else int(name)


def in_process(results: dict, tok) -> None:
    from cluster.bench.load import run_engine
    from cluster.config import parse_config
    from cluster.engine.sequence import SpecParams
    from cluster.serve.build import build_engine

    engine = build_engine(parse_config(CONFIG))
    log("engine up", json.dumps({k: round(v, 1) for k, v in engine.startup.items()}))
    run_engine(engine, prompts(tok, 16, 99), 16, NEW_TOKENS, SpecParams("off"))  # warm
    for c in LEVELS:
        for s in SPECS:
            spec = SpecParams("off") if s == "off" else SpecParams("fixed", int(s))
            done, wall = run_engine(engine, prompts(tok, 2 * c, c), c, NEW_TOKENS, spec)
            tps = sum(len(r["token_ids"]) for r in done) / wall
            results.setdefault(f"{c}/{s}", {})["engine_tok_s"] = round(tps, 1)
            log(f"engine c={c} spec={s}: {tps:.0f} tok/s")
    engine.close()


async def http_point(base: str, ps: list[str], c: int, spec) -> tuple[int, float, list[float]]:
    import aiohttp

    queue, tokens, ttft = list(ps), [0], []

    async def worker(session):
        while queue:
            p = queue.pop()
            t = time.perf_counter()
            first = None
            body = {"model": CONFIG["models"]["target"], "prompt": p, "max_tokens": NEW_TOKENS, "stream": True,
                    "temperature": 0.0, "speculation": spec, "stream_options": {"include_usage": True}}
            async with session.post(f"{base}/completions", json=body) as r:
                async for line in r.content:
                    if not line.startswith(b"data: {"):
                        continue
                    chunk = json.loads(line[6:])
                    if first is None and chunk.get("choices") and chunk["choices"][0].get("text"):
                        first = time.perf_counter() - t
                    if chunk.get("usage"):
                        tokens[0] += chunk["usage"]["completion_tokens"]
            ttft.append(1e3 * (first or 0.0))

    t = time.perf_counter()
    # no connection cap: aiohttp's default of 100 held the first run's 256 streams to 100
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600),
                                     connector=aiohttp.TCPConnector(limit=0)) as session:
        await asyncio.gather(*[worker(session) for _ in range(c)])
    return tokens[0], time.perf_counter() - t, ttft


def endpoint(results: dict, tok) -> None:
    from cluster.bench.load import run_grpc
    from cluster.bench.served import served
    from cluster.client import Client

    with served(CONFIG, echo=lambda line: None) as up:
        log(f"endpoint ready in {up.ready_s:.0f} s")
        address, base = up.grpc, up.http
        run_grpc(address, None, prompts(tok, 16, 98), 16, NEW_TOKENS, "off")  # warm
        for c in LEVELS:
            for s in SPECS:
                for api in ("grpc", "http"):
                    ps = prompts(tok, 2 * c, 1000 * c + (api == "http"))
                    running, stop = [], threading.Event()

                    def watch():
                        with Client(address) as cl:
                            while not stop.is_set():
                                st = cl.stats()
                                running.append((round(time.time() - t0, 2), sum(r.running for r in st.replicas)))
                                stop.wait(0.25)

                    t0 = time.time()
                    w = threading.Thread(target=watch, daemon=True)
                    w.start()
                    if api == "grpc":
                        done, wall = run_grpc(address, None, ps, c, NEW_TOKENS, spec_of(s))
                        toks = sum(len(r["token_ids"]) for r in done)
                        ttft = [r["timing"]["ttft_ms"] for r in done]
                    else:
                        toks, wall, ttft = asyncio.run(http_point(base, ps, c, spec_of(s)))
                    stop.set()
                    w.join()
                    point = results.setdefault(f"{c}/{s}", {})
                    tps = toks / wall
                    point[f"{api}_tok_s"] = round(tps, 1)
                    point[f"{api}_over_engine"] = round(tps / point["engine_tok_s"], 3) if "engine_tok_s" in point else None
                    point[f"{api}_ttft_ms_p50"] = round(statistics.median(ttft), 1)
                    point[f"{api}_ttft_ms_p99"] = round(sorted(ttft)[int(0.99 * (len(ttft) - 1))], 1)
                    point[f"{api}_running"] = running
                    peak = max((n for _, n in running), default=0)
                    reach = next((t for t, n in running if n >= min(c, 256)), None)
                    log(f"{api} c={c} spec={s}: {tps:.0f} tok/s ({point[f'{api}_over_engine']} of the engine), "
                        f"running peak {peak}, reached {min(c, 256)} at {reach} s")


def plot(results: dict) -> None:
    from cluster.bench.report import figure

    plt = figure()
    fig, ax = plt.subplots(figsize=(7, 4))
    keys = list(results)
    for i, name in enumerate(("engine_tok_s", "grpc_tok_s", "http_tok_s")):
        ax.bar([k + i * 0.27 for k in range(len(keys))], [results[k].get(name, 0) for k in keys], 0.27,
               label=name.replace("_tok_s", ""))
    ax.set_xticks([k + 0.27 for k in range(len(keys))], [f"{k} (streams/spec)" for k in keys])
    ax.set_ylabel("tokens/s")
    ax.set_title("8B-shaped demo pair, one GPU: in process against served")
    ax.legend()
    fig.tight_layout()
    fig.savefig(OUT / "serve_scale.png", dpi=120)


def main() -> int:
    import torch

    from cluster.config import resolve_model_path
    from cluster.engine.loader import load_tokenizer

    tok = load_tokenizer(resolve_model_path("demo-target"))
    results: dict = {}
    in_process(results, tok)
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    endpoint(results, tok)
    doc = {"device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "levels": LEVELS, "specs": SPECS, "new_tokens": NEW_TOKENS,
           "prompt_tokens": PROMPT_TOKENS, "config": CONFIG, "results": results,
           "command": "bash scripts/gpu_serve_scale.sh"}
    (OUT / "serve_scale.json").write_text(json.dumps(doc, indent=1))
    plot(results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
