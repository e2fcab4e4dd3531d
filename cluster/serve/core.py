"""The engine core: the engine and its step loop in a process of their own.

A verifier replica's process runs Serve's machinery: its asyncio loop, the streaming of each
request's outputs, pickling. Sharing a GIL with the engine's steps, both slow down
(benchmarks/gpu/serve_scale). So the engine lives in an
`EngineCore` Ray actor beside the replica, on the replica's node and GPU, and the two speak
ZeroMQ over Unix sockets, msgpack-encoded, as vLLM's API server and engine core do:

- replica -> core: `add`, `abort`, `stats`, `inflight`, `pause`, `stop`; applied between steps,
  in order;
- core -> replica: one `step` message per engine step carrying every row's new tokens, the
  step's observations and KV prefix changes; `refused`, `stats` (an answer), `dead`. The text
  of a row without stop strings is not decoded here: the replica's reader thread decodes it
  (CoreClient), in its own process, while this loop runs the next step.

The core runs steps back to back on one thread and never waits for the replica. Ray owns the
actor through the replica: when the replica goes, the core goes; when the core dies, the
replica's health check fails and the router fails its streams over (cluster.serve.calls).
"""

from __future__ import annotations

import dataclasses
import logging
import time
import traceback

import msgpack
import zmq

from cluster.engine.distributed.parallel import RankFailure
from cluster.engine.engine import Engine
from cluster.engine.logprobs import TokenLogprob
from cluster.engine.observation import StepObservation
from cluster.engine.requests import RequestLimits
from cluster.engine.sampling import InvalidRequest, SamplingParams
from cluster.engine.scheduling.scheduler import QueueFull
from cluster.engine.scheduling.sequence import RequestOutput, SpecParams

log = logging.getLogger(__name__)
IDLE_POLL_MS = 50  # an idle core wakes this often (remote drafters flush their releases)


def pack(msg) -> bytes:
    return msgpack.packb(msg, use_bin_type=True)


def unpack(data: bytes):
    return msgpack.unpackb(data, raw=False, strict_map_key=False)


# ---- what crosses, both ways ---------------------------------------------------------------
def encode_add(sid: str, prompt_ids: list[int], params: SamplingParams, spec: SpecParams, drafter: str | None):
    return ["add", sid, prompt_ids, dataclasses.asdict(params), [spec.mode, spec.gamma], drafter]


def decode_add(msg) -> tuple:
    _, sid, ids, params, spec, drafter = msg
    return sid, ids, SamplingParams(**params), SpecParams(*spec), drafter


def encode_output(o: RequestOutput) -> list:
    lps = None if o.logprobs is None else [[lp.token_id, lp.logprob, [list(t) for t in lp.top]] for lp in o.logprobs]
    return [o.seq_id, o.token_ids, o.text, o.finished, o.finish_reason, o.num_prompt, o.stats, lps]


def decode_output(row: list) -> RequestOutput:
    sid, ids, text, finished, reason, num_prompt, stats, lps = row
    if lps is not None:
        lps = [TokenLogprob(t, lp, [tuple(x) for x in top]) for t, lp, top in lps]
    return RequestOutput(sid, ids, text, finished, reason, num_prompt, stats, lps)


def decode_observation(fields: list) -> StepObservation:
    return StepObservation(*fields)


def limits_of(info: dict) -> RequestLimits:
    lim = dict(info["limits"])
    lim["drafters"] = tuple(lim["drafters"]) if lim["drafters"] is not None else None
    return RequestLimits(**lim)


def engine_info(engine: Engine) -> dict:
    """What the replica needs to know of the engine without asking again (model_info, limits)."""
    m = engine.model.shape
    return {"vocab_size": m.vocab_size, "max_model_len": engine.max_model_len, "attention_backend": engine.backend,
            "block_size": engine.cfg.block_size, "drafters": sorted(engine.drafters),
            "limits": dataclasses.asdict(engine.limits), "max_num_seqs": engine.cfg.max_num_seqs,
            "max_waiting": engine.cfg.max_waiting, "prefix_caching": engine.kv.pool.prefix_caching}


class CoreLoop:
    """Steps the engine back to back and speaks to the replica through two sockets: `inbox`
    (PULL) and `outbox` (PUSH). Runs on the thread that calls `run` (the actor's, or a test's)."""

    def __init__(self, engine: Engine, inbox: zmq.Socket, outbox: zmq.Socket, on_idle=None):
        self.engine, self.inbox, self.outbox, self.on_idle = engine, inbox, outbox, on_idle
        engine.detokenize = False  # the client's process decodes (CoreClient): off this loop's critical path
        self.live: set[str] = set()  # requests the replica still waits on
        self.obs: list[list] = []
        self.kv: tuple[list[int], list[int]] = ([], [])
        self.stopped = False
        self.paused = False  # no steps; requests and aborts are still taken (draining, weight swaps)
        self.busy_s = 0.0  # in engine.step
        self.host_s = 0.0  # with work to do but outside a step: the inbox, sending outputs
        engine.on_verify = lambda o: self.obs.append(dataclasses.astuple(o))
        pool = engine.kv.pool
        pool.on_change = lambda stored, evicted: (self.kv[0].extend(stored), self.kv[1].extend(evicted))

    def run(self) -> None:
        """Until a `stop` message, or a lost tensor-parallel rank (told to the replica as
        `dead`, then raised: no later step can run)."""
        while not self.stopped:
            t0 = time.perf_counter()
            busy = self.engine.has_work and not self.paused
            self._take_inbox(wait_ms=0 if busy else IDLE_POLL_MS)
            if self.stopped:
                break
            if not self.engine.has_work or self.paused:
                if self.on_idle and not self.engine.has_work:
                    self.on_idle()
                continue
            started = time.perf_counter()
            if busy:
                self.host_s += started - t0
            try:
                outs = self.engine.step()
            except RankFailure as e:
                log.error("a tensor-parallel rank is gone: %s", e)
                for sid in self.live:  # free what they held: nothing runs on this group again
                    self.engine.abort(sid)
                self._send(["dead", str(e), True])
                raise
            except Exception as e:  # a broken step fails the requests in flight; the core serves on
                log.error("engine step failed: %s", traceback.format_exc())
                self._fail_all(e)
                continue
            ended = time.perf_counter()
            self.busy_s += ended - started
            self.live.difference_update(o.seq_id for o in outs if o.finished)
            s = self.engine.scheduler
            self._send(["step", [encode_output(o) for o in outs],
                        self.obs, [self.kv[0], self.kv[1]], len(s.running), len(s.waiting),
                        self.engine.kv.pool.stats.hit_rate, time.time()])
            self.obs, self.kv = [], ([], [])
            self.host_s += time.perf_counter() - ended

    def _send(self, msg) -> None:
        self.outbox.send(pack(msg))

    def _take_inbox(self, wait_ms: int) -> None:
        """Every message since the last step, in the order sent (an abort follows its add)."""
        if wait_ms and not self.inbox.poll(wait_ms):
            return
        while True:
            try:
                msg = unpack(self.inbox.recv(zmq.NOBLOCK))
            except zmq.Again:
                return
            self._apply(msg)

    def _apply(self, msg) -> None:
        kind = msg[0]
        if kind == "add":
            sid, ids, params, spec, drafter = decode_add(msg)
            try:
                self.engine.enqueue(ids, params, spec, drafter, sid)  # checked at the router
                self.live.add(sid)
            except (InvalidRequest, QueueFull) as e:  # a full queue, a request id in flight
                self._send(["refused", sid, "invalid" if isinstance(e, InvalidRequest) else "exhausted", str(e)])
        elif kind == "abort":
            self.live.discard(msg[1])
            self.engine.abort(msg[1])
        elif kind == "stats":
            self._send(["stats", msg[1], self.stats()])
        elif kind == "inflight":
            self.engine.cluster_inflight = msg[1]
            if self.engine.controller:
                self.engine.controller.set_num_verifier_replicas(max(1, msg[2]))
        elif kind == "pause":
            self.paused = bool(msg[1])
        elif kind == "stop":
            self.stopped = True

    def stats(self) -> dict:
        s = self.engine.stats()
        ctrl = self.engine.controller
        s["gamma"] = ctrl.snapshot().get("gamma", 0) if ctrl else self.engine.cfg.gamma
        s["step_busy_s"], s["core_host_s"] = self.busy_s, self.host_s
        return s

    def _fail_all(self, error: Exception) -> None:
        for sid in list(self.live):
            self.engine.abort(sid)
        self._send(["failed", sorted(self.live), f"{type(error).__name__}: {error}"])
        self.live.clear()


def bind_pair(ctx: zmq.Context, inbox_addr: str, outbox_addr: str) -> tuple[zmq.Socket, zmq.Socket]:
    inbox, outbox = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    for s in (inbox, outbox):
        s.setsockopt(zmq.LINGER, 0)
    outbox.setsockopt(zmq.SNDHWM, 0)  # never drop or block a step's outputs
    inbox.bind(inbox_addr)
    outbox.bind(outbox_addr)
    return inbox, outbox
