"""Engine.generate: run prompts to completion through the step loop (tests, benches, the CLI);
Engine.from_pretrained: an engine from model directories."""

from __future__ import annotations

from pathlib import Path

from cluster.engine.sampling import SamplingParams


def from_pretrained(engine_cls, target: str | Path, draft: str | Path | None, drafter: str | None, cfg):
    from cluster.engine.distributed.ranks import start_ranks
    from cluster.engine.drafters.model import ModelDrafter
    from cluster.engine.drafters.ngram import NgramDrafter
    from cluster.engine.worker.loader import DTYPES, load_model, load_tokenizer

    dtype = DTYPES[cfg.dtype]
    group = start_ranks(str(target), cfg) if cfg.tensor_parallel_size > 1 else None
    model = load_model(target, dtype, cfg.device if group is None else group.device, group)
    drafters = {"ngram": NgramDrafter()}
    if draft is not None:
        dm = load_model(draft, dtype, cfg.device)
        if dm.shape.vocab_size != model.shape.vocab_size:
            raise ValueError(f"draft vocab {dm.shape.vocab_size} != target vocab {model.shape.vocab_size}")
        drafters["model"] = ModelDrafter(dm, cfg.max_num_seqs * 2, cfg.max_model_len, own_stream=cfg.draft_stream)
    if drafter is not None and drafter not in drafters:
        raise ValueError(f"unknown drafter {drafter!r} (available: {', '.join(drafters)})")
    return engine_cls(model, load_tokenizer(target), cfg, drafters, drafter, identity=str(Path(target).resolve().name))


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
