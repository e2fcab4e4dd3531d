"""Streaming load as clients see it: c concurrent streams over gRPC (GenerateStream) or the
OpenAI API (SSE), spread over several client processes so that the client's own GIL is not
what is measured. Each request records its tokens, its time to first token and the gaps
between the chunks it received (client clocks).

    run_streams("grpc", "127.0.0.1:50051", prompts, concurrency=64, max_tokens=128, spec="off")
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import statistics
import time

PROCS = 4  # client processes; each drives its share of the streams from one event loop


async def _grpc_one(stub, prompt: str, max_tokens: int, spec) -> dict:
    from cluster.client import build_request

    t, first, last, gaps, tokens, engine_ttft = time.perf_counter(), None, None, [], 0, None
    async for chunk in stub.GenerateStream(build_request(prompt, max_tokens=max_tokens, temperature=0.0,
                                                         speculation=spec)):
        now = time.perf_counter()
        if chunk.token_ids:
            if first is None:
                first = now - t
            elif last is not None:
                gaps.append((1e3 * (now - last), len(chunk.token_ids)))
            last = now
            tokens += len(chunk.token_ids)
        if chunk.final:
            engine_ttft = chunk.timing.ttft_ms
    # the client's TTFT less the engine's (from the request's arrival in the engine): the way in
    # and the first token's way out, through proxy, router and verifier
    return {"tokens": tokens, "ttft_ms": 1e3 * (first or 0.0), "gaps": gaps,
            "path_ms": None if engine_ttft is None or first is None else 1e3 * first - engine_ttft}


async def _http_one(session, base: str, model: str, prompt: str, max_tokens: int, spec) -> dict:
    t, first, last, gaps, tokens = time.perf_counter(), None, None, [], 0
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0.0,
            "stream_options": {"include_usage": True}}
    if spec is not None:
        body["speculation"] = spec
    async with session.post(f"{base}/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.content:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            now = time.perf_counter()
            if chunk.get("choices") and chunk["choices"][0].get("text"):
                if first is None:
                    first = now - t
                elif last is not None:
                    gaps.append((1e3 * (now - last), 0))  # tokens a chunk: not in the SSE
                last = now
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return {"tokens": tokens, "ttft_ms": 1e3 * (first or 0.0), "gaps": gaps}


async def _drive(api: str, target: str, model: str, prompts: list[str], concurrency: int, max_tokens: int, spec):
    queue, records, errors = list(prompts), [], [0]

    async def worker(one):
        while queue:
            p = queue.pop()
            try:
                records.append(await one(p))
            except Exception:  # noqa: BLE001 - counted; the point reports its errors
                errors[0] += 1

    if api == "grpc":
        import grpc

        from cluster.proto import generation_pb2_grpc as pb_grpc

        async with grpc.aio.insecure_channel(target) as channel:
            stub = pb_grpc.GenerationStub(channel)
            start = time.time()
            await asyncio.gather(*[worker(lambda p: _grpc_one(stub, p, max_tokens, spec))
                                   for _ in range(concurrency)])
    else:
        import aiohttp

        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800),
                                         connector=aiohttp.TCPConnector(limit=0)) as session:
            start = time.time()
            await asyncio.gather(*[worker(lambda p: _http_one(session, target, model, p, max_tokens, spec))
                                   for _ in range(concurrency)])
    return {"start": start, "end": time.time(), "records": records, "errors": errors[0]}


def _proc(args) -> dict:
    return asyncio.run(_drive(*args))


def _pct(xs: list[float], q: float) -> float:
    return round(sorted(xs)[int(q * (len(xs) - 1))], 1) if xs else 0.0


def run_streams(api: str, target: str, prompts: list[str], concurrency: int, max_tokens: int, spec=None,
                model: str = "", procs: int = PROCS) -> dict:
    """One point: every prompt streamed, `concurrency` at a time. `target`: host:port for
    gRPC, the API's base URL (ending /v1) for HTTP. `spec`: "off", "auto", a gamma, or None."""
    n = max(1, min(procs, concurrency))
    shares = [(api, target, model, prompts[i::n], len(range(i, concurrency, n)), max_tokens, spec) for i in range(n)]
    with mp.get_context("spawn").Pool(n) as pool:
        parts = pool.map(_proc, shares)
    records = [r for p in parts for r in p["records"]]
    wall = max(p["end"] for p in parts) - min(p["start"] for p in parts)
    tokens = sum(r["tokens"] for r in records)
    gaps = [g for r in records for g, _ in r["gaps"]]
    itl = [g / k for r in records for g, k in r["gaps"] if k]
    chunks = sum(len(r["gaps"]) + 1 for r in records if r["tokens"])
    ttft = [r["ttft_ms"] for r in records]
    path = [r["path_ms"] for r in records if r.get("path_ms") is not None]
    return {"tok_s": round(tokens / wall, 1), "tokens": tokens, "wall_s": round(wall, 2),
            "requests": len(records), "errors": sum(p["errors"] for p in parts),
            # wall clock (time.time) when each client process began sending: the last of them
            # is when every stream's first request had gone out
            "sent_at": [p["start"] for p in parts],
            "ttft_ms_p50": round(statistics.median(ttft), 1) if ttft else 0.0, "ttft_ms_p99": _pct(ttft, 0.99),
            "gap_ms_p50": _pct(gaps, 0.5), "gap_ms_p99": _pct(gaps, 0.99),
            # gRPC chunks name their tokens; an SSE chunk does not (None: not measured)
            "itl_ms_p50": _pct(itl, 0.5) if itl else None, "itl_ms_p99": _pct(itl, 0.99) if itl else None,
            "tokens_per_chunk": round(tokens / chunks, 2) if chunks else 0.0,
            # gRPC: client TTFT less the engine's own (None over HTTP: SSE chunks carry no timing)
            "path_ms_p50": _pct(path, 0.5) if path else None, "path_ms_p99": _pct(path, 0.99) if path else None,
            # the engine's TTFT starts when its core takes the request: no request took longer
            # than this to reach the engine from its client's send
            "path_ms_max": round(max(path), 1) if path else None}
