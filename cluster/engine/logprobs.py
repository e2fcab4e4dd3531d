"""The target's log-probabilities of the tokens a step emits, for requests that ask.

Which distribution: the target's raw one, log_softmax of its logits before temperature,
top-p or top-k (vLLM's default, `logprobs_mode="raw_logprobs"`). For a greedy request that
is the distribution whose argmax was taken; for a sampled one it is not the processed
distribution the token was drawn from, so a sampled token can be outside the top
alternatives shown, as in vLLM.

A token accepted through speculation was drawn (Leviathan et al.) from the target's
distribution at its position, so its log-probability is read from the verify pass's logits
at that position: the same numbers plain decoding would give, up to floating-point noise
between a 1-token and a (gamma+1)-token pass. Requests that do not ask cost nothing here.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

MAX_LOGPROBS = 5  # alternatives per token, as OpenAI's completions API allows


class TokenLogprob(NamedTuple):
    token_id: int
    logprob: float                 # the target's log-probability of token_id at its position
    top: list[tuple[int, float]]   # the request's k most likely (token id, log-probability), best first


def emitted_logprobs(logits: torch.Tensor, wants: list[int | None], tokens: list[list[int]],
                     feeds: list[list[int]]) -> list[list[TokenLogprob] | None]:
    """logits [B, T, V] at each row's fed positions; wants[b]: the row's k (None: it did not
    ask); tokens[b][i], the row's i-th emitted token, was drawn at feed index feeds[b][i].
    Returns per row its tokens' TokenLogprobs, or None where it did not ask."""
    out: list[list[TokenLogprob] | None] = [None] * len(wants)
    rows = [b for b, k in enumerate(wants) if k is not None and tokens[b]]
    if not rows:
        return out
    dev = logits.device
    b_idx = torch.tensor([b for b in rows for _ in tokens[b]], device=dev)
    t_idx = torch.tensor([f for b in rows for f in feeds[b][: len(tokens[b])]], device=dev)
    ids = torch.tensor([t for b in rows for t in tokens[b]], device=dev)
    lp = logits[b_idx, t_idx].float().log_softmax(-1)  # [M, V]: only the rows that asked
    chosen = lp.gather(-1, ids[:, None]).squeeze(-1).tolist()
    k = max(wants[b] for b in rows)
    top_v, top_i = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
    top_v, top_i = top_v.tolist(), top_i.tolist()
    m = 0
    for b in rows:
        kb, row = wants[b], []
        for t in tokens[b]:
            row.append(TokenLogprob(t, chosen[m], list(zip(top_i[m][:kb], top_v[m][:kb]))))
            m += 1
        out[b] = row
    return out


def accepted_logprobs(wants: list[int | None], logits: torch.Tensor, result) -> list | None:
    """Each row's emitted tokens' log-probabilities where its request asked (`wants[b]`: its
    alternatives, None: not asked), from a verify pass's logits and its acceptance
    (cluster.engine.spec.acceptance.Accepted): token i was drawn at the feed position after
    accepted node i-1 (the root for i = 0), for chains and trees alike."""
    if all(k is None for k in wants):
        return None
    feeds = [[0] + [p + 1 for p in path] for path in result.paths]
    return emitted_logprobs(logits, wants, result.tokens, feeds)
