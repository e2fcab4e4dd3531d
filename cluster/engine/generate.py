"""Engine.generate: run prompts to completion through the step loop (tests, benches, the CLI)."""

from __future__ import annotations

from cluster.engine.sampling import SamplingParams


def run_to_completion(engine, prompts: list, params: SamplingParams | list[SamplingParams] | None,
                      spec, drafter: str | None) -> list[dict]:
    """One dict per prompt: text, token_ids, logprobs, finish_reason, prompt_tokens, spec, timing."""
    plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
    ids = [engine.add_request(p, sp, spec, drafter) for p, sp in zip(prompts, plist)]
    results = {i: {"text": "", "token_ids": [], "logprobs": []} for i in ids}
    while engine.has_work:
        for o in engine.step():
            if o.seq_id in results:
                r = results[o.seq_id]
                r["text"] += o.text
                r["token_ids"] += o.token_ids
                r["logprobs"] += o.logprobs or []
                if o.finished:
                    r.update(finish_reason=o.finish_reason, prompt_tokens=o.num_prompt, **o.stats)
    return [results[i] for i in ids]
