"""The target's aux hidden states (EAGLE-3's fc input) of each sequence, kept until a drafter has them.

A target pass computes them at every position it runs; a sequence keeps those of the
positions it accepts (a prefill chunk's, the verified row's accepted prefix or tree path) in
one buffer, `Sequence.aux = (first position, [n, A] tensor)`. The next draft request carries
the buffer and a reply that read it empties it (cluster.engine.spec.drafting), so each position
crosses to the drafter once, a remote one included. A failed call, a step skipped while a
remote drafter is down and a row its replica asked to resync (`DraftOutput.unread`) leave
the buffer to be sent again; a position sent twice is skipped by the drafter.
"""

from __future__ import annotations

import torch

from cluster.engine.worker.attention import device_ints

# Positions a sequence keeps unsent at most: one decoding without drafts for a long time (its
# controller chose gamma 0) would otherwise hold every position's aux states. Past it the
# oldest are dropped, and the drafter starts its cache from the first it gets.
KEEP = 2048


def keep_aux(seq, start: int, states: torch.Tensor) -> None:
    """Add the aux states [n, A] of positions start .. start+n-1 to the sequence's buffer
    (copied: they are views of a pass's output, a CUDA graph's static buffer on a GPU)."""
    states = states.clone()
    if seq.aux is not None:
        first, buf = seq.aux
        if first <= start <= first + len(buf):  # contiguous, or a recomputation of the tail
            start, states = first, torch.cat([buf[: start - first], states])
    if len(states) > KEEP:
        start, states = start + len(states) - KEEP, states[-KEEP:]
    seq.aux = (start, states)


def accepted_rows(path: list[int]) -> list[int]:
    """Feed indices of a verify row whose target states now stand: the fed last token and the
    accepted drafts (Accepted.paths: a chain's prefix or a tree's path; draft i is feed i + 1)."""
    return [0] + [i + 1 for i in path]


def keep_hidden(seqs: list, hidden: torch.Tensor, ends: list[int] | None = None) -> list:
    """Keep the target's last hidden state at each row's last accepted token (feed index
    ends[b]; None: hidden is [B, D] already) for drafters that read it (DraftRequest.hidden)."""
    h = hidden if ends is None else hidden[torch.arange(len(seqs)), device_ints(ends, hidden.device)]
    for s, x in zip(seqs, h):
        s.hidden = (len(s.token_ids), x)
    return seqs
