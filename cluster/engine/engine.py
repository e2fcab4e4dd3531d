"""The engine loop: schedule, run one target pass, accept, stream. No Ray in here.

    outputs = engine.step()   # prefill chunks, or one draft call + one verify pass (or both: mixed_prefill)

Each verify row is [last token, d_1 .. d_g]; the target's logits at those g+1 positions
decide, by rejection sampling, how many drafts stand and which token follows. The sequence
then keeps KV for the accepted tokens only: rolling back rejected drafts is moving a length
(and giving back the blocks past it, cluster.engine.scheduling.scheduler).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from pathlib import Path

import torch

from cluster.engine.config import EngineConfig
from cluster.engine.distributed.ranks import ParallelRunner
from cluster.engine.drafters.base import Drafter, DraftOutput
from cluster.engine.generate import from_pretrained, run_to_completion
from cluster.engine.logprobs import accepted_logprobs
from cluster.engine.observation import StepObservation, engine_stats, observation
from cluster.engine.requests import RequestLimits, validate_request
from cluster.engine.sampling import InvalidRequest, SamplingParams
from cluster.engine.scheduling.hashing import model_seed
from cluster.engine.scheduling.kv_cache import KVCache
from cluster.engine.scheduling.scheduler import Scheduler
from cluster.engine.scheduling.sequence import RequestOutput, Sequence, SpecParams, tokens_left
from cluster.engine.spec.acceptance import Accepted, accept
from cluster.engine.spec.ahead import SpecPipeline
from cluster.engine.spec.aux_hidden import accepted_rows, keep_aux, keep_hidden
from cluster.engine.spec.drafting import DraftPlanner
from cluster.engine.stopping import Detokenizer
from cluster.engine.worker import fp8
from cluster.engine.worker.attention import make_backend
from cluster.engine.worker.memory import num_kv_blocks
from cluster.engine.worker.model import CausalLM, compile_kernels
from cluster.engine.worker.runner import Runner
from cluster.engine.worker.tree import keep_path


class Engine:
    def __init__(self, model: CausalLM, tokenizer, cfg: EngineConfig, drafters: dict[str, Drafter] | None = None,
                 default_drafter: str | None = None, identity: str = "model"):
        self.cfg, self.model, self.tokenizer = cfg, model, tokenizer
        s = model.shape
        self.max_model_len = min(cfg.max_model_len, s.max_positions)
        p = next(model.parameters())
        if model.backend is None:
            model.backend = make_backend(cfg.attention, p.device, p.dtype)
        # the target passes capture what an EAGLE-3 drafter reads (before any graph is captured)
        aux = {d.aux_layers for d in (drafters or {}).values() if d.aux_layers}
        if len(aux) > 1:
            raise ValueError(f"drafters read different target layers {sorted(aux)}; one EAGLE-3 head per engine")
        model.aux_layers = aux.pop() if aux else ()
        t_start, self.startup = time.perf_counter(), {}  # seconds by phase (the log's start-up line)
        if cfg.compile and p.device.type == "cuda":
            compile_kernels(cfg.compile_cache_dir)
        # spare positions past max_model_len take the padded writes of short rows and steps launched ahead (kv_cache)
        max_tokens = self.max_model_len + max(cfg.prefill_chunk, 2 * cfg.gamma_max + 2) + 1
        kv_dtype = fp8.FP8 if cfg.kv_cache_dtype == "fp8" else p.dtype
        blocks = num_kv_blocks(model, cfg, kv_dtype, max_tokens)
        need = -(-max_tokens // cfg.block_size)
        if blocks < need:
            raise ValueError(f"the KV cache holds {blocks} blocks of {cfg.block_size} tokens, less than one "
                             f"sequence of max_model_len {self.max_model_len} needs ({need}): raise "
                             f"engine.kv_cache_gb or gpu_memory_utilization, or lower max_model_len")
        self.kv = KVCache(s.layers, blocks, cfg.block_size, s.kv_heads, s.head_dim, kv_dtype, p.device,
                          cfg.max_num_seqs, max_tokens, model_seed(identity), cfg.prefix_caching)
        graph_width = cfg.gamma_max + 1 if cfg.cuda_graphs else 0  # where the device captures (Runner)
        # prefill graphs up to 2048 padded tokens: past that a pass's GPU work hides an eager pass's host work
        graphs = (graph_width, cfg.prefill_chunk, min(cfg.max_batch_tokens, 2048))
        if model.group is not None:  # rank 0 of a tensor-parallel group: its passes lead the others'
            self.runner = ParallelRunner(model, self.kv, cfg.attention, model.group, *graphs)
        else:
            self.runner = Runner(model, self.kv, cfg.attention, *graphs)
        if cfg.kv_cache_dtype == "fp8":  # through the runner: a tensor-parallel one calibrates every rank
            self.runner.calibrate(fp8.calibration_tokens(tokenizer))
        self.backend = model.backend.name
        self.pipeline = self.runner.ahead  # the runner's launch-ahead mode (None without graphs)
        self.scheduler = Scheduler(cfg, self.kv, mixed=cfg.mixed_prefill and self.runner.can_mix)
        self.drafters, self.default_drafter = drafters or {}, default_drafter
        self.planner = DraftPlanner(self.drafters, default_drafter)
        self.spec_ahead = SpecPipeline.build(self.pipeline, self.drafters, cfg.gamma_max) if cfg.spec_ahead else None
        self.scheduler.ahead_room = 2 * cfg.gamma_max + 2 if self.spec_ahead else 0
        self.startup["memory_s"] = time.perf_counter() - t_start  # the KV pool, sized by a pass (compiles)
        if p.device.type == "cuda" or self.runner.graphs is not None:  # compiled pieces, GEMV tuning and graphs now
            self.runner.warm_up(mixed=self.scheduler.mixed)
            self.startup.update(getattr(self.runner, "warmup", None) or {})
            t = time.perf_counter()
            for d in self.drafters.values():
                d.warm_up(cfg.gamma_max + 1)  # a step asks at most that many (a look-ahead's)
            self.startup["drafters_s"] = time.perf_counter() - t
        self.eos = tokenizer.eos_token_id
        self.seqs: dict[str, Sequence] = {}
        self._controller = None
        self.cluster_inflight = 0  # requests in flight cluster-wide, set by the serving layer
        self.on_verify: Callable[[object], None] | None = None  # StepObservation hook (metrics, autoscaling)
        self.detokenize = True  # False: text only where stop strings need it (cluster.serve.core_client decodes)
        self._ids, self._last_end = itertools.count(), None  # _last_end: the last verify step's end
        # draft / verify (with acceptance) / mixed seconds as steps observe them (_observe); ends by finishing / abort
        self.totals = {"steps": 0, "prefill_steps": 0, "verify_steps": 0, "drafted": 0, "accepted": 0, "tokens": 0,
                       "finished": 0, "aborted": 0, "draft_s": 0.0, "verify_s": 0.0, "mixed_steps": 0, "mixed_s": 0.0}

    @property
    def controller(self):
        """cluster.policy Controller for 'auto' requests; None: cfg.gamma."""
        return self._controller

    @controller.setter
    def controller(self, ctrl) -> None:
        self._controller = ctrl
        if ctrl is not None and hasattr(ctrl, "plain_runs_ahead"):  # it prices gamma 0, and a switch up
            ctrl.plain_runs_ahead, ctrl.spec_runs_ahead = self.pipeline is not None, self.spec_ahead is not None
            auto = lambda: [s for s in self.scheduler.running if s.spec.mode == "auto"]  # noqa: E731
            ctrl.drafter_lag = lambda: self.planner.lag(auto())
            ctrl.tokens_left = lambda: tokens_left(auto(), self.max_model_len)

    @classmethod
    def from_pretrained(cls, target: str | Path, draft: str | Path | None = None, drafter: str | None = "model",
                        cfg: EngineConfig | None = None) -> "Engine":  # cluster.engine.generate
        return from_pretrained(cls, target, draft, drafter, cfg or EngineConfig())

    def close(self) -> None:  # a tensor-parallel engine's follower ranks stop (one process: nothing)
        if isinstance(self.runner, ParallelRunner):
            self.runner.close()

    # ---- requests ------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    spec: SpecParams | None = None, drafter: str | None = None, request_id: str | None = None) -> str:
        params, spec = params or SamplingParams(), spec or SpecParams()
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        validate_request(ids, params, spec, drafter, self.limits)
        return self.enqueue(ids, params, spec, drafter, request_id or f"req-{next(self._ids)}")

    def enqueue(self, ids: list[int], params: SamplingParams, spec: SpecParams, drafter: str | None, sid: str) -> str:
        """A request its edge has checked (cluster.engine.requests; the serving path's router):
        only what the engine's memory depends on is asserted here."""
        assert ids and len(ids) < self.max_model_len, "prompt length unchecked at the edge"
        if sid in self.seqs:
            raise InvalidRequest(f"request id {sid!r} is already in flight")
        seq = Sequence(sid, ids, params, spec, drafter)
        # a seeded row's draws on the device (unseeded ones share the default: sampling.fill_draws)
        seq.generator = None if params.seed is None else torch.Generator(self.kv.tables.device).manual_seed(params.seed)
        seq.detok = Detokenizer(self.tokenizer, params.stop)
        self.scheduler.add(seq)
        self.seqs[sid] = seq
        return sid

    def abort(self, seq_id: str) -> None:
        seq = self.seqs.pop(seq_id, None)
        if seq is not None:
            self._release(seq, "abort")

    @property
    def limits(self) -> RequestLimits:
        """What a request may ask of this engine (every ingress checks the same)."""
        return RequestLimits(self.max_model_len, self.cfg.gamma_max, self.model.shape.vocab_size,
                             tuple(self.drafters))

    @property
    def has_work(self) -> bool:
        return bool(self.scheduler.waiting or self.scheduler.running)

    # ---- the step ------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        start = time.perf_counter()
        self.totals["steps"] += 1
        rows, chunks = self.scheduler.schedule(self._gammas)
        obs = None
        if rows:  # verify rows, and with mixed_prefill prompt chunks in the same pass
            touched, obs = self._verify(rows, chunks)
        else:  # prompts only (or nothing): every decoding row waits a step (unless mixed_prefill)
            self.totals["prefill_steps"] += bool(chunks)
            touched = self._prefill(chunks) if chunks else []
        outs = [self._output(s) for s in touched]
        end = time.perf_counter()
        if obs is not None:
            self._observe(obs, start, end)
        self._last_end = end if obs is not None else None
        return outs

    def _observe(self, obs: StepObservation, start: float, end: float) -> None:
        # a period runs from the end of the verify step before (the caller's work counts); after a prefill or idle, afresh
        if self._last_end is not None and start - self._last_end < end - start:
            start = self._last_end
        obs.step_s = end - start
        self.totals["draft_s"] += obs.draft_s
        self.totals["mixed_s" if obs.prefill_tokens else "verify_s"] += obs.verify_s
        self.totals["mixed_steps"] += bool(obs.prefill_tokens)
        if self.controller and not obs.captured and not obs.prefill_tokens:
            self.controller.observe(obs)
        if self.on_verify:
            self.on_verify(obs)

    def _prefill(self, chunks: list[tuple[Sequence, int]]) -> list[Sequence]:
        seqs = [s for s, _ in chunks]
        feeds = [s.token_ids[s.num_cached:s.num_cached + n] for s, n in chunks]
        return self._prefilled(chunks, *self.runner.forward([s.kv.row for s in seqs], [s.num_cached for s in seqs],
                                                            feeds, True, hidden=True, aux=True))

    def _prefilled(self, chunks: list[tuple[Sequence, int]], logits, hidden, aux) -> list[Sequence]:
        """After a pass over prefill chunks: logits and hidden at each chunk's last token, aux at all."""
        seqs, done = [s for s, _ in chunks], []
        for b, (seq, n) in enumerate(chunks):
            if aux is not None and self._reads_aux(seq):
                keep_aux(seq, seq.num_cached, aux[b, :n])
            seq.num_cached += n
            self.scheduler.settle(seq)
            if seq.prefilled and not seq.num_output:  # a fresh prompt's last position: its first token
                done.append(b)
        if not done:
            return []
        rows = [seqs[b] for b in done]
        last = logits[done][:, None]
        first = self._acceptance(rows, last, DraftOutput([[]] * len(done), [], []))
        lps = accepted_logprobs([s.params.logprobs for s in rows], last, first)
        return self._keep_hidden(self._accept(rows, first.tokens, [0] * len(done), lps), hidden[done])

    def _gammas(self) -> dict[str, int]:
        rows = [s for s in self.scheduler.running if s.prefilled]
        auto = self.controller.gamma(len(rows), self.cluster_inflight) if self.controller else self.cfg.gamma
        out, gamma_max, default = {}, self.cfg.gamma_max, self.default_drafter
        for s in rows:
            g = 0 if s.spec.mode == "off" else s.spec.gamma if s.spec.mode == "fixed" else auto
            has_drafter = (s.drafter or default) is not None
            out[s.seq_id] = max(0, min(g, gamma_max, self._left(s) - 1)) if g and has_drafter else 0
        return out

    def _verify(self, rows: list[tuple[Sequence, int]], chunks: list[tuple[Sequence, int]]
                ) -> tuple[list[Sequence], StepObservation]:
        """Draft, one target pass, acceptance: over verify rows, and over prompt chunks in the
        same pass where the scheduler mixed them in (eager: no CUDA graph covers a mixed pass).
        Plain rows on CUDA graphs run a step ahead instead (cluster.engine.worker.pipeline)."""
        if not chunks and (ahead := self._verify_ahead(rows)) is not None:
            return ahead
        seqs = [s for s, _ in rows]
        if self.spec_ahead is not None:
            self.spec_ahead.interrupt(seqs)
        graphs = self._graphs_captured()
        t0 = time.perf_counter()
        # drafts left on the device (launched) feed the verify pass there: one wait for both
        drafts, launched = self.planner.start(rows, not chunks and self.runner.carries_drafts)
        t1 = time.perf_counter()
        # launched: each row's width only, its drafts come in on the device
        news = drafts.tokens if launched is None else [[0] * n for n in launched.counts]
        feeds = [[s.token_ids[-1]] + d for s, d in zip(seqs, news)]
        pipelined = not chunks and launched is None and not any(drafts.tokens) and self._pipelined(seqs)
        first, waited = [], 0.0  # waited: for launched drafts, once the verify pass is queued
        if pipelined:  # rows that joined after the step launched ahead wait for the next one
            seqs, out, pipelined = self.pipeline.step(seqs, launch_next=any(self._left(s) > 1 for s in seqs))
            feeds = [[s.token_ids[-1]] for s in seqs]
            accepted = self._accept(seqs, out, [0] * len(seqs))
        else:
            if self.pipeline is not None:
                self.pipeline.interrupt()
            verify = ([s.kv.row for s in seqs], [s.num_cached for s in seqs], feeds)
            if chunks:
                pre = [s for s, _ in chunks]
                prefill = ([s.kv.row for s in pre], [s.num_cached for s in pre],
                           [s.token_ids[s.num_cached:s.num_cached + n] for s, n in chunks])
                passed, prefilled = self.runner.forward_mixed(verify, prefill, drafts.parents)
            else:
                passed = self.runner.forward(*verify, last_only=False, trees=None if launched else drafts.parents,
                                             hidden=True, aux=True, carried=launched.ids if launched else None)
            if launched is not None:  # the host reads the drafts while the verify pass runs
                drafts, waited = launched.finish(), launched.waited
            if any(drafts.tokens):  # on a GPU the verify pass runs meanwhile
                self.planner.ask_ahead(rows, drafts)
            accepted, out = self._verified(seqs, drafts, *passed)
            if chunks:
                first = self._prefilled(chunks, *prefilled)
        t2 = time.perf_counter()
        num_prefill = sum(n for _, n in chunks)
        num_draft = [len(d) for d in drafts.tokens]
        obs = observation(len(seqs), sum(map(len, feeds)) + num_prefill, t2 - t1 - waited, t1 - t0 + waited,
                          num_draft, [len(o) - 1 for o in out], pipelined)
        # not a cost of verifying at this gamma (the controller skips them): a pass with prompt chunks or a graph capture
        obs.prefill_tokens = num_prefill
        obs.captured = self._graphs_captured() != graphs
        return accepted + first, obs

    def _verify_ahead(self, rows: list[tuple[Sequence, int]]) -> tuple[list[Sequence], StepObservation] | None:
        """A step launched ahead (cluster.engine.spec.ahead) where all of `rows` can take one; None: the usual way."""
        seqs, gammas = [s for s, _ in rows], [g for _, g in rows]
        name = self.spec_ahead and self.spec_ahead.drafter_for(seqs, gammas, self.default_drafter)
        if not name or not self._pipelined(seqs):
            return None
        graphs = self._graphs_captured()
        self.planner.drop_ahead(name)
        self.pipeline.interrupt()
        # a probe's last step (plain decoding next, the controller says): a step launched after it would be dropped
        last = getattr(self.controller, "ends_speculation", False) and all(
            s.spec.mode == "auto" or not g for s, g in zip(seqs, gammas))
        run, out, num_draft = self.spec_ahead.step(seqs, gammas, [self._left(s) for s in seqs], name, not last)
        if not run:
            return None
        accepted = self._accept(run, out, num_draft)
        # on the GPU's clock: the host's wall time can be a launch done or two passes (benchmarks/gpu/tp/sweep_h200)
        obs = observation(len(run), sum(num_draft) + len(run), self.spec_ahead.verify_s, self.spec_ahead.draft_s,
                          num_draft, [len(o) - 1 for o in out])
        obs.captured = self._graphs_captured() != graphs
        return accepted, obs

    def _verified(self, seqs: list[Sequence], drafts: DraftOutput, logits, hidden, aux) -> tuple[list, list]:
        """Acceptance after a verify pass over [last token] + drafts rows: (sequences, their new tokens)."""
        result = self._acceptance(seqs, logits, drafts)
        if drafts.parents is not None:  # tree rows: the accepted path's K/V moves up behind the root
            for b, s in enumerate(seqs):
                if drafts.parents[b] is not None:
                    keep_path(self.kv, s.kv, s.num_cached, result.paths[b])
        ends = [result.last_fed(b) for b in range(len(seqs))]
        for b, s in enumerate(seqs):  # the accepted positions' aux states, before num_cached moves
            if aux is not None and self._reads_aux(s):
                keep_aux(s, s.num_cached, aux[b, accepted_rows(result.paths[b])])
        lps = accepted_logprobs([s.params.logprobs for s in seqs], logits, result)
        accepted = self._keep_hidden(self._accept(seqs, result.tokens, [len(d) for d in drafts.tokens], lps), hidden, ends)
        return accepted, result.tokens

    def _graphs_captured(self) -> int:
        runners = [self.runner] + [getattr(d, "runner", None) for d in self.drafters.values()]
        return sum(len(r.graphs.graphs) for r in runners if getattr(r, "graphs", None) is not None)

    def _pipelined(self, seqs: list[Sequence]) -> bool:
        """Plain decoding on CUDA graphs runs a step ahead (cluster.engine.worker.pipeline), but
        not for what that path keeps none of: logits (logprobs), the hidden or aux states a row's
        drafter reads (another row's drafter may: Medusa beside the model drafter)."""
        return (self.pipeline is not None and self.pipeline.eligible(seqs)
                and all(s.params.logprobs is None and not self._reads_aux(s, hidden=True) for s in seqs))

    def _reads_aux(self, seq: Sequence, hidden: bool = False) -> bool:
        """This sequence's drafter reads the target's aux hidden states (EAGLE-3), or with
        `hidden` its last hidden state (Medusa) too."""
        d = self.drafters.get(seq.drafter or self.default_drafter or "")
        return d is not None and (bool(d.aux_layers) or hidden and d.reads_hidden) and seq.spec.mode != "off"

    def _left(self, seq: Sequence) -> int:
        return min(seq.params.max_tokens - seq.num_output, self.max_model_len - len(seq.token_ids))

    @staticmethod
    def _acceptance(seqs: list[Sequence], logits: torch.Tensor, drafts: DraftOutput) -> Accepted:
        return accept(logits, [s.params for s in seqs], [s.generator for s in seqs], drafts,
                      [len(s.token_ids) for s in seqs])

    def _accept(self, seqs: list[Sequence], new: list[list[int]], num_draft: list[int],
                logprobs: list | None = None) -> list[Sequence]:
        now = time.perf_counter()
        totals, settle = self.totals, self.scheduler.settle
        for b, (seq, toks, g) in enumerate(zip(seqs, new, num_draft)):
            lps = logprobs[b] if logprobs is not None else None
            stats, ids = seq.stats, seq.token_ids
            if len(ids) > len(seq.prompt_ids) and seq.prefilled:  # a verify step's row
                stats.record(g, len(toks) - 1)
                totals["verify_steps"] += 1
                totals["drafted"] += g
                totals["accepted"] += len(toks) - 1
            seq.num_cached = len(ids) - 1 + len(toks)  # fed last token + accepted drafts
            if stats.first_token is None:
                stats.first_token = now
            stats.token_times.append(now)
            for i, t in enumerate(toks):
                ids.append(t)
                if lps is not None:  # kept in step with token_ids: a stop below drops the rest of both
                    seq.logprobs.append(lps[i])
                totals["tokens"] += 1
                reason = seq.stop_reason(t, self.eos, self.max_model_len)
                if reason:
                    seq.finish_reason = reason
                    break
            if seq.finish_reason:
                self._release(seq, seq.finish_reason)
            else:
                settle(seq)
        return seqs

    def _keep_hidden(self, seqs: list[Sequence], hidden: torch.Tensor, ends: list[int] | None = None) -> list[Sequence]:
        return keep_hidden(seqs, hidden, ends) if any(d.reads_hidden for d in self.drafters.values()) else seqs

    def _release(self, seq: Sequence, reason: str) -> None:
        seq.finish_reason = reason
        self.totals["aborted" if reason == "abort" else "finished"] += 1
        self.scheduler.remove(seq)
        for d in self.drafters.values():
            d.release([seq.seq_id])

    def _output(self, seq: Sequence) -> RequestOutput:
        if seq.finished:
            self.seqs.pop(seq.seq_id, None)
        return seq.output(self.detokenize)

    def generate(self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams] | None = None,
                 spec: SpecParams | None = None, drafter: str | None = None) -> list[dict]:
        """Run prompts to completion; one dict per prompt (text, token_ids, finish_reason, spec, timing)."""
        return run_to_completion(self, prompts, params, spec, drafter)

    def stats(self) -> dict:
        return engine_stats(self)
