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
from contextlib import nullcontext
from dataclasses import dataclass

import numpy as np
import torch

from cluster.engine.drafters.base import (TOPK, Drafter, DraftOutput, DraftRequest, PendingDrafts, draft_keys,
                                          draft_uniforms, host_copies, one_hot, pick, spread)
from cluster.engine.sampling import device_values, target_probs
from cluster.engine.scheduling.kv_cache import KVCache, KVHandle
from cluster.engine.worker.attention import device_ints
from cluster.engine.worker.model import CausalLM
from cluster.engine.worker.runner import Runner

log = logging.getLogger(__name__)
CATCHUP = 16  # rows with at most this many new tokens catch up in one pass
# longer rows (new sequences, a return from plain decoding) go in padded passes of similar
# lengths up to this many tokens (one by one, 64 rows back from plain cost a pass each)
CATCHUP_TOKENS = 8192
# Catch-up passes up to this many tokens a row replay CUDA graphs (hidden states only; logits
# at each row's last token): eagerly, a new prompt's Python costs more than a draft step.
CHUNK = 512
BLOCK = 16  # tokens per block of the drafter's own cache
# Greedy chains of up to this many rows replay one graph (GraphRunner.chain); wider batches step
# graph by graph, their launches shared by many rows
CHAIN_ROWS = 16


@dataclass
class _Held:
    """The tokens a row's KV holds: ref[:n] + tail (the drafts fed). `ref` is the request's list,
    not a copy (an engine's own, which only grows), so the next call's common prefix is its
    first n and how far the tail goes on: O(drafts), where comparing whole rows cost 2 ms a
    step at 256 rows on a CPU. (A list changed in place would cost acceptance, never a token.)"""
    ref: list[int]
    n: int
    tail: list[int]

    def tokens(self) -> list[int]:
        return self.ref[: self.n] + self.tail

    def common_prefix(self, tokens: list[int]) -> int:
        if tokens is not self.ref or len(tokens) < self.n:
            return _common_prefix(self.tokens(), tokens)
        i, tail = 0, self.tail
        while i < len(tail) and self.n + i < len(tokens) and tokens[self.n + i] == tail[i]:
            i += 1
        return self.n + i


@dataclass
class _Chain:
    """One launch's rows (those with room) and its drafts on the device."""
    reqs: list[DraftRequest]
    handles: list[KVHandle]
    sizes: list[int]  # each row's tokens at launch (its list may grow before `finish`)
    ids: torch.Tensor | None = None  # [B, max k] int64, -1 past a row's k
    top_i: torch.Tensor | None = None  # sampled rows: [B, max k, K] support and probabilities
    top_p: torch.Tensor | None = None
    host: dict | None = None  # their host copies (host_copies)


class ModelDrafter(Drafter):
    name = "model"

    def __init__(self, model: CausalLM, num_slots: int = 64, max_len: int = 2048, *, look_ahead: str | None = "auto",
                 own_stream: bool = True, max_draft: int = 0):
        """max_draft: the longest chain warm_up captures where no engine tells it (a drafter
        replica's: a look-ahead drafts gamma_max + 1); a longer one is captured mid-step."""
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
        self.max_len, self.num_slots, self.max_draft = max_len, num_slots, max_draft
        self.state: OrderedDict[str, tuple[KVHandle, _Held]] = OrderedDict()  # seq_id -> (KV, cached tokens)

    def warm_up(self, max_draft: int = 0) -> None:
        self.runner.warm_up()
        k = max(max_draft, self.max_draft)
        if self.runner.graphs is not None and k > 1:
            self.runner.graphs.capture_chains(min(CHAIN_ROWS, self.num_slots), k)

    def release(self, seq_ids: list[str]) -> None:
        for sid in seq_ids:
            st = self.state.pop(sid, None)
            if st is not None:
                self.kv.close(st[0])

    def lag(self, rows: list[tuple[str, list[int]]]) -> int:
        return sum(len(t) - (self.state[sid][1].common_prefix(t) if sid in self.state else 0) for sid, t in rows)

    def tokens_held(self, seq_id: str) -> list[int] | None:
        """The tokens whose KV this drafter holds for a sequence (None: no state)."""
        st = self.state.get(seq_id)
        return st[1].tokens() if st is not None else None

    def _handle(self, seq_id: str, keep: set[str]) -> KVHandle:
        if seq_id in self.state:
            self.state.move_to_end(seq_id)
            return self.state[seq_id][0]
        h = self.kv.open()
        while h is None:  # evict the least recently used sequence not in this batch
            self._evict(keep)
            h = self.kv.open()
        self.state[seq_id] = (h, _Held([], 0, []))
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

    @torch.inference_mode()
    def launch_ahead(self, seq_ids: list[str], sizes: list[int], fed: torch.Tensor, lens: torch.Tensor,
                     k: int, params: list) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None] | None:
        """Drafts for a step launched before the host knows the one before it (cluster.engine.spec.ahead):
        each row catches up the two tokens `fed` ([B, 2]: the last accepted one, rewritten in
        place, and the one after) at positions `lens` ([B]), all on the device, then drafts k
        as `_launch` does (`params`: the rows' SamplingParams). Returns [B, k] drafts and, where
        rows sample, their [B, k, K] supports and probabilities, on the caller's stream. Rows
        hold their KV up to `lens` (`hold`); `sizes`: their tokens as the host knows them, which
        the step before may grow by k + 1. None where a row has no state or room."""
        graphs = self.runner.graphs
        if graphs is None or any(sid not in self.state for sid in seq_ids) or len(seq_ids) > self.num_slots:
            return None
        keep = set(seq_ids)
        handles = [self._handle(sid, keep) for sid in seq_ids]
        # the step before may add k + 1 tokens; these drafts write k more after the two caught up
        if any(n + 2 * k + 2 > self.max_len or not self._room(h, n + 2 * k + 2, keep) for h, n in zip(handles, sizes)):
            return None
        rows = [h.row for h in handles]
        self.kv.sync()
        _, hidden = graphs.launch_rows(rows, 2, fed, lens)
        logits = self.runner.model.logits(hidden[:, 1])
        at = lens + 2  # the first draft's position
        if all(p.greedy for p in params):
            first = logits.argmax(-1)
            if k == 1:
                return first[:, None], None, None
            if len(rows) <= CHAIN_ROWS:  # the chain graphs captured at warm-up (its buffer: the next replays into it)
                return graphs.chain(rows, [0] * len(rows), first, k, lens=at).clone(), None, None
            out = [first]
            for i in range(k - 1):  # wider: a one-token graph a step, its launches shared by many rows
                out.append(graphs.launch_rows(rows, 1, out[-1][:, None], at + i)[0][:, 0].argmax(-1))
            return torch.stack(out, 1), None, None
        dev = logits.device
        keys = device_values(draft_keys([DraftRequest(sid, [], k, p) for sid, p in zip(seq_ids, params)]), torch.int64, dev)
        greedy = device_values([p.greedy for p in params], torch.bool, dev)
        drawn = []
        for i in range(k):
            drawn.append(_sample(logits, params, keys, at + i, greedy))  # (token, support, probabilities)
            if i + 1 < k:
                logits = graphs.launch_rows(rows, 1, drawn[-1][0][:, None], at + i)[0][:, 0].float()
        return tuple(torch.stack(x, 1) for x in zip(*drawn))

    def hold(self, seq_id: str, tokens: list[int], n: int) -> None:
        """This row's KV holds `tokens`' first n (launch_ahead's catch-up wrote them, or will
        before any later pass here reads them)."""
        st = self.state.get(seq_id)
        if st is not None:
            self.state[seq_id] = (st[0], _Held(tokens, n, []))

    def propose(self, requests: list[DraftRequest]) -> DraftOutput:
        return self.launch(requests).finish()

    def launch(self, requests: list[DraftRequest]) -> PendingDrafts:
        """Every row's chain drafted on the device (greedy: the argmax fed back; sampled: the
        draw of draft_uniforms from its top-K distribution), then one copy to the host, which
        `finish` waits for; nothing here waits for the GPU."""
        t0 = time.perf_counter()
        live = [r for r in requests if r.k > 0 and len(r.token_ids) + r.k <= self.max_len]
        caller = torch.cuda.current_stream() if self.stream is not None else None
        if caller is not None and all(r.confirmed is None for r in requests):
            # Not a look-ahead (which is meant to run beside the verify pass): start after what
            # the caller's stream still has queued, e.g. a plain step launched ahead and then
            # dropped when the controller turned speculation back on; drafting beside a full
            # target pass stalled for a minute on an H100 (benchmarks/gpu/h100/stall).
            self.stream.wait_stream(caller)
        ids, ready = torch.full((len(requests), 0), -1, dtype=torch.int64), None
        with torch.cuda.stream(self.stream) if self.stream is not None else nullcontext():
            chain = self._launch(live) if live else None
            drafted = {r.seq_id: r.k for r in (chain.reqs if chain else [])}
            counts = [drafted.get(r.seq_id, 0) for r in requests]
            if chain is not None:
                ids = spread(chain.ids, [i for i, r in enumerate(requests) if r.seq_id in drafted], len(requests))
                # on the stream drafting (its own, or the caller's): the event follows ids and copies
                chain.host, ready = host_copies(ids=chain.ids, top_i=chain.top_i, top_p=chain.top_p)

        def finish() -> DraftOutput:
            out = {r.seq_id: ([], *one_hot([])) for r in requests}
            if chain is not None:
                if ready is not None:
                    ready.synchronize()  # the drafts only: a verify pass queued after them runs on
                self._finish(chain, out)
            took = time.perf_counter() - t0
            if took > 1.0:  # a step is milliseconds: say what this one was asked to do
                log.warning("draft call took %.1f s: %d rows, k %s, longest row %d tokens", took, len(live),
                            sorted({r.k for r in live}), max((len(r.token_ids) for r in live), default=0))
            toks, q_ids, q_probs = zip(*(out[r.seq_id] for r in requests)) if requests else ((), (), ())
            return DraftOutput(list(toks), list(q_ids), list(q_probs), time.perf_counter() - t0)

        return PendingDrafts(ids, counts, ready, finish)

    def _launch(self, reqs: list[DraftRequest]) -> _Chain | None:
        keep = {r.seq_id for r in reqs}
        handles = {r.seq_id: self._handle(r.seq_id, keep) for r in reqs}
        # blocks for the new tokens and the drafts; a row the pool cannot hold drafts nothing
        reqs = [r for r in reqs if self._room(handles[r.seq_id], len(r.token_ids) + r.k, keep)]
        if not reqs:
            return None
        kv_rows, lens, feed = [], [], []
        for r in reqs:
            n = self.state[r.seq_id][1].common_prefix(r.token_ids)
            n = min(n, len(r.token_ids) - 1)  # always feed at least one token to get logits
            kv_rows.append(handles[r.seq_id].row)
            lens.append(n)
            feed.append(r.token_ids[n:])
        logits = self._catch_up(kv_rows, lens, feed)
        lens = [n + len(f) for n, f in zip(lens, feed)]
        chain = _Chain(reqs, [handles[r.seq_id] for r in reqs], [len(r.token_ids) for r in reqs])
        if all(r.params.greedy for r in reqs):
            chain.ids = self._greedy_chain(reqs, kv_rows, lens, logits)
        else:
            chain.ids, chain.top_i, chain.top_p = self._sampled_chain(reqs, kv_rows, lens, logits)
        return chain

    def _finish(self, chain: _Chain, out: dict) -> None:
        """The drafts on the host: each row's tokens and proposals, and the drafter's state
        (the tokens whose KV it now holds: the last draft was never fed)."""
        host = chain.host["ids"].numpy()
        ids = host.tolist()
        # greedy rows' one-hot proposals: views of one array each, not two arrays a row
        one_ids, ones = host.astype(np.int32)[..., None], np.ones((host.shape[1], 1), np.float32)
        ones.flags.writeable = False
        top_i, top_p = (None if t is None else t.numpy() for t in (chain.host["top_i"], chain.host["top_p"]))
        for b, r in enumerate(chain.reqs):
            drafts = ids[b][: r.k]
            self.state[r.seq_id] = (chain.handles[b], _Held(r.token_ids, chain.sizes[b], drafts[:-1]))
            if top_i is not None and not r.params.greedy:
                out[r.seq_id] = (drafts, top_i[b, : r.k].astype(np.int32), top_p[b, : r.k])
            else:
                out[r.seq_id] = (drafts, one_ids[b, : r.k], ones[: r.k])

    def _greedy_chain(self, reqs, kv_rows, lens, logits) -> torch.Tensor:
        """Every row's argmax fed back on the device, step after step: [B, max k] drafts (-1
        past a row's k); a host round trip a step would double a small model's step."""
        ks = [r.k for r in reqs]
        if len(set(ks)) == 1 and ks[0] > 1 and len(reqs) <= CHAIN_ROWS:  # one graph replay for the chain
            out = self.runner.chain(kv_rows, lens, logits.argmax(-1), ks[0])
            if out is not None:
                return out.clone()  # the graph's buffer: the next chain replays into it
        out = torch.full((len(reqs), max(ks)), -1, dtype=torch.int64, device=logits.device)
        out[:, 0] = logits.argmax(-1)
        rows = list(range(len(reqs)))
        for step in range(1, max(ks)):
            rows = [b for b in rows if ks[b] > step]
            if not rows:
                break
            at = None if len(rows) == len(reqs) else device_ints(rows, out.device)
            fed = out[:, step - 1] if at is None else out[at, step - 1]
            sub = self.runner.decode([kv_rows[b] for b in rows], [lens[b] for b in rows], fed).argmax(-1)
            if at is None:
                out[:, step] = sub
            else:
                out[at, step] = sub
            for b in rows:
                lens[b] += 1
        return out

    def _sampled_chain(self, reqs, kv_rows, lens, logits) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Each row samples from its top-K-truncated distribution by the inverse CDF of one
        uniform keyed by its seed and the draft's position (draft_uniforms), fed back on the
        device; greedy rows take the argmax. Returns drafts [B, max k] and each draft's
        support and probabilities [B, max k, K] (past a row's k: unused)."""
        dev, kmax = logits.device, max(r.k for r in reqs)
        greedy = device_values([r.params.greedy for r in reqs], torch.bool, dev)
        keys = device_values(draft_keys(reqs), torch.int64, dev)
        at = device_values([len(r.token_ids) for r in reqs], torch.int64, dev)  # the first draft's position
        toks, tis, tps = [], [], []
        for step in range(kmax):
            tok, top_i, top_p = _sample(logits, [r.params for r in reqs], keys, at + step, greedy)
            toks.append(tok)
            tis.append(top_i)
            tps.append(top_p)
            rows = [b for b, r in enumerate(reqs) if r.k > step + 1]
            if not rows:
                break
            sel = None if len(rows) == len(reqs) else device_ints(rows, dev)  # not a list: that copy waits
            fed = toks[-1] if sel is None else toks[-1][sel]
            sub = self.runner.decode([kv_rows[b] for b in rows], [lens[b] for b in rows], fed).to(logits.dtype)
            if sel is None:
                logits = sub
            else:
                logits = logits.clone()
                logits[sel] = sub
            for b in rows:
                lens[b] += 1
        pad = kmax - len(toks)  # every row's k was reached early: nothing drafted past it
        ids = torch.nn.functional.pad(torch.stack(toks, 1), (0, pad), value=-1)
        ks = device_values([r.k for r in reqs], torch.int64, dev)
        ids.masked_fill_(torch.arange(kmax, device=dev) >= ks[:, None], -1)  # a row's draws past its k
        return ids, torch.stack(tis + tis[-1:] * pad, 1), torch.stack(tps + tps[-1:] * pad, 1)

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
            if rows == list(range(len(feed))):  # fp32: graph passes give the head's dtype, eager ones fp32
                return part.float()
            if logits is None:
                logits = part.new_empty((len(feed), part.shape[-1]), dtype=torch.float32)
            # rows as a device tensor: indexing by a list copies it from pageable memory, which waits for the pass
            logits[device_ints(rows, logits.device)] = part.float()
        return logits


def _sample(logits: torch.Tensor, params: list, keys: torch.Tensor, positions: torch.Tensor, greedy: torch.Tensor):
    """One draft a row from its top-K-truncated distribution by the inverse CDF of the uniform
    keyed by its seed and the draft's position (draft_uniforms); greedy rows take the argmax:
    (tokens [B], support [B, K], probabilities [B, K])."""
    probs = target_probs(logits, params)
    top_p, top_i = probs.topk(min(TOPK, probs.shape[-1]), dim=-1)
    top_p = top_p / top_p.sum(-1, keepdim=True)
    j = pick(top_p, draft_uniforms(keys, positions)).masked_fill(greedy, 0)
    return top_i.gather(-1, j[:, None])[:, 0], top_i, top_p


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
