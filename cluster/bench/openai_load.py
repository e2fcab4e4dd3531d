"""The load sweep's client for the OpenAI-compatible HTTP endpoint (`bench load --api openai`):
streamed /v1/completions through the official `openai` async client, `concurrency` requests
in flight, timings taken from the SSE stream as a client sees them.

TTFT: request sent to the first chunk with text. ITL: the gaps between chunks with text, as
vLLM's serving benchmark measures them; a chunk carries every token of one verify step, so
with speculation one gap covers several tokens (TPOT, (end - first) / (tokens - 1), is the
per-token figure). Tokens come from the final usage chunk (`stream_options.include_usage`),
speculation counts from the last chunk's `spec`.
"""

from __future__ import annotations

import asyncio
import time


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


async def _one(client, model: str, prompt: str, max_tokens: int, speculation) -> dict:
    t0 = time.perf_counter()
    first = last = None
    gaps, tokens, spec = [], 0, {}
    stream = await client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, stream=True,
                                             stream_options={"include_usage": True},
                                             extra_body={"speculation": speculation})
    async for chunk in stream:
        now = time.perf_counter()
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        for choice in chunk.choices:
            if choice.text:
                if first is None:
                    first = now
                else:
                    gaps.append(1e3 * (now - last))
                last = now
            spec = (choice.model_extra or {}).get("spec") or spec
    end = last or time.perf_counter()
    first = first or end
    accepted = spec.get("accepted", 0)
    # each verify step after the first token emits its accepted drafts + 1 (a stop can cut one short)
    steps = max(0, tokens - 1 - accepted)
    return {"token_ids": [0] * tokens,  # summarise counts them; the ids stay on the server
            "spec": {"drafted": spec.get("drafted", 0), "accepted": accepted, "verify_steps": steps},
            "timing": {"ttft_ms": 1e3 * (first - t0), "itl_ms_p50": _pct(gaps, 0.5), "itl_ms_p99": _pct(gaps, 0.99),
                       "tpot_ms": 1e3 * (end - first) / (tokens - 1) if tokens > 1 else 0.0,
                       "total_ms": 1e3 * (end - t0)}}


async def _sweep(base_url: str, api_key: str, model: str | None, prompts, concurrency: int, max_tokens: int,
                 speculation) -> tuple[list[dict], float]:
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=600) as client:
        if model is None:
            model = (await client.models.list()).data[0].id
        queue = [p if isinstance(p, str) else " ".join(map(str, p)) for p in prompts]
        done: list[dict] = []

        async def worker():
            while queue:
                done.append(await _one(client, model, queue.pop(0), max_tokens, speculation))

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return done, time.perf_counter() - t0


def run_openai(base_url: str, api_key: str, model: str | None, prompts, concurrency: int, max_tokens: int,
               speculation) -> tuple[list[dict], float]:
    """Every prompt once, `concurrency` at a time; (per-request results, wall seconds)."""
    return asyncio.run(_sweep(base_url, api_key, model, prompts, concurrency, max_tokens, speculation))
