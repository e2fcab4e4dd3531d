"""A small causal LM as the drafter, with its own paged KV cache (state per seq_id, LRU-evicted).

It can run in the verifier's process (colocated) or in a Drafter replica of its own: every
request carries the sequence's tokens, and whatever KV it holds for them is resynchronised
by the common prefix. A greedy row proposes its argmax chain (one-hot q); a sampled row
samples from its own top-K-truncated distribution, which is itself a legal proposal q.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from concurrent.futures import Future

import torch

from cluster.engine.drafters.base import TOPK, Drafter, DraftOutput, DraftRequest, draft_keys, draft_uniforms, empty_rows, pick
from cluster.engine.sampling import device_values, target_probs
from cluster.engine.scheduling.kv_cache import KVCache, KVHandle
from cluster.engine.worker.attention import device_ints
from cluster.engine.worker.model import CausalLM
from cluster.engine.worker.runner import Runner

log = logging.getLogger(__name__)
CATCHUP = 16  # rows with at most this many new tokens catch up in one pass
CATCHUP_TOKENS = 8192  # longer rows (new sequences, a return from plain decoding) go in padded
                       # passes of similar lengths up to this many tokens: one by one, 64 rows
                       # back from plain decoding cost a drafter pass each
# Catch-up passes up to this many tokens a row replay CUDA graphs (hidden states only; logits
# at each row's last token): eagerly, a new prompt's Python costs more than a draft step.
CHUNK = 512
BLOCK = 16  # tokens per block of the drafter's own cache


class ModelDrafter(Drafter):
    name = "model"

    def __init__(self, model: CausalLM, num_slots: int = 64, max_len: int = 2048, *, look_ahead: str | None = "auto",
                 own_stream: bool = True):
        s = model.shape
        p = next(model.parameters())
        # Its own stream on a GPU: a draft launched while the target verifies runs beside it
        # (a small model's step is launches and syncs, which then overlap the verify pass).
        # own_stream False: on the caller's stream (EngineConfig.draft_stream says when)
        self.stream = torch.cuda.Stream(p.device) if p.device.type == "cuda" and own_stream else None
        self.look_ahead = ("free" if self.stream is not None else None) if look_ahead == "auto" else look_ahead
        # spare positions: a batched catch-up pads short rows to the longest (or a graph's width);
        # blocks for num_slots sequences of max_len tokens, shared as they come
        width = max_len + CHUNK
        self.kv = KVCache(s.layers, num_slots * -(-width // BLOCK), BLOCK, s.kv_heads, s.head_dim, p.dtype, p.device,
                          max_rows=num_slots, max_tokens=width, prefix_caching=False)
        # CUDA graphs for draft steps (one token a row, with logits) and catch-up passes (every
        # width up to CATCHUP, then 1.5x steps to CHUNK): a small model's step is launches, not math
        self.runner = Runner(model, self.kv, graph_width=1, prefill_chunk=CHUNK,
                             max_tokens=CATCHUP_TOKENS, dense_to=CATCHUP)
        self.max_len = max_len
        self.state: OrderedDict[str, tuple[KVHandle, list[int]]] = OrderedDict()  # seq_id -> (KV, cached tokens)

    def propose_async(self, requests: list[DraftRequest]) -> Future:
        if self.stream is None:
            return super().propose_async(requests)
        fut: Future = Future()
        if all(r.confirmed is None for r in requests):
            # Not a look-ahead (which is meant to run beside the verify pass): start after what
            # the caller's stream still has queued, e.g. a plain step launched ahead and then
            # dropped when the controller turned speculation back on; drafting beside a full
            # target pass stalled for a minute on an H100 (benchmarks/gpu/h100/stall).
            self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):  # every step syncs this stream: nothing left in flight
            fut.set_result(self.propose(requests))
        return fut

    def warm_up(self) -> None:
        self.runner.warm_up()

    def release(self, seq_ids: list[str]) -> None:
        for sid in seq_ids:
            st = self.state.pop(sid, None)
            if st is not None:
                self.kv.close(st[0])

    def tokens_held(self, seq_id: str) -> list[int] | None:
        """The tokens whose KV this drafter holds for a sequence (None: no state)."""
        st = self.state.get(seq_id)
        return st[1] if st is not None else None

    def _handle(self, seq_id: str, keep: set[str]) -> KVHandle:
        if seq_id in self.state:
            self.state.move_to_end(seq_id)
            return self.state[seq_id][0]
        h = self.kv.open()
        while h is None:  # evict the least recently used sequence not in this batch
            self._evict(keep)
            h = self.kv.open()
        self.state[seq_id] = (h, [])
        return h

    def _evict(self, keep: set[str]) -> bool:
        """Drop the KV of the least recently used sequence outside `keep` (not its sampling
        draws: a seeded sequence drafts the same whether or not its KV was evicted)."""
        victim = next((s for s in self.state if s not in keep), None)
        if victim is not None:
            self.kv.close(self.state.pop(victim)[0])
        return victim is not None

    def _room(self, h: KVHandle, num_tokens: int, keep: set[str]) -> bool:
        while self.kv.blocks_needed(h, num_tokens) > self.kv.pool.num_free:
            if not self._evict(keep):
                return False
        self.kv.grow(h, num_tokens)
        return True

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
        return DraftOutput(list(toks), *empty_rows(list(toks), ids, probs), time.perf_counter() - t0)

    def _propose(self, reqs: list[DraftRequest], out: dict) -> None:
        keep = {r.seq_id for r in reqs}
        handles = {r.seq_id: self._handle(r.seq_id, keep) for r in reqs}
        # blocks for the new tokens and the drafts; a row the pool cannot hold drafts nothing
        reqs = [r for r in reqs if self._room(handles[r.seq_id], len(r.token_ids) + r.k, keep)]
        if not reqs:
            return
        kv_rows, lens, feed = [], [], []
        for r in reqs:
            cached = self.state[r.seq_id][1]
            n = _common_prefix(cached, r.token_ids)
            n = min(n, len(r.token_ids) - 1)  # always feed at least one token to get logits
            kv_rows.append(handles[r.seq_id].row)
            lens.append(n)
            feed.append(r.token_ids[n:])
        logits = self._catch_up(kv_rows, lens, feed)
        lens = [n + len(f) for n, f in zip(lens, feed)]
        if all(r.params.greedy for r in reqs):
            drafts = self._greedy_chain(reqs, kv_rows, lens, logits)
            for r, d in zip(reqs, drafts):  # one-hot proposals
                out[r.seq_id][1].extend([t] for t in d)
                out[r.seq_id][2].extend([1.0] for _ in d)
        else:
            drafts = self._sampled_chain(reqs, kv_rows, lens, logits, out)
        for b, r in enumerate(reqs):
            cached = r.token_ids + drafts[b][:-1]  # the last draft was never fed
            self.state[r.seq_id] = (handles[r.seq_id], cached[: lens[b]])
            out[r.seq_id][0].extend(drafts[b])
            # pad every position's support to the same K so arrays stay rectangular
            width = max(len(x) for x in out[r.seq_id][1]) if drafts[b] else 0
            out[r.seq_id][1][:] = [x + [x[0]] * (width - len(x)) for x in out[r.seq_id][1]]
            out[r.seq_id][2][:] = [x + [0.0] * (width - len(x)) for x in out[r.seq_id][2]]

    def _greedy_chain(self, reqs, kv_rows, lens, logits) -> list[list[int]]:
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
            fed = prev if len(rows) == len(idx) else prev[device_ints([idx.index(b) for b in rows], prev.device)]
            sub = self.runner.decode([kv_rows[b] for b in rows], [lens[b] for b in rows], fed)
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

    def _sampled_chain(self, reqs, kv_rows, lens, logits, out) -> list[list[int]]:
        """Each row samples from its top-K-truncated distribution by the inverse CDF of one
        uniform keyed by its seed and the draft's position (draft_uniforms, on the device: no
        host round trip a row); greedy rows take the argmax. One copy to the host a draft step."""
        drafts: list[list[int]] = [[] for _ in reqs]
        dev = logits.device
        greedy = device_values([r.params.greedy for r in reqs], torch.bool, dev)
        keys = device_values(draft_keys(reqs), torch.int64, dev)
        at = device_values([len(r.token_ids) for r in reqs], torch.int64, dev)  # the first draft's position
        for step in range(max(r.k for r in reqs)):
            probs = target_probs(logits, [r.params for r in reqs])
            top_p, top_i = probs.topk(min(TOPK, probs.shape[-1]), dim=-1)
            top_p = top_p / top_p.sum(-1, keepdim=True)
            live = [b for b, r in enumerate(reqs) if step < r.k]
            j = pick(top_p, draft_uniforms(keys, at + step)).masked_fill(greedy, 0)
            tok_h, ids_h, ps_h = (t.tolist() for t in (top_i.gather(-1, j[:, None])[:, 0], top_i, top_p))
            for b in live:
                if reqs[b].params.greedy:
                    ids, ps = [tok_h[b]], [1.0]
                else:
                    ids, ps = ids_h[b], ps_h[b]
                drafts[b].append(tok_h[b])
                out[reqs[b].seq_id][1].append(ids)
                out[reqs[b].seq_id][2].append(ps)
            if step + 1 >= max(r.k for r in reqs):
                break
            rows = [b for b in live if len(drafts[b]) < reqs[b].k]
            if not rows:
                break
            sub = self.runner.forward([kv_rows[b] for b in rows], [lens[b] for b in rows],
                                      [[drafts[b][-1]] for b in rows], last_only=True)
            logits = logits.clone()
            logits[rows] = sub.to(logits.dtype)
            for b in rows:
                lens[b] += 1
        return drafts

    def _catch_up(self, kv_rows, lens, feed) -> torch.Tensor:
        lens, feed = list(lens), list(feed)
        # Rows past a chunk (a new prompt, a return from plain decoding) first go a chunk at a
        # time: a pass of any other width runs eagerly, and a compiled piece meets a new length
        # there (a recompile: 150 ms steps on an H100 while a controller turned drafts on).
        while long := [b for b, f in enumerate(feed) if len(f) > CHUNK]:
            for i in range(0, len(long), CATCHUP_TOKENS // CHUNK):
                rows = long[i:i + CATCHUP_TOKENS // CHUNK]
                self.runner.forward([kv_rows[b] for b in rows], [lens[b] for b in rows],
                                    [feed[b][:CHUNK] for b in rows], last_only=True)
            for b in long:
                lens[b], feed[b] = lens[b] + CHUNK, feed[b][CHUNK:]
        groups = [[b for b, f in enumerate(feed) if len(f) <= CATCHUP]]
        cap = self.kv.max_tokens
        for b in sorted((b for b, f in enumerate(feed) if len(f) > CATCHUP), key=lambda b: len(feed[b])):
            g, n = groups[-1], len(feed[b])  # rows sorted by length: b's is the group's width
            # a row padded to the group's width writes past its own tokens: within its table
            pad = self.runner.padded_width(n)
            if len(groups) == 1 or (len(g) + 1) * n > CATCHUP_TOKENS or max(lens[x] for x in g + [b]) + pad > cap:
                groups.append([])
            groups[-1].append(b)
        logits = None
        for rows in filter(None, groups):
            part = self.runner.forward([kv_rows[b] for b in rows], [lens[b] for b in rows],
                                       [feed[b] for b in rows], last_only=True)
            if logits is None:  # fp32: graph passes give the head's dtype, eager ones fp32
                logits = part.new_empty((len(feed), part.shape[-1]), dtype=torch.float32)
            logits[rows] = part.float()
        return logits


def _common_prefix(a: list[int], b: list[int]) -> int:
    """The length of a's and b's common prefix. They part near their ends (the drafts a verify
    step rejected), so whole prefixes are compared as slices (C speed), stepping back from the
    end 8x further each time, and only the last stretch goes element by element: a Python
    scan of a 640-token row cost 70 us, 18 ms a step at 256 rows on a CPU."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, step = n, 8
    while lo > 0:
        lo = max(0, lo - step)
        if a[:lo] == b[:lo]:
            break
        step *= 8
    while lo < n and a[lo] == b[lo]:
        lo += 1
    return lo
