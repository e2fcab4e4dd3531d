"""Speculative steps launched ahead: step n+1 drafts and verifies on the GPU while the host
reads step n's tokens.

A speculative step's host work (reading the verify pass's argmax, appending tokens, stop
checks, detokenizing, scheduling, launching the drafter's and the target's graphs) otherwise
leaves the GPU idle between steps: 4.6 ms of a 22 ms step at TP 4 (benchmarks/gpu/tp). As a
plain step run ahead takes its input from the step before on the device
(cluster.engine.worker.pipeline), a speculative step can: acceptance runs on the device, and
step n+1 starts from there without the host:
- the target's cache length becomes `lens + a + 1` (the last token and a accepted drafts
  cached) and its first token the one drawn after them (the bonus token);
- the drafter catches up a fixed two tokens, the last accepted one (rewriting it where it
  already is, which is harmless) and the bonus token, then drafts its chain
  (ModelDrafter.launch_ahead), all from device tensors;
- the verify pass reads its rows' tokens and lengths from the device (GraphRunner.launch_rows;
  under tensor parallelism they follow the header as one device broadcast).

Greedy rows accept by the argmax (drafts stand while they equal it, `accept_on_device`), so
their tokens are plain decoding's; sampled rows by rejection sampling (`sample_on_device`),
each seeded row drawing from its own generator in a waiting step's order, and a dropped launch
sets those generators back (as the plain pipeline does). One model drafter for the batch, CUDA
graphs, no logprobs. The scheduler grows each row's blocks for both steps in flight (2 gamma +
2 positions) and settle keeps them (Sequence.reserve). A row's gamma caps how many drafts it
accepts of the step's width (its tokens past max_tokens are cut by the engine's stop checks).
The launch assumes every row continues: a row that finished, was aborted or preempted drops
its part, which only wrote its own blocks past its length and the drafter's. A row that joined
after the launch waits one step, and the next step starts afresh for all; so does a step after
any other kind.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from cluster.engine.drafters.base import DraftRequest, accept_uniforms
from cluster.engine.sampling import device_values, fill_draws, rejection_sample, target_probs
from cluster.engine.scheduling.sequence import Sequence
from cluster.engine.worker.attention import device_ints
from cluster.engine.worker.pipeline import launch_key

log = logging.getLogger(__name__)


@dataclass
class _Launch:
    """One speculative step on the device, its tokens not read yet."""
    index: dict[str, int]  # seq_id -> its row in this launch
    width: int  # gamma + 1 fed tokens a row
    fed: torch.Tensor  # [B, width] the verify pass's tokens: last token, drafts
    lens: torch.Tensor  # [B] its cache lengths
    best: torch.Tensor  # [B, width] the target's argmax at each fed position
    num_acc: torch.Tensor  # [B] drafts accepted
    host: torch.Tensor  # [B, width + 2] best, num_acc, drafts a row could accept; on the host once `copied`
    # timers on the stream: before the drafter's work, before the verify pass, after the copy
    # (`copied`: once it is done, the step's draft and verify GPU times are known)
    started: object
    drafted: object
    copied: object
    # seeded sampled rows: seq_id -> (its generator, the state before this launch drew from it)
    states: dict
    # seq_id -> `launch_key` the row has once this launch's tokens are accepted: the next step uses
    # the launch after it only where the row is there
    keys: dict[str, tuple] | None = None


def accept_on_device(logits: torch.Tensor, fed: torch.Tensor, caps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy acceptance without the host: (argmax [B, W], drafts accepted [B]). Drafts stand
    while they equal the target's argmax (spec.acceptance's greedy shortcut, the same
    comparison), at most `caps` of them a row."""
    best = logits.argmax(-1)
    stand = (best[:, :-1] == fed[:, 1:]).int().cumprod(-1).sum(-1)
    return best, torch.minimum(stand, caps)


def sample_on_device(logits: torch.Tensor, fed: torch.Tensor, lens: torch.Tensor, q: tuple, params: list,
                     generators: list, caps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rejection sampling without the host: (tokens [B, W], -1 after each row's, drafts
    accepted [B]), with spec.acceptance's numbers for a waiting step: the tests' uniforms keyed
    by position (accept_uniforms; the first draft's is `lens` + 1), then one Exp(1) vector from
    the row's generator."""
    b, width = fed.shape
    dev, vocab = logits.device, logits.shape[-1]
    p = target_probs(logits.reshape(-1, vocab), params, width).view(b, width, vocab)
    top_i, top_p = q
    q_full = torch.zeros((b, width - 1, vocab), device=dev)
    q_full.scatter_add_(-1, top_i[:, : width - 1], top_p[:, : width - 1])
    uniform = accept_uniforms(params, lens[:, None] + 1 + torch.arange(width - 1, device=dev))
    noise = fill_draws(torch.ones((b, vocab), device=dev), params, generators, "exponential").clamp_(min=1e-20)
    return rejection_sample(fed[:, 1:], caps, q_full, p, uniform, noise)


class SpecPipeline:
    def __init__(self, graphs, drafters: dict, capture, max_batch: int, max_width: int):
        """graphs: the target's GraphRunner, or rank 0's AnnouncedGraphs under tensor parallelism."""
        self.graphs, self.drafters, self.capture = graphs, drafters, capture
        # two host buffers in turn: a step launches the next before it reads its own
        self.buffers = [capture.host(max_batch * (max_width + 2)) for _ in range(2)]
        self.launches = 0
        self.ahead: _Launch | None = None
        self.hits = 0  # steps that used a launch ahead
        self.fresh = 0  # steps that started afresh
        self.dropped_rows = 0  # launched rows no step used (finished, aborted, preempted)
        self.deferred_rows = 0  # rows that joined after a launch and waited a step
        self.draft_failures = 0  # drafter calls that raised: those steps ran without a launch
        # GPU seconds the last step's drafting took, and its verify pass with acceptance and the
        # copy: a step launched ahead has no host-side split of draft and verify time to read
        self.draft_s = self.verify_s = 0.0

    @classmethod
    def build(cls, pipeline, drafters: dict, gamma_max: int) -> "SpecPipeline | None":
        """Over the plain pipeline's graphs (cluster.engine.worker.pipeline), with the drafters
        that can draft for it (a model drafter on graphs); None where there are none."""
        able = {n: d for n, d in drafters.items()
                if hasattr(d, "launch_ahead") and getattr(d.runner, "graphs", None) is not None}
        if pipeline is None or not able:
            return None
        g = pipeline.graphs
        return cls(g, able, g.capture, g.max_batch, gamma_max + 1)

    def drafter_for(self, seqs: list[Sequence], gammas: list[int], default: str | None) -> str | None:
        """The drafter a step of these rows launched ahead would use; None: no such step (rows
        of several drafters, no drafts, or no graph of the step's width)."""
        names = {s.drafter or default for s in seqs}
        name = names.pop() if len(names) == 1 else None
        ok = name in self.drafters and max(gammas) > 0 and self.graphs.eligible(len(seqs), max(gammas) + 1)
        return name if ok else None

    def interrupt(self, seqs: list[Sequence] = ()) -> None:
        """A step ran another way: drop any launch ahead (its rows' blocks need no reserve)."""
        if self.ahead is not None:
            self._drop(self.ahead, self.ahead.index)
        self.ahead = None
        for s in seqs:
            s.reserve = 0

    def _drop(self, launch: _Launch, seq_ids) -> None:
        """Launched rows no step will use: a seeded row's generator goes back to before the
        launch drew for it (as cluster.engine.worker.pipeline does), so a seed gives the
        tokens of waiting steps whatever was launched."""
        for sid in seq_ids:
            self.dropped_rows += 1
            if sid in launch.states:
                gen, state = launch.states[sid]
                gen.set_state(state)

    @torch.inference_mode()
    def step(self, seqs: list[Sequence], caps: list[int], lefts: list[int], drafter: str, launch_next: bool = True
             ) -> tuple[list[Sequence], list[list[int]], list[int]]:
        """One speculative step for `seqs` (gamma `caps[b]` each, the widest sets the drafts a
        row; `lefts[b]`: tokens the row may still add): (the rows that ran, their new tokens,
        the drafts each could accept); nothing where the drafter could not take them (draft the
        usual way). The next step is launched before this one's tokens are read, for the rows
        that ran, each row's gamma then capped by its tokens left as a waiting step's is; not
        with `launch_next` False (the next step decodes plainly)."""
        d = self.drafters[drafter]
        self.graphs.sync_tables()  # the scheduler grew the rows' tables for both steps in flight
        ahead, self.ahead = self.ahead, None
        idx = [None] * len(seqs)
        if ahead is not None and ahead.keys is not None:
            idx = [ahead.index.get(s.seq_id) if ahead.keys.get(s.seq_id) == launch_key(s) else None for s in seqs]
        if any(i is not None for i in idx):
            run = [s for s, i in zip(seqs, idx) if i is not None]
            wait = [s for s, i in zip(seqs, idx) if i is None]
            used = [i for i in idx if i is not None]
            self.hits += 1
            kept = set(used)
            self._drop(ahead, [sid for sid, i in ahead.index.items() if i not in kept])
            self.deferred_rows += len(wait)
            cur, sel = ahead, used
        else:
            if ahead is not None:  # none of its rows are here (finished, preempted): set back its draws
                self._drop(ahead, ahead.index)
            run, wait = seqs, []
            cur = self._fresh(run, max(caps), d, device_ints(caps, self.graphs.device))
            if cur is None:
                return [], [], []
            sel = list(range(len(run)))
            self.fresh += 1
        width = cur.width
        # no wait: run is seqs
        nxt = None if wait or not launch_next else self._launch(cur, sel, run, max(caps), caps, lefts, d)
        for s in seqs:
            s.reserve = 0 if nxt is None or s.seq_id not in nxt.index else 2 * (nxt.width - 1) + 2
        cur.copied.synchronize()
        self.draft_s = cur.started.elapsed_time(cur.drafted) / 1e3
        self.verify_s = cur.drafted.elapsed_time(cur.copied) / 1e3
        host = cur.host.tolist()
        tokens, keys, fed_caps = [], {}, []
        for s, i in zip(run, sel):
            a, cap = host[i][width], host[i][width + 1]
            toks = host[i][: a + 1]
            fed_caps.append(cap)
            tokens.append(toks)
            keys[s.seq_id] = launch_key(s, len(toks))
            # the drafter's KV: every token once the next launch caught up; else through the
            # last accepted draft it was fed (the last draft never is)
            n = len(s.token_ids) + len(toks) if nxt is not None else s.num_cached + min(a, width - 2) + 1
            d.hold(s.seq_id, s.token_ids, n)
        if nxt is not None:
            nxt.keys = keys
            self.ahead = nxt
        return run, tokens, fed_caps

    def _fresh(self, seqs: list[Sequence], g: int, d, caps: torch.Tensor) -> _Launch | None:
        """A step from the host's state: the drafter's usual call, its drafts left on the device."""
        started = self._timer()
        pending = self._drafter_call(d.launch, [DraftRequest(s.seq_id, s.token_ids, g, s.params) for s in seqs])
        if pending is None:
            return None
        if any(c != g for c in pending.counts):  # a row the drafter had no room for
            pending.finish()  # its state as its own call leaves it
            return None
        dev = pending.ids.device
        first = device_ints([s.token_ids[-1] for s in seqs], dev)
        fed = torch.cat([first[:, None], pending.device_ids()], 1)
        lens = device_ints([s.num_cached for s in seqs], dev)
        q = None
        if not all(s.params.greedy for s in seqs):  # the proposals, from the host (a fresh step's only wait)
            res = pending.finish()
            k = max(x.shape[1] for x in res.q_ids)  # greedy rows' are one-hot: one column
            ids, probs = np.zeros((len(seqs), g, k), np.int64), np.zeros((len(seqs), g, k), np.float32)
            for b, (i, pr) in enumerate(zip(res.q_ids, res.q_probs)):
                ids[b, : len(i), : i.shape[1]], probs[b, : len(i), : i.shape[1]] = i, pr
            q = (device_values(ids, torch.int64, dev), device_values(probs, torch.float32, dev))
        return self._verify(seqs, fed, lens, caps, started, q)

    def _launch(self, cur: _Launch, sel: list[int], seqs: list[Sequence], g: int, caps: list[int],
                lefts: list[int], d) -> _Launch | None:
        """The step after `cur` for its rows `sel` (`seqs`), from its results on the device."""
        if g < 1:
            return None
        dev = cur.fed.device
        at = None if sel == list(range(cur.fed.shape[0])) else device_ints(sel, dev)
        fed, lens, best, num_acc = (x if at is None else x[at] for x in (cur.fed, cur.lens, cur.best, cur.num_acc))
        last = fed.gather(1, num_acc[:, None])  # the last accepted token (rewritten) ...
        bonus = best.gather(1, num_acc[:, None])  # ... and the target's token after it
        start = lens + num_acc  # the last accepted token's position
        started = self._timer()
        drafts = self._drafter_call(d.launch_ahead, [s.seq_id for s in seqs], [len(s.token_ids) for s in seqs],
                                    torch.cat([last, bonus], 1), start, g, [s.params for s in seqs])
        if drafts is None:
            return None
        ids, top_i, top_p = drafts
        # a waiting step's gamma: within the tokens the row has left after this step's
        left = device_ints(lefts, dev) - num_acc - 1
        caps_next = torch.minimum(device_ints(caps, dev), left - 1).clamp_(min=0)
        return self._verify(seqs, torch.cat([bonus, ids], 1), start + 1, caps_next, started,
                            None if top_i is None else (top_i, top_p))

    def _timer(self):
        t = self.capture.timer()
        t.record()
        return t

    def _drafter_call(self, call, *args):
        """A drafter call; None where it raised. The drafter is disposable: its failure costs a
        launch ahead (and this step its drafts, cluster.engine.spec.drafting), never a token."""
        try:
            return call(*args)
        except Exception as e:
            self.draft_failures += 1
            log.warning("drafter failed (%s); this step runs without a launch ahead", e)
            return None

    def _verify(self, seqs: list[Sequence], fed: torch.Tensor, lens: torch.Tensor, caps: torch.Tensor, started,
                q=None) -> _Launch:
        """The verify pass over `fed` at `lens` and its acceptance, on the device; the tokens
        and counts copied to the host behind them. `q`: the drafts' proposals ([B, G, K]
        supports and probabilities) where rows sample: rejection sampling, each seeded row
        drawing from its own generator as a waiting step does (spec.acceptance)."""
        b, width = fed.shape
        drafted = self._timer()
        logits, _ = self.graphs.launch_rows([s.kv.row for s in seqs], width, fed, lens)
        states = {}
        if q is None:
            best, num_acc = accept_on_device(logits, fed, caps)
        else:
            params, gens = [s.params for s in seqs], [s.generator for s in seqs]
            states = {s.seq_id: (s.generator, s.generator.get_state()) for s in seqs
                      if not s.params.greedy and s.generator is not None}
            best, num_acc = sample_on_device(logits, fed, lens, q, params, gens, caps)
        host = self.buffers[self.launches % 2][: b * (width + 2)].view(b, width + 2)
        self.launches += 1
        host.copy_(torch.cat([best, num_acc[:, None], caps[:, None]], 1), non_blocking=True)
        copied = self._timer()
        return _Launch({s.seq_id: i for i, s in enumerate(seqs)}, width, fed, lens, best, num_acc, host, started,
                       drafted, copied, states)
