"""Greedy plain-decoding steps run one step ahead on the GPU.

A decode step's host work (accepting tokens, stop checks, detokenizing, scheduling the next
step) otherwise leaves the GPU idle between graph replays: ~0.2 ms of a 6 ms step at batch 1
on an H100 (8B shape). Here each step's argmax stays on the device and feeds the next step's
graph at once, before the host reads this step's tokens, so that host work overlaps the next
step's weight streaming.

The launched-ahead step assumes every row continues. When the next step's rows turn out
different (a row finished or was aborted, a request arrived, drafts were asked for), its
result is dropped: it only wrote K/V past each row's length, which nothing reads and the
next real step overwrites. Greedy rows only: sampled rows draw from per-request CPU
generators, so their next input is not known on the device. Nothing is launched ahead from
the first plain step after a speculative one: a controller probing gamma 0 for one step
would otherwise throw away a whole forward pass each time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cluster.engine.scheduling.sequence import Sequence


@dataclass
class _Ahead:
    key: tuple          # (seq_id, table row, cache length) per row the launch assumed
    tokens: torch.Tensor  # [B] int64 on the device: that step's greedy tokens


class DecodePipeline:
    def __init__(self, graphs):
        self.graphs = graphs  # cluster.engine.worker.graphs.GraphRunner
        self.ahead: _Ahead | None = None
        self.host = graphs.capture.host(graphs.max_batch)
        self.copied = graphs.capture.event()  # this step's tokens are on the host
        self.launched = 0  # steps launched ahead
        self.hits = 0  # steps whose launch ahead was used
        self.streak = 0  # plain steps in a row
        self.hit = False

    def interrupt(self) -> None:
        """A step ran another way (drafts, sampling): drop any launch ahead."""
        self.ahead, self.streak = None, 0

    def eligible(self, seqs: list[Sequence]) -> bool:
        return self.graphs.eligible(len(seqs), 1) and all(s.params.greedy for s in seqs)

    @torch.inference_mode()
    def step(self, seqs: list[Sequence], launch_next: bool) -> list[list[int]]:
        """One greedy token per row (each row fed its last token): [[t], ...]. `launch_next`:
        start the following step now (False where a row ends here by length)."""
        b = len(seqs)
        # the scheduler grew the rows' tables for this step and the one launched ahead: the
        # replays read them on the device (Runner.forward syncs its own passes)
        self.graphs.kv.sync()
        key = tuple((s.seq_id, s.kv.row, s.num_cached) for s in seqs)
        self.hit = self.ahead is not None and self.ahead.key == key  # this step was launched ahead
        if self.hit:
            tokens, self.hits = self.ahead.tokens, self.hits + 1
        else:
            logits, _, _ = self.graphs.forward([s.kv.row for s in seqs], [s.num_cached for s in seqs],
                                            [[s.token_ids[-1]] for s in seqs])
            tokens = logits[:, 0].argmax(-1)
        self.ahead = None
        host = self.host[:b]
        host.copy_(tokens, non_blocking=True)
        self.copied.record()
        self.streak += 1
        if launch_next and self.streak > 1:  # EOS and stop strings are not known yet: a finished row drops it
            logits = self.graphs.replay_next(tokens)
            self.launched += 1
            self.ahead = _Ahead(tuple((s.seq_id, s.kv.row, s.num_cached + 1) for s in seqs),
                                logits[:, 0].argmax(-1))
        self.copied.synchronize()
        return [[t] for t in host.tolist()]
