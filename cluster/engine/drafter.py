"""Drafters behind one interface: `propose` for a whole batch, `release` when done.

A request carries the sequence's full token list, so any drafter instance (in this process
or a remote replica) can serve any call: state is keyed by seq_id and resynchronised from
the tokens (rejected drafts are rolled back by the common prefix). The drafter is
disposable: losing its state costs a re-prefill, never correctness.

Proposals travel as sparse distributions (top-K ids and probabilities per position): a
model drafter samples from its own top-K-truncated distribution, which is itself a legal
proposal q for rejection sampling, so the verifier sees exactly the q each draft came from.
"""

from __future__ import annotations

import abc
import logging
import time
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import torch

from cluster.engine.kv_cache import KVCache
from cluster.engine.model import CausalLM
from cluster.engine.runner import Runner, _device_ints
from cluster.engine.sampling import SamplingParams, target_probs

TOPK = 32  # support kept for sampled proposals; greedy proposals are one-hot
log = logging.getLogger(__name__)
CATCHUP = 16  # rows with at most this many new tokens catch up in one pass
CATCHUP_TOKENS = 8192  # longer rows (new sequences, a return from plain decoding) go in padded
                       # passes of similar lengths up to this many tokens: one by one, 64 rows
                       # back from plain decoding cost a drafter pass each
# Catch-up passes up to this many tokens a row replay CUDA graphs (hidden states only; logits
# at each row's last token). Eagerly, a new request's prompt cost a draft step ~5 ms of Python
# at 64 streams on an H100, where drafting itself is launch-bound and ~1 ms a token.
CHUNK = 512


@dataclass
class DraftRequest:
    seq_id: str
    token_ids: list[int]             # prompt + accepted output so far
    k: int                           # tokens to propose
    params: SamplingParams = field(default_factory=SamplingParams)
    confirmed: int | None = None     # of token_ids, how many are accepted (None: all); the rest
                                     # are drafts a look-ahead request assumes will be accepted

    @classmethod
    def make_dummy(cls, k: int = 4) -> "DraftRequest":
        return cls("dummy", [1, 2, 3, 1, 2], k)


@dataclass
class DraftOutput:
    tokens: list[list[int]]          # per request, at most k tokens (may be fewer, or none)
    q_ids: list[np.ndarray]          # per request [n, K] int32 support of each proposal
    q_probs: list[np.ndarray]        # per request [n, K] float32 probabilities on that support
    seconds: float = 0.0
    # per request, a tree instead of a chain: each draft's parent draft, -1 for the last
    # accepted token (parents first; see cluster.engine.tree). None: every row is a chain.
    parents: list[list[int] | None] | None = None

    @classmethod
    def make_dummy(cls) -> "DraftOutput":
        return cls([[1, 2]], [np.array([[1], [2]], np.int32)], [np.ones((2, 1), np.float32)])


def one_hot(tokens: list[int]) -> tuple[np.ndarray, np.ndarray]:
    return np.asarray(tokens, np.int32).reshape(-1, 1), np.ones((len(tokens), 1), np.float32)


class Drafter(abc.ABC):
    name = "drafter"
    # Whether the engine asks for the next step's drafts while this step verifies (assuming
    # every draft is accepted): "gated", a drafter in another process, whose queue makes a
    # wrong guess cost a step, so only while guesses pay; "free", one that drafts on its own
    # CUDA stream while the host would wait for the verify pass anyway; None, never.
    look_ahead: str | None = None
    needs_hidden = False  # True: the engine keeps each sequence's last hidden state (Sequence.hidden)

    @abc.abstractmethod
    def propose(self, requests: list[DraftRequest]) -> DraftOutput: ...

    def propose_async(self, requests: list[DraftRequest]) -> Future:
        """Remote drafters return a pending future; local ones compute now."""
        fut: Future = Future()
        fut.set_result(self.propose(requests))
        return fut

    def release(self, seq_ids: list[str]) -> None:
        """Forget per-sequence state (the sequence finished)."""

    def rollback(self, seq_id: str, num_tokens: int) -> None:
        """Drop state past `num_tokens` tokens; `propose` also does this from the tokens."""


class NgramDrafter(Drafter):
    """Prompt lookup: find the latest earlier occurrence of the sequence's last n tokens
    (n from max_n down to min_n) and propose what followed it. Model-free, stateless."""

    name = "ngram"

    def __init__(self, max_n: int = 3, min_n: int = 1):
        self.max_n, self.min_n = max_n, min_n

    def propose(self, requests: list[DraftRequest]) -> DraftOutput:
        t0 = time.perf_counter()
        toks = [self._lookup(np.asarray(r.token_ids, np.int64), r.k) if r.k > 0 else [] for r in requests]
        hot = [one_hot(t) for t in toks]
        return DraftOutput(toks, [h[0] for h in hot], [h[1] for h in hot], time.perf_counter() - t0)

    def _lookup(self, ids: np.ndarray, k: int) -> list[int]:
        for n in range(self.max_n, self.min_n - 1, -1):
            if len(ids) <= n:
                continue
            windows = np.lib.stride_tricks.sliding_window_view(ids[:-1], n)
            hits = np.flatnonzero((windows == ids[-n:]).all(axis=1))
            if len(hits):
                start = hits[-1] + n
                return ids[start:start + k].tolist()
        return []


class ModelDrafter(Drafter):
    """A small causal LM with its own slot KV cache; state per seq_id, LRU-evicted."""

    name = "model"

    def __init__(self, model: CausalLM, num_slots: int = 64, max_len: int = 2048, gamma_max: int = 8,
                 look_ahead: str | None = "auto"):
        s = model.shape
        p = next(model.parameters())
        # Its own stream on a GPU: a draft launched while the target verifies runs beside it
        # (a small model's step is launches and syncs, which then overlap the verify pass).
        self.stream = torch.cuda.Stream(p.device) if p.device.type == "cuda" else None
        self.look_ahead = ("free" if self.stream is not None else None) if look_ahead == "auto" else look_ahead
        # spare positions: a batched catch-up pads short rows to the longest (or a graph's width)
        self.kv = KVCache(s.layers, num_slots, max_len + CHUNK, s.kv_heads, s.head_dim, p.dtype, p.device)
        # CUDA graphs for draft steps (one token a row, with logits) and catch-up passes (every
        # width up to CATCHUP, then 1.5x steps to CHUNK): a small model's step is launches, not math
        cuda = p.device.type == "cuda"
        self.runner = Runner(model, self.kv, graph_width=1 if cuda else 0, prefill_chunk=CHUNK,
                             max_tokens=CATCHUP_TOKENS, dense_to=CATCHUP)
        self.max_len = max_len
        self.state: OrderedDict[str, tuple[int, list[int]]] = OrderedDict()  # seq_id -> (slot, cached tokens)
        self.generators: dict[str, torch.Generator] = {}

    def propose_async(self, requests: list[DraftRequest]) -> Future:
        if self.stream is None:
            return super().propose_async(requests)
        fut: Future = Future()
        if all(r.confirmed is None for r in requests):
            # Not a look-ahead (which is meant to run beside the verify pass): start after what
            # the caller's stream still has queued, e.g. a plain step launched ahead and then
            # dropped when the controller turned speculation back on. Drafting beside a full
            # 64-row target pass is the one pattern shared by three H100 runs in which a draft
            # call waited 66-69 s on its own stream (benchmarks/gpu/h100/stall; the fix is
            # not yet measured there).
            self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):  # every step syncs this stream: nothing left in flight
            fut.set_result(self.propose(requests))
        return fut

    def release(self, seq_ids: list[str]) -> None:
        for sid in seq_ids:
            st = self.state.pop(sid, None)
            self.generators.pop(sid, None)
            if st is not None:
                self.kv.free(st[0])

    def rollback(self, seq_id: str, num_tokens: int) -> None:
        if seq_id in self.state:
            slot, toks = self.state[seq_id]
            self.state[seq_id] = (slot, toks[:num_tokens])

    def tokens_held(self, seq_id: str) -> list[int] | None:
        """The tokens whose KV this drafter holds for a sequence (None: no state)."""
        st = self.state.get(seq_id)
        return st[1] if st is not None else None

    def _slot(self, seq_id: str, keep: set[str]) -> int:
        if seq_id in self.state:
            self.state.move_to_end(seq_id)
            return self.state[seq_id][0]
        slot = self.kv.allocate()
        while slot is None:  # evict the least recently used sequence not in this batch
            victim = next(s for s in self.state if s not in keep)
            self.release([victim])
            slot = self.kv.allocate()
        self.state[seq_id] = (slot, [])
        return slot

    def propose(self, requests: list[DraftRequest]) -> DraftOutput:
        t0 = time.perf_counter()
        live = [r for r in requests if r.k > 0 and len(r.token_ids) + r.k <= self.max_len]
        out = {r.seq_id: ([], [], []) for r in requests}
        if live:
            self._propose(live, out)
        took = time.perf_counter() - t0
        if took > 1.0:  # a step is milliseconds: say what this one was asked to do
            log.warning("draft call took %.1f s: %d rows, k %s, longest row %d tokens", took, len(live),
                        sorted({r.k for r in live}), max((len(r.token_ids) for r in live), default=0))
        toks, ids, probs = zip(*(out[r.seq_id] for r in requests))
        # rows with no drafts (k = 0, too long) get [0, 1] arrays, as every drafter's empty rows
        return DraftOutput(list(toks), [np.asarray(i, np.int32).reshape(len(t), -1 if t else 1) for i, t in zip(ids, toks)],
                           [np.asarray(p, np.float32).reshape(len(t), -1 if t else 1) for p, t in zip(probs, toks)],
                           time.perf_counter() - t0)

    def _propose(self, reqs: list[DraftRequest], out: dict) -> None:
        keep = {r.seq_id for r in reqs}
        slots, lens, feed = [], [], []
        for r in reqs:
            slot = self._slot(r.seq_id, keep)
            cached = self.state[r.seq_id][1]
            n = _common_prefix(cached, r.token_ids)
            n = min(n, len(r.token_ids) - 1)  # always feed at least one token to get logits
            slots.append(slot)
            lens.append(n)
            feed.append(r.token_ids[n:])
        logits = self._catch_up(slots, lens, feed)
        lens = [n + len(f) for n, f in zip(lens, feed)]
        if all(r.params.greedy for r in reqs):
            drafts = self._greedy_chain(reqs, slots, lens, logits)
            for r, d in zip(reqs, drafts):  # one-hot proposals
                out[r.seq_id][1].extend([t] for t in d)
                out[r.seq_id][2].extend([1.0] for _ in d)
        else:
            # a row's generator is made on its first sampled draft (seeded: the same stream)
            gens = [self.generators.get(r.seq_id) or self.generators.setdefault(r.seq_id, _generator(r.params.seed))
                    for r in reqs]
            drafts = self._sampled_chain(reqs, slots, lens, logits, gens, out)
        for b, r in enumerate(reqs):
            cached = r.token_ids + drafts[b][:-1]  # the last draft was never fed
            self.state[r.seq_id] = (slots[b], cached[: lens[b]])
            out[r.seq_id][0].extend(drafts[b])
            # pad every position's support to the same K so arrays stay rectangular
            width = max(len(x) for x in out[r.seq_id][1]) if drafts[b] else 0
            out[r.seq_id][1][:] = [x + [x[0]] * (width - len(x)) for x in out[r.seq_id][1]]
            out[r.seq_id][2][:] = [x + [0.0] * (width - len(x)) for x in out[r.seq_id][2]]

    def _greedy_chain(self, reqs, slots, lens, logits) -> list[list[int]]:
        """Every row's argmax fed back on the device, step after step, and one copy of all the
        drafts to the host at the end: a draft step of a small model is a graph replay of tens
        of microseconds, which a host round trip per step (argmax to the host, tokens back)
        would double. Advances `lens` by the tokens fed."""
        ks = [r.k for r in reqs]
        picks = [logits.argmax(-1)]  # step j: [rows with k > j] drafts
        rows = list(range(len(reqs)))
        for step in range(1, max(ks)):
            prev, idx = picks[-1], rows
            rows = [b for b in rows if ks[b] > step]
            if not rows:
                break
            fed = prev if len(rows) == len(idx) else prev[_device_ints([idx.index(b) for b in rows], prev.device)]
            sub = self.runner.decode([slots[b] for b in rows], [lens[b] for b in rows], fed)
            picks.append(sub.argmax(-1))
            for b in rows:
                lens[b] += 1
        flat = torch.cat(picks).tolist()  # the one wait for the GPU
        drafts: list[list[int]] = [[] for _ in reqs]
        rows, at = list(range(len(reqs))), 0
        for step in range(len(picks)):
            rows = [b for b in rows if ks[b] > step]
            for b in rows:
                drafts[b].append(flat[at])
                at += 1
        return drafts

    def _sampled_chain(self, reqs, slots, lens, logits, gens, out) -> list[list[int]]:
        """Each row samples from its top-K-truncated distribution (on the host, with its own
        generator: reproducible for a seed); greedy rows among them take the argmax."""
        drafts: list[list[int]] = [[] for _ in reqs]
        for step in range(max(r.k for r in reqs)):
            probs = target_probs(logits, [r.params for r in reqs])
            top_p, top_i = probs.topk(min(TOPK, probs.shape[-1]), dim=-1)
            top_p = top_p / top_p.sum(-1, keepdim=True)
            picks = []
            for b, r in enumerate(reqs):
                if step >= r.k:
                    continue
                if r.params.greedy:
                    tok, ids, ps = int(top_i[b, 0]), [int(top_i[b, 0])], [1.0]
                else:
                    j = int(torch.multinomial(top_p[b].cpu(), 1, generator=gens[b]))
                    tok, ids, ps = int(top_i[b, j]), top_i[b].tolist(), top_p[b].tolist()
                drafts[b].append(tok)
                out[r.seq_id][1].append(ids)
                out[r.seq_id][2].append(ps)
                picks.append(b)
            if step + 1 >= max(r.k for r in reqs):
                break
            rows = [b for b in picks if len(drafts[b]) < reqs[b].k]
            if not rows:
                break
            sub = self.runner.forward([slots[b] for b in rows], [lens[b] for b in rows],
                                      [[drafts[b][-1]] for b in rows], last_only=True)
            logits = logits.clone()
            logits[rows] = sub
            for b in rows:
                lens[b] += 1
        return drafts


    def _catch_up(self, slots, lens, feed) -> torch.Tensor:
        groups = [[b for b, f in enumerate(feed) if len(f) <= CATCHUP]]
        cap = self.kv.capacity
        for b in sorted((b for b, f in enumerate(feed) if len(f) > CATCHUP), key=lambda b: len(feed[b])):
            g, n = groups[-1], len(feed[b])  # rows sorted by length: b's is the group's width
            # a row padded to the group's width writes past its own tokens: it must fit the slot
            pad = self.runner.padded_width(n)
            if len(groups) == 1 or (len(g) + 1) * n > CATCHUP_TOKENS or max(lens[x] for x in g + [b]) + pad > cap:
                groups.append([])
            groups[-1].append(b)
        logits = None
        for rows in filter(None, groups):
            part = self.runner.forward([slots[b] for b in rows], [lens[b] for b in rows],
                                       [feed[b] for b in rows], last_only=True)
            if logits is None:
                logits = part.new_empty((len(feed), part.shape[-1]))
            logits[rows] = part
        return logits


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _generator(seed: int | None) -> torch.Generator:
    g = torch.Generator(device="cpu")
    g.manual_seed(seed if seed is not None else int(torch.randint(0, 2**62, (1,))))
    return g
