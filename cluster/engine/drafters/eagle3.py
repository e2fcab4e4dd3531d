"""EAGLE-3 drafting: a one-layer head over the target's own features (cluster.engine.drafters.eagle3_head).

Each request carries the target's aux hidden states of the positions the drafter has not seen
(`DraftRequest.aux`): after a verify step, those of the accepted tokens. The head keeps its own
one-layer KV per sequence for the positions the target has computed ([base, n)): a call first
runs the head over the new positions (catch-up, fed fc(aux)), which gives its output at the
position before the last token, and from there drafts, each step fed the draft token and the
head's own output at the step before. Draft steps write K/V past n, where the next catch-up
overwrites them with the target-fed ones: rejected drafts roll back for free, as the
verifier's do. A sequence whose earlier features the drafter never got (a new replica, a lost
call) starts its cache at the first position it has (`base`): rotary attention depends only
on distances, so the head runs as on a shorter context; it drafts less well, never wrongly.

Greedy rows propose their argmax chain (one-hot q). Sampled rows sample each draft from the
head's own distribution (the request's temperature, top-k, top-p over the draft vocabulary,
cut to its top-K) and return it as q, so rejection sampling stays exact and acceptance does
not collapse at temperature > 0. Where the attention backend verifies trees, greedy rows may
propose a tree instead (`tree_width` > 1, cluster.engine.drafters.eagle3_tree).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass

import torch

from cluster.engine.drafters.base import (TOPK, Drafter, DraftOutput, DraftRequest, PendingDrafts, draft_keys,
                                          draft_uniforms, empty_rows, host_copies, pick, spread)
from cluster.engine.drafters.eagle3_head import Eagle3Head
from cluster.engine.sampling import device_values, target_probs
from cluster.engine.scheduling.kv_cache import KVCache, KVHandle
from cluster.engine.worker.attention import AttnContext, make_backend
from cluster.engine.worker.capture import for_device as capture_for

BLOCK = 16  # tokens per block of the head's cache


@dataclass
class _State:
    handle: KVHandle
    base: int                          # first position in the head's cache (slot 0)
    n: int                             # positions base .. n-1 hold target-fed K/V
    tokens: list[int]                  # the sequence's tokens t_0 .. t_n as last seen
    out: torch.Tensor | None = None    # the head's output at position n-1 [D]


class Eagle3Drafter(Drafter):
    name = "eagle3"

    def __init__(self, head: Eagle3Head, num_slots: int = 64, max_len: int = 2048, attention: str = "auto",
                 tree_width: int = 0, cuda_graphs: bool = True, graph_width: int = 9):
        """max_len: longest sequence (plus drafts) it drafts for; tree_width: children per node
        of a greedy tree (0: chains only, also where the backend has no tree masks);
        graph_width: the widest catch-up pass that replays a CUDA graph (a verify row, gamma_max + 1)."""
        self.head = head
        self.aux_layers = head.cfg.aux_layers
        p = next(head.parameters())
        self.device, self.dtype = p.device, p.dtype
        if head.backend is None:
            head.backend = make_backend(attention, p.device, p.dtype)
        s = head.shape
        self.kv = KVCache(1, num_slots * -(-max_len // BLOCK), BLOCK, s.kv_heads, s.head_dim, p.dtype, p.device,
                          max_rows=num_slots, max_tokens=max_len, prefix_caching=False)
        self.max_len = self.kv.max_tokens
        self.tree_width = tree_width if getattr(head.backend, "supports_tree", False) else 0
        self.graphs = None
        capture = capture_for(p.device, head.backend) if cuda_graphs else None
        if capture is not None:
            from cluster.engine.drafters.eagle3_graphs import HeadGraphs

            self.graphs = HeadGraphs(head, self.kv, capture, graph_width)
        self.state: OrderedDict[str, _State] = OrderedDict()  # seq_id -> state, least recently used first

    def warm_up(self, max_draft: int = 0) -> None:
        if self.graphs is not None:
            self.graphs.capture_all(self.kv.max_rows)

    def release(self, seq_ids: list[str]) -> None:
        for sid in seq_ids:
            st = self.state.pop(sid, None)
            if st is not None:
                self.kv.close(st.handle)

    def lag(self, rows: list[tuple[str, list[int]]]) -> int:
        return sum(len(t) - (len(self.state[sid].tokens) if sid in self.state else 0) for sid, t in rows)

    def tokens_held(self, seq_id: str) -> list[int] | None:
        st = self.state.get(seq_id)
        return st.tokens if st is not None else None

    # ---- per-sequence state ----------------------------------------------------------------
    def _state(self, r: DraftRequest, keep: set[str]) -> _State | None:
        st = self.state.get(r.seq_id)
        # not the sequence it held (a reused id)? the tail tells: a whole-list compare per row
        # and step would cost O(context) in Python, and a wrong guess costs drafts, not tokens
        n = len(st.tokens) if st is not None else 0
        if st is not None and (len(r.token_ids) < n or r.token_ids[max(0, n - 8):n] != st.tokens[-8:]):
            self.release([r.seq_id])
            st = None
        first = r.aux_start if r.aux is not None and len(r.aux) else None
        if st is not None and first is not None and first > st.n:
            self.kv.shrink(st.handle, 0)  # a gap in its features: start again from what it has
            st.base = st.n = first
            st.out = None
        if st is None:
            if first is None:
                return None
            h = self.kv.open()
            while h is None and self._evict(keep):
                h = self.kv.open()
            if h is None:
                return None
            st = self.state[r.seq_id] = _State(h, first, first, [])
        self.state.move_to_end(r.seq_id)
        return st

    def _evict(self, keep: set[str]) -> bool:
        victim = next((s for s in self.state if s not in keep), None)
        if victim is not None:
            self.kv.close(self.state.pop(victim).handle)
        return victim is not None

    def _room(self, st: _State, positions: int, keep: set[str]) -> bool:
        if positions > self.max_len:
            return False
        while self.kv.blocks_needed(st.handle, positions) > self.kv.pool.num_free:
            if not self._evict(keep):
                return False
        self.kv.grow(st.handle, positions)
        return True

    # ---- drafting ----------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, requests: list[DraftRequest]) -> DraftOutput:
        pending = self.launch(requests)
        return pending.finish() if pending is not None else self._propose_trees(requests)

    def _trees(self, requests: list[DraftRequest]) -> bool:
        return bool(self.tree_width) and all(r.params.greedy for r in requests if r.k > 0)

    def _live(self, requests: list[DraftRequest]) -> list[tuple[int, _State]]:
        """After catching every row up: the rows that draft (index, state)."""
        keep = {r.seq_id for r in requests}
        rows, states = [], []
        for b, r in enumerate(requests):
            st = self._state(r, keep) if r.k > 0 or r.aux is not None else None
            if st is not None and r.seq_id in self.state:
                rows.append(b)
                states.append(st)
        self._catch_up([requests[b] for b in rows], states)
        return [(b, st) for b, st in zip(rows, states)
                if requests[b].k > 0 and st.out is not None and st.n == len(requests[b].token_ids) - 1
                and self._room(st, st.n - st.base + requests[b].k, keep)]

    def _propose_trees(self, requests: list[DraftRequest]) -> DraftOutput:
        from cluster.engine.drafters.eagle3_tree import draft_tree

        t0 = time.perf_counter()
        live = self._live(requests)
        tokens: list[list[int]] = [[] for _ in requests]
        parents: list[list[int] | None] = [None] * len(requests)
        if live:
            trees = draft_tree(self, [requests[b] for b, _ in live], [st for _, st in live], self.tree_width)
            for (b, _), (toks, par) in zip(live, trees):
                tokens[b], parents[b] = toks, par
        ones = [[[t] for t in toks] for toks in tokens], [[[1.0] for _ in toks] for toks in tokens]
        return DraftOutput(tokens, *empty_rows(tokens, *ones), time.perf_counter() - t0, parents)

    @torch.inference_mode()
    def launch(self, requests: list[DraftRequest]) -> PendingDrafts | None:
        """Chains drafted on the device and one copy to the host (trees: None, `propose`)."""
        if self._trees(requests):
            return None
        t0 = time.perf_counter()
        live = self._live(requests)
        counts = [0] * len(requests)
        for b, _ in live:
            counts[b] = requests[b].k
        ids, host, ready = torch.full((len(requests), 0), -1, dtype=torch.int64), None, None
        if live:
            reqs = [requests[b] for b, _ in live]
            chain, top_t, top_p = self._chain(reqs, [st for _, st in live])
            ids = spread(chain, [b for b, _ in live], len(requests))
            host, ready = host_copies(ids=chain, top_t=top_t, top_p=top_p)

        def finish() -> DraftOutput:
            tokens: list[list[int]] = [[] for _ in requests]
            q_ids: list = [[] for _ in requests]
            q_probs: list = [[] for _ in requests]
            if host is not None:
                if ready is not None:
                    ready.synchronize()
                flat = host["ids"].numpy().tolist()
                for j, (b, _) in enumerate(live):
                    r = requests[b]
                    tokens[b] = flat[j][: r.k]
                    if host["top_t"] is not None and not r.params.greedy:  # q: the cut distribution drawn from
                        q_ids[b], q_probs[b] = host["top_t"][j, : r.k].numpy(), host["top_p"][j, : r.k].numpy()
                    else:
                        q_ids[b], q_probs[b] = [[t] for t in tokens[b]], [[1.0] for _ in tokens[b]]
            return DraftOutput(tokens, *empty_rows(tokens, q_ids, q_probs), time.perf_counter() - t0)

        return PendingDrafts(ids, counts, ready, finish)

    def _catch_up(self, reqs: list[DraftRequest], states: list[_State]) -> None:
        """Run the head over each row's new target-fed positions (n .. end of its aux)."""
        feed = []
        for r, st in zip(reqs, states):
            end = r.aux_start + len(r.aux) if r.aux is not None else st.n
            new = range(st.n, min(end, len(r.token_ids) - 1))
            ok = len(new) and self._room(st, new.stop - st.base, {x.seq_id for x in reqs})
            feed.append(new if ok else range(0))
        idx = [i for i, f in enumerate(feed) if len(f)]
        if not idx:
            return
        sts = [states[i] for i in idx]
        lens = [st.n - st.base for st in sts]
        ids = [reqs[i].token_ids[feed[i].start + 1: feed[i].stop + 1] for i in idx]
        aux = [reqs[i].aux[feed[i].start - reqs[i].aux_start: feed[i].stop - reqs[i].aux_start].to(self.device)
               for i in idx]
        self.kv.sync()
        if self.graphs is not None and self.graphs.fits(len(idx), max(map(len, ids))):
            last = self.graphs.catch_up([st.handle.row for st in sts], lens, ids, aux)
        else:
            width = max(map(len, ids))
            x = torch.zeros((len(idx), width, self.head.cfg.hidden), dtype=self.dtype, device=self.device)
            pad = torch.zeros((len(idx), width), dtype=torch.int64)
            for j, (t, a) in enumerate(zip(ids, aux)):
                pad[j, : len(t)] = torch.tensor(t)
                x[j, : len(t)] = self.head.combine(a).to(self.dtype)
            out = self._pass(sts, lens, pad.to(self.device), x, list(map(len, ids)))
            last = torch.stack([out[j, len(t) - 1] for j, t in enumerate(ids)])
        for j, i in enumerate(idx):
            st, f = states[i], feed[i]
            st.out = last[j]
            st.n = f.stop
            st.tokens += reqs[i].token_ids[len(st.tokens): st.n + 1]  # token_ids[:n + 1], extended

    def _pass(self, sts: list[_State], cache_lens: list[int], ids: torch.Tensor, x: torch.Tensor,
              q_lens: list[int], tree: torch.Tensor | None = None, depth: torch.Tensor | None = None) -> torch.Tensor:
        """The head over rows of its cache: ids [B, T], x [B, T, D] -> outputs [B, T, D]."""
        rows = [st.handle.row for st in sts]
        self.kv.sync()
        ctx = AttnContext.build(self.kv, rows, cache_lens, q_lens, self.device)
        if tree is not None:  # tree nodes share positions by depth and see their ancestors only
            ctx.tree_mask, ctx.positions = tree, ctx.cache_lens[:, None] + depth
        return self.head(ids, x, ctx.positions, self.kv, ctx)

    def _step(self, sts: list[_State], cache_lens: list[int], tok: torch.Tensor, out: torch.Tensor):
        """One draft step of every row: its draft token [B] and the head's output before it [B, D]
        -> (the head's output [B, D], fp32 draft logits [B, draft_vocab], their argmax in target ids [B])."""
        if self.graphs is not None and self.graphs.fits(len(sts)):
            self.kv.sync()
            return self.graphs.step([st.handle.row for st in sts], cache_lens, tok, out)
        new = self._pass(sts, cache_lens, tok[:, None], out[:, None], [1] * len(sts))[:, 0]
        logits = self.head.logits(new)
        return new, logits, self.head.target_ids(logits.argmax(-1))

    def _chain(self, reqs: list[DraftRequest], sts: list[_State]):
        """Each row's chain of r.k drafts (target ids) on the device: [B, max k] (-1 past a row's
        k), and for sampled rows each draft's support and probabilities [B, max k, K] (else None)."""
        head, k_max = self.head, max(r.k for r in reqs)
        greedy = all(r.params.greedy for r in reqs)
        keys = None if greedy else device_values(draft_keys(reqs), torch.int64, self.device)
        at = None if greedy else device_values([len(r.token_ids) for r in reqs], torch.int64, self.device)
        out = torch.stack([st.out for st in sts])
        logits = head.logits(out)                                       # [B, draft_vocab]
        argmax = head.target_ids(logits.argmax(-1)) if greedy else None
        toks, tts, tps = [], [], []
        for step in range(k_max):
            if greedy:  # argmax fed back on the device
                tok = argmax
            else:
                tok, top_t, top_p = self._sample(reqs, logits, draft_uniforms(keys, at + step))
                tts.append(top_t)
                tps.append(top_p)
            toks.append(tok)
            if step + 1 == k_max:
                break
            out, logits, argmax = self._step(sts, [st.n - st.base + step for st in sts], tok, out)
            if greedy:
                argmax = argmax.clone()  # the graph's buffer: the next step writes it
        ids = torch.stack(toks, 1)
        ks = device_values([r.k for r in reqs], torch.int64, self.device)
        ids.masked_fill_(torch.arange(k_max, device=self.device) >= ks[:, None], -1)
        return ids, (torch.stack(tts, 1) if tts else None), (torch.stack(tps, 1) if tps else None)

    def _sample(self, reqs, logits, u):
        """Each row's draft by the uniform u [B] from its processed draft distribution cut to
        its top-K (q is exactly that cut; greedy rows: the argmax), on the device: (drafts [B],
        support in target ids [B, K], probabilities [B, K])."""
        probs = target_probs(logits, [r.params for r in reqs])
        top_p, top_i = probs.topk(min(TOPK, probs.shape[-1]), dim=-1)
        top_p = top_p / top_p.sum(-1, keepdim=True)
        top_t = self.head.target_ids(top_i)
        greedy = device_values([r.params.greedy for r in reqs], torch.bool, top_p.device)
        j = pick(top_p, u).masked_fill(greedy, 0)
        return top_t.gather(-1, j[:, None])[:, 0], top_t, top_p
