"""Demo-pair evaluation: held-out perplexity and greedy speculative acceptance
(see cluster.training.demo)."""


import math
import random

import torch
import torch.nn.functional as F

from cluster.training.demo_data import EOS, SEQ_LEN

# --------------------------------------------------------------------------
# evaluation
# --------------------------------------------------------------------------


@torch.no_grad()
def perplexity(model, tokens: torch.Tensor, max_chunks: int, batch: int = 32) -> tuple[float, int]:
    n_chunks = min(max_chunks, (tokens.numel() - 1) // SEQ_LEN)
    total_nll, total_n = 0.0, 0
    for i in range(0, n_chunks, batch):
        idx = torch.arange(i, min(n_chunks, i + batch), device=tokens.device)
        win = tokens[idx[:, None] * SEQ_LEN + torch.arange(SEQ_LEN + 1, device=tokens.device)[None, :]].long()
        logits = model(input_ids=win[:, :-1]).logits.float()
        nll = F.cross_entropy(logits.reshape(-1, logits.size(-1)), win[:, 1:].reshape(-1), reduction="sum")
        total_nll += nll.item()
        total_n += win[:, 1:].numel()
    return math.exp(total_nll / max(1, total_n)), total_n


@torch.no_grad()
def greedy_generate(model, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """KV-less greedy continuation of equal-length prompts: (B, P) -> (B, new_tokens)."""
    seq = prompts
    for _ in range(new_tokens):
        nxt = model(input_ids=seq).logits[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], dim=1)
    return seq[:, prompts.size(1) :]


def simulate_acceptance(matches: list[list[bool]], gamma: int) -> dict:
    """Greedy speculative decoding against a reference greedy continuation.

    ``matches[b][k]`` says whether the drafter's greedy token after
    ``prompt + ref[:k]`` equals ``ref[k]``.  With greedy drafting and greedy
    verification, a drafted token is accepted only if all earlier drafted tokens
    in the step matched, so every accepted token was proposed from a prefix of
    the reference, and the number accepted from position ``k`` is the run of
    consecutive matches from ``k``, capped at gamma.  Each verify step then
    emits one more target token (the correction, or the bonus token).
    """
    drafted = accepted = steps = 0
    for m in matches:
        pos, n = 0, len(m)
        while pos < n:
            d = min(gamma, n - pos)
            a = 0
            while a < d and m[pos + a]:
                a += 1
            drafted += d
            accepted += a
            steps += 1
            pos += a + 1
    return {
        "gamma": gamma,
        "drafted": drafted,
        "accepted": accepted,
        "verify_steps": steps,
        "acceptance_rate": round(accepted / max(1, drafted), 4),
        "mean_accepted_length": round((accepted + steps) / max(1, steps), 4),
    }


@torch.no_grad()
def explicit_spec_decode(target, draft, prompt: torch.Tensor, new_tokens: int, gamma: int, eos_id: int) -> dict:
    """Literal greedy speculative decoding (KV-less) for one prompt, as a cross-check."""
    seq = prompt[None, :]
    produced = drafted = accepted = steps = 0
    while produced < new_tokens:
        d = min(gamma, new_tokens - produced)
        prop = seq
        for _ in range(d):
            nxt = draft(input_ids=prop).logits[:, -1].argmax(-1, keepdim=True)
            prop = torch.cat([prop, nxt], dim=1)
        tgt = target(input_ids=prop).logits[0, seq.size(1) - 1 :].argmax(-1)  # d + 1 target tokens
        drafts = prop[0, seq.size(1) :]
        a = 0
        while a < d and drafts[a] == tgt[a]:
            a += 1
        out = torch.cat([drafts[:a], tgt[a : a + 1]])
        drafted += d
        accepted += a
        steps += 1
        seq = torch.cat([seq, out[None, :]], dim=1)
        produced += out.numel()
        if (out == eos_id).any():
            break
    return {"drafted": drafted, "accepted": accepted, "verify_steps": steps, "tokens": seq[0, prompt.numel() :].tolist()}


def evaluate(target, draft, tokenizer, held: torch.Tensor, device: str, seed: int, n_prompts: int, ppl_chunks: int) -> dict:
    eos_id = tokenizer.convert_tokens_to_ids(EOS)
    # Evaluate the weights as saved (bf16), computed in fp32 for stable argmaxes.
    tgt = target.to(torch.bfloat16).to(torch.float32).eval()
    drf = draft.to(torch.bfloat16).to(torch.float32).eval()
    held = held.to(device)
    report: dict = {}
    ppl_t, n_tok = perplexity(tgt, held, ppl_chunks)
    ppl_d, _ = perplexity(drf, held, ppl_chunks)
    report["heldout_tokens_for_ppl"] = n_tok
    report["target_ppl"] = round(ppl_t, 3)
    report["draft_ppl"] = round(ppl_d, 3)

    prompt_len, new_tokens = 64, 128
    n_chunks = held.numel() // SEQ_LEN
    rng = random.Random(seed + 7)
    chunk_ids = rng.sample(range(n_chunks), min(n_prompts, n_chunks))
    prompts = torch.stack([held[c * SEQ_LEN : c * SEQ_LEN + prompt_len] for c in chunk_ids]).long()
    cont = greedy_generate(tgt, prompts, new_tokens)
    seqs = torch.cat([prompts, cont], dim=1)
    d_pred = drf(input_ids=seqs).logits[:, prompt_len - 1 : -1].argmax(-1)  # draft's next token after each prefix
    match = (d_pred == cont).tolist()
    refs = cont.tolist()
    lens = []
    for b, r in enumerate(refs):
        n = r.index(eos_id) + 1 if eos_id in r else len(r)  # stop at the target's EOS
        match[b] = match[b][:n]
        lens.append(n)
    report["spec_prompts"] = len(chunk_ids)
    report["spec_prompt_len"] = prompt_len
    report["spec_max_new_tokens"] = new_tokens
    report["spec_mean_reference_len"] = round(sum(lens) / len(lens), 2)
    report["draft_top1_agreement"] = round(sum(sum(m) for m in match) / max(1, sum(lens)), 4)
    report["speculative"] = {str(g): simulate_acceptance(match, g) for g in (2, 4, 8)}

    # Cross-check the simulation against literal speculative decoding on a few prompts.
    check = []
    for b in range(min(4, len(chunk_ids))):
        ex = explicit_spec_decode(tgt, drf, prompts[b], lens[b], 4, eos_id)
        sim = simulate_acceptance([match[b]], 4)
        check.append(
            {
                "same_tokens": ex["tokens"][: lens[b]] == refs[b][: lens[b]],
                "explicit_accepted": ex["accepted"],
                "simulated_accepted": sim["accepted"],
            }
        )
    report["crosscheck_gamma4"] = check

    samples = []
    for b in range(2):
        samples.append(
            {
                "prompt": tokenizer.decode(prompts[b].tolist()),
                "continuation": tokenizer.decode(refs[b][: lens[b]]),
            }
        )
    report["samples"] = samples
    return report


