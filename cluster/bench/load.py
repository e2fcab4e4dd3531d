"""`spec-cluster bench load`: a workload at a sweep of concurrency levels, in-process,
through a running cluster's gRPC endpoint, or through its OpenAI-compatible HTTP endpoint,
with an optional Hugging Face baseline.

    spec-cluster bench load --workload code --concurrency 1,4,16 --speculation auto
    spec-cluster bench load --address localhost:9000 --workload shared-prefix
    spec-cluster bench load --api openai --base-url http://localhost:8000/v1 --concurrency 1,8,32
    spec-cluster bench load --workload trace:requests.jsonl --mask --baseline hf

Per point: tokens/s, TTFT and inter-token latency p50/p99, acceptance, mean accepted length.
gRPC points take TTFT/ITL from the server's per-request timing; OpenAI points measure them
on the SSE stream, as a client sees them (cluster/bench/openai_load.py), and add TPOT.
Output: JSON and a PNG in --out.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import threading
import time
from pathlib import Path

from tqdm.auto import tqdm

from cluster.bench.report import figure, write_json
from cluster.bench.workloads import code_prompts, random_token_prompts, shared_prefix_prompts


def load_workload(spec: str, n: int, mask: bool, tokenizer=None) -> list[str | list[int]]:
    if spec == "code":
        return code_prompts(n, seed=7)
    if spec == "shared-prefix":
        return [p for _, p in shared_prefix_prompts(4, max(1, n // 4), seed=7)]
    if spec == "random":
        return random_token_prompts(n, 128, 4000, seed=7)
    if spec.startswith("trace:"):
        rows = [json.loads(line) for line in Path(spec[6:]).read_text().splitlines() if line.strip()]
        prompts = [r.get("prompt") or r.get("text") or "" for r in rows][:n]
        if mask:  # keep each prompt's length and shape, not its words
            rng = random.Random(0)
            prompts = ["".join(c if c.isspace() else rng.choice("abcdefghijklmnopqrstuvwxyz") for c in p)
                       for p in prompts]
        return prompts
    raise ValueError(f"unknown workload {spec!r} (code, shared-prefix, random, trace:FILE)")


def _pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


def summarise(results: list[dict], wall: float) -> dict:
    toks = sum(len(r["token_ids"]) for r in results)
    drafted = sum(r["spec"]["drafted"] for r in results)
    accepted = sum(r["spec"]["accepted"] for r in results)
    steps = sum(r["spec"]["verify_steps"] for r in results)
    return {"requests": len(results), "tokens_per_s": toks / wall,
            "ttft_ms_p50": _pct([r["timing"]["ttft_ms"] for r in results], 0.5),
            "ttft_ms_p99": _pct([r["timing"]["ttft_ms"] for r in results], 0.99),
            "itl_ms_p50": statistics.median([r["timing"]["itl_ms_p50"] for r in results]),
            "itl_ms_p99": _pct([r["timing"]["itl_ms_p99"] for r in results], 0.99),
            "acceptance_rate": accepted / drafted if drafted else 0.0,
            "mean_accepted_len": (accepted + steps) / steps if steps else 1.0,
            **({"tpot_ms_p50": _pct([r["timing"]["tpot_ms"] for r in results], 0.5)}
               if results and "tpot_ms" in results[0]["timing"] else {})}


def run_engine(engine, prompts, concurrency: int, max_tokens: int | list[int], spec,
               temperature: float = 0.0) -> tuple[list[dict], float]:
    """Keep `concurrency` requests in flight until every prompt is done; `max_tokens`: one
    for all, or one per prompt; greedy, or sampled at `temperature`."""
    from cluster.engine.sampling import SamplingParams

    lengths = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
    queue, live, done = list(zip(prompts, lengths, strict=True)), {}, []
    t0 = time.perf_counter()
    while queue or live:
        while queue and len(live) < concurrency:
            p, n = queue.pop(0)
            sid = engine.add_request(p, SamplingParams(max_tokens=n, ignore_eos=True, temperature=temperature), spec)
            live[sid] = {"token_ids": []}
        for o in engine.step():
            if o.seq_id in live:
                live[o.seq_id]["token_ids"] += o.token_ids
                if o.finished:
                    done.append({**live.pop(o.seq_id), **o.stats})
    return done, time.perf_counter() - t0


def run_grpc(address: str, application: str | None, prompts, concurrency: int, max_tokens: int, speculation,
             logprobs: int | None = None):
    """Keep `concurrency` gRPC requests in flight until every prompt is answered (with each
    token's log-probability and `logprobs` alternatives where set): (replies, wall seconds)."""
    from google.protobuf.json_format import MessageToDict

    from cluster.client import Client

    queue, done, lock = list(enumerate(prompts)), [], threading.Lock()

    def worker():
        with Client(address, application=application) as c:
            while True:
                with lock:
                    if not queue:
                        return
                    i, p = queue.pop(0)
                r = c.generate(p if isinstance(p, str) else " ".join(map(str, p)), max_tokens=max_tokens,
                               speculation=speculation, logprobs=logprobs)
                d = MessageToDict(r, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
                for k in ("drafted", "accepted", "verify_steps"):  # int64: JSON mapping gives strings
                    d["spec"][k] = int(d["spec"][k])
                d["prompt_index"] = i  # replies come in finishing order
                with lock:
                    done.append(d)

    t0 = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return done, time.perf_counter() - t0


def hf_baseline(target: str, draft: str | None, prompts, max_tokens: int) -> dict:
    """Hugging Face generate (and assisted generation with the draft model), single stream."""
    import torch
    from transformers import AutoModelForCausalLM

    from cluster.engine.worker.loader import load_tokenizer

    tok = load_tokenizer(target)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    model = AutoModelForCausalLM.from_pretrained(target, dtype=dtype).to(dev).eval()
    assistant = AutoModelForCausalLM.from_pretrained(draft, dtype=dtype).to(dev).eval() if draft else None
    out = {}
    for name, kw in (("hf_generate", {}), ("hf_assisted", {"assistant_model": assistant})):
        if name == "hf_assisted" and assistant is None:
            continue
        toks, t0 = 0, time.perf_counter()
        for p in prompts:
            ids = tok(p, return_tensors="pt").input_ids.to(dev) if isinstance(p, str) else torch.tensor([p], device=dev)
            g = model.generate(ids, max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, **kw)
            toks += g.shape[1] - ids.shape[1]
        out[name] = {"tokens_per_s": toks / (time.perf_counter() - t0)}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="spec-cluster bench load", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", default="code")
    ap.add_argument("--mask", action="store_true", help="mask a trace's text (keep lengths)")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--concurrency", default="1,2,4,8")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--speculation", default="auto", help="off | auto | K")
    ap.add_argument("--api", choices=["grpc", "openai"], default="grpc",
                    help="how to reach a running cluster: gRPC (--address) or the OpenAI API (--base-url)")
    ap.add_argument("--address", help="gRPC address of a running cluster, host[:port] (default: in-process engine)")
    ap.add_argument("--port", type=int, help="gRPC port of a running cluster (with --address's host, or localhost)")
    ap.add_argument("--application")
    ap.add_argument("--base-url", help="OpenAI API base URL, e.g. http://localhost:8000/v1")
    ap.add_argument("--api-key", default="unused", help="OpenAI API key (Bearer), where router.api_keys are set")
    ap.add_argument("--model", help="model name for the OpenAI API (default: the first of /v1/models)")
    ap.add_argument("--config", help="cluster YAML for the in-process engine")
    ap.add_argument("--baseline", choices=["hf"], help="also run Hugging Face generate on the same model")
    ap.add_argument("--out", default="benchmarks/load")
    args = ap.parse_args(argv)
    if args.api == "openai" and not args.base_url:
        ap.error("--api openai needs --base-url")
    if args.address or args.port:
        from cluster.client import server_address

        args.address = server_address(args.address, args.port)
    remote = args.address or args.api == "openai"
    spec_arg = args.speculation if args.speculation in ("off", "auto") else int(args.speculation)
    prompts = load_workload(args.workload, args.requests, args.mask)
    levels = [int(c) for c in args.concurrency.split(",")]
    points, engine, cfg = [], None, None
    if not remote:
        from cluster.config import load_config, resolve_model_path
        from cluster.engine.scheduling.sequence import SpecParams
        from cluster.serve.build import build_engine

        cfg = load_config(args.config)
        engine = build_engine(cfg)
        spec = SpecParams("fixed", spec_arg) if isinstance(spec_arg, int) else SpecParams(spec_arg)
        run_engine(engine, prompts[:1], 1, 8, spec)  # warm-up
    for c in tqdm(levels, desc=f"bench load ({args.workload})"):
        if engine is not None:
            res, wall = run_engine(engine, prompts, c, args.max_tokens, spec)
        elif args.api == "openai":
            from cluster.bench.openai_load import run_openai

            res, wall = run_openai(args.base_url, args.api_key, args.model, prompts, c, args.max_tokens, spec_arg)
        else:
            res, wall = run_grpc(args.address, args.application, prompts, c, args.max_tokens, spec_arg)
        points.append({"concurrency": c, **summarise(res, wall)})
        tqdm.write(json.dumps(points[-1]))
    data = {"workload": args.workload, "speculation": args.speculation, "max_tokens": args.max_tokens,
            "mode": args.api if remote else "engine", "points": points}
    if args.baseline == "hf" and cfg is not None:
        data["baseline"] = hf_baseline(resolve_model_path(cfg.models.target),
                                       resolve_model_path(cfg.models.draft) if cfg.models.draft else None,
                                       prompts[:4], args.max_tokens)
        ours = points[0]["tokens_per_s"] if points[0]["concurrency"] == 1 else None
        if ours:
            data["baseline"]["ratio_vs_hf_generate"] = ours / data["baseline"]["hf_generate"]["tokens_per_s"]
    path = write_json(args.out, f"load_{args.workload.split(':')[0]}", data)
    plt = figure()
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    cs = [p["concurrency"] for p in points]
    a.plot(cs, [p["tokens_per_s"] for p in points], "o-", label=f"spec-cluster ({args.speculation})")
    for name, v in (data.get("baseline") or {}).items():
        if isinstance(v, dict):
            a.axhline(v["tokens_per_s"], ls="--", color="gray" if name == "hf_generate" else "tab:red", label=name)
    a.set(xlabel="concurrency", ylabel="tokens/s", title=f"{args.workload} workload")
    a.legend()
    b.plot(cs, [p["ttft_ms_p50"] for p in points], "o-", label="TTFT p50")
    b.plot(cs, [p["itl_ms_p50"] for p in points], "s-", label="ITL p50")
    b.plot(cs, [p["itl_ms_p99"] for p in points], "s--", label="ITL p99")
    b.set(xlabel="concurrency", ylabel="ms", yscale="log", title="latency")
    b.legend()
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=110)
    print(f"wrote {path} and {path.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
