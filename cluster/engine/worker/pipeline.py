"""Plain-decoding steps run one step ahead on the GPU.

A decode step's host work (accepting tokens, stop checks, detokenizing, scheduling the next
step) otherwise leaves the GPU idle between graph replays. Here each step's tokens are drawn
on the device (the argmax, or for a sampled row an exponential race: `cluster.engine.sampling.draw`)
and feed the next step's graph at once, before the host reads this step's tokens, so that
host work overlaps the next step's weight streaming (SGLang's overlap scheduler and vLLM's
async scheduling do the same: the next batch's input ids are this batch's sampled ids,
resolved on the device).

The launched-ahead step assumes every row continues. The next step uses it for the rows it
covered whatever else changed:
- a row that finished here (EOS, a stop string, its length) or was aborted is not scheduled
  again, and its launched result is dropped: it only wrote the K/V of the row's own last
  token, in a position the scheduler kept for it, which nothing reads once the row is freed
  (the next pass that reuses the blocks runs after it on the same stream);
- a row that joined after the launch (its prompt prefilled meanwhile) waits one step and joins
  the next launch with its first token from the host: a launch is never thrown away for it.
Only a step none of whose rows the launch covered runs afresh. A seeded row's launch drew
from its generator; where that draw is dropped (the row preempted, or the next step run
another way) the generator is set back, so a seed gives the tokens of plain stepping whatever
the pipeline did (an unseeded row's dropped draw is simply not used). Nothing is launched
ahead from the first plain step after a speculative one: a controller probing gamma 0 for one
step would otherwise throw away a whole forward pass each time.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cluster.engine.sampling import draw
from cluster.engine.scheduling.sequence import Sequence
from cluster.engine.worker.attention import device_ints


def launch_key(seq: Sequence, ahead: int = 0) -> tuple:
    """What a row must still be for a step launched ahead to serve it (this pipeline's and
    cluster.engine.spec.ahead's): its table row, its cache length after `ahead` more tokens,
    and its preemptions (a row recomputed into new blocks may come back at the same table row
    and length, without the K/V the launch wrote)."""
    return seq.seq_id, seq.kv.row, seq.num_cached + ahead, seq.stats.preemptions


@dataclass
class _Ahead:
    index: dict[tuple, int]  # (seq_id, table row, cache length) the launch assumed -> its row
    tokens: torch.Tensor  # [B] int64 on the device: that step's drawn tokens
    # seeded sampled rows: their generator and its state before the launch drew for them
    states: dict[tuple, tuple[torch.Generator, torch.Tensor]]


def _draw(logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
    return draw(logits, [s.params for s in seqs], [s.generator for s in seqs])


class DecodePipeline:
    def __init__(self, graphs):
        # cluster.engine.worker.graphs.GraphRunner, or under tensor parallelism rank 0's
        # AnnouncedGraphs (cluster.engine.distributed.ranks): the same calls, each sent to the followers
        self.graphs = graphs
        self.ahead: _Ahead | None = None
        self.host = graphs.capture.host(graphs.max_batch)
        self.copied = graphs.capture.event()  # this step's tokens are on the host
        self.launched = 0  # steps launched ahead
        self.hits = 0  # steps that used a launch ahead
        self.fresh = 0  # steps run afresh (no row of theirs was launched)
        self.dropped_rows = 0  # launched rows no step used (finished, aborted, preempted)
        self.deferred_rows = 0  # rows that waited a step for the next launch
        self.streak = 0  # plain steps in a row

    def interrupt(self) -> None:
        """A step ran another way (drafts, logprobs): drop any launch ahead."""
        if self.ahead is not None:
            self._drop(self.ahead, self.ahead.index)
        self.ahead, self.streak = None, 0

    def _drop(self, ahead: _Ahead, keys) -> None:
        """Launched rows no step will use: a sampled row's generator goes back to before the
        launch drew for it, so its next token is drawn from the numbers it would have had
        without the launch (a preempted row resumes; a finished one is gone either way)."""
        for key in keys:
            self.dropped_rows += 1
            if key in ahead.states:
                gen, state = ahead.states[key]
                gen.set_state(state)

    def eligible(self, seqs: list[Sequence]) -> bool:
        return self.graphs.eligible(len(seqs), 1)

    @torch.inference_mode()
    def step(self, seqs: list[Sequence], launch_next: bool) -> tuple[list[Sequence], list[list[int]], bool]:
        """One token per row (each row fed its last token): (the rows that ran, [[t], ...] for
        them, whether a launch ahead served them); rows that joined after the launch wait for
        the next one. `launch_next`: start the following step now (False where every row ends
        here by length)."""
        # the scheduler grew the rows' tables for this step and the one launched ahead: the
        # replays read them on the device (Runner.forward syncs its own passes)
        self.graphs.sync_tables()
        ahead, self.ahead = self.ahead, None
        idx = [ahead.index.get(launch_key(s)) for s in seqs] if ahead is not None else [None] * len(seqs)
        hit = any(i is not None for i in idx)
        if hit:  # rows the launch covered; the rest wait a step
            run = [s for s, i in zip(seqs, idx) if i is not None]
            wait = [s for s, i in zip(seqs, idx) if i is None]
            used = [i for i in idx if i is not None]
            tokens = ahead.tokens
            if used != list(range(len(ahead.index))):
                tokens = tokens[device_ints(used, tokens.device)]
            self.hits += 1
            kept = set(used)
            self._drop(ahead, [k for k, i in ahead.index.items() if i not in kept])
            self.deferred_rows += len(wait)
        else:
            if ahead is not None:
                self._drop(ahead, ahead.index)
            run, wait = seqs, []
            self.fresh += 1
            logits, _, _ = self.graphs.forward([s.kv.row for s in seqs], [s.num_cached for s in seqs],
                                               [[s.token_ids[-1]] for s in seqs])
            tokens = _draw(logits[:, 0], seqs)
        host = self.host[:len(run)]
        host.copy_(tokens, non_blocking=True)
        self.copied.record()
        self.streak += 1
        if launch_next and self.streak > 1:  # EOS and stop strings are not known yet: a finished row drops it
            rows = run + wait
            logits = self.graphs.launch([s.kv.row for s in rows],
                                        [s.num_cached + 1 for s in run] + [s.num_cached for s in wait],
                                        [[0]] * len(run) + [[s.token_ids[-1]] for s in wait], tokens)
            index = ({launch_key(s, 1): b for b, s in enumerate(run)}
                     | {launch_key(s): len(run) + b for b, s in enumerate(wait)})
            states = {key: (g, g.get_state()) for key, b in index.items()  # seeded rows (unseeded: no stream)
                      if not rows[b].params.greedy and (g := rows[b].generator) is not None}
            self.launched += 1
            self.ahead = _Ahead(index, _draw(logits[:, 0], rows), states)
        self.copied.synchronize()
        return run, [[t] for t in host.tolist()], hit
