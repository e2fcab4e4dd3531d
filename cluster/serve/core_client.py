"""The replica's side of the engine core (cluster.serve.core): submit, abort, stats, and one
reader thread that turns each step message into the outputs of every request it names.

`submit` refuses at once what can be refused without the engine (bad input, a full engine,
an id in flight) and returns an asyncio queue that gets the request's outputs, or the
exception that ended it. Nothing here waits for a step: the replica's event loop stays free
for Serve's streaming.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
import uuid
from concurrent.futures import Future
from typing import Callable

import zmq

from cluster.engine.distributed.parallel import RankFailure
from cluster.engine.sampling import InvalidRequest
from cluster.engine.scheduling.scheduler import QueueFull
from cluster.engine.stopping import Detokenizer
from cluster.serve.core import decode_observation, decode_output, encode_add, limits_of, pack, unpack

log = logging.getLogger(__name__)
POLL_MS = 100  # the reader checks for stop this often
STOP_LINGER_MS = 2000


class CoreGone(RuntimeError):
    """The engine core died or stopped: nothing in flight on it will finish."""


class CoreClient:
    """`info`: the core's engine_info. `on_step(running, waiting, hit_rate, observations,
    stored, evicted)`: called on the reader thread for every step message. `tokenizer`: the
    target's, for the text the core leaves undecoded (Engine.detokenize): the reader thread
    decodes it, in this process, while the core runs its next step."""

    def __init__(self, inbox_addr: str, outbox_addr: str, info: dict, on_step: Callable | None = None,
                 tokenizer=None):
        self.info, self.limits, self.on_step = info, limits_of(info), on_step
        self.tokenizer, self.detoks = tokenizer, {}  # request id -> its Detokenizer (text left to this side)
        self.ctx = zmq.Context()
        self.tx, self.rx = self.ctx.socket(zmq.PUSH), self.ctx.socket(zmq.PULL)
        for s in (self.tx, self.rx):
            s.setsockopt(zmq.LINGER, 0)
        self.tx.setsockopt(zmq.SNDHWM, 0)
        self.tx.connect(inbox_addr)
        self.rx.connect(outbox_addr)
        self.send_lock = threading.Lock()  # the event loop and the stats reporter both send
        self.queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self.replies: dict[int, Future] = {}
        self.tokens = itertools.count()
        self.running = self.waiting = 0
        self.hit_rate = 0.0
        self.lag_s = 0.0  # step messages: sent by the core -> fanned out here, summed
        self.messages = 0
        self.error: BaseException | None = None
        self._stop = False
        self.thread = threading.Thread(target=self._read, name="core-reader", daemon=True)
        self.thread.start()

    @property
    def alive(self) -> bool:
        return self.error is None and not self._stop

    # ---- to the core ---------------------------------------------------------------------
    def _send(self, msg) -> None:
        with self.send_lock:
            self.tx.send(pack(msg))

    def submit(self, prompt_ids, params, spec, drafter, request_id) -> tuple[str, asyncio.Queue]:
        """Raises InvalidRequest / QueueFull straight to the caller; the core takes the
        request before its next step. The request was checked at the router (admission)."""
        if len(self.queues) >= self.info["max_num_seqs"] + self.info["max_waiting"]:  # the most the engine holds
            raise QueueFull(f"admission queue full ({self.info['max_waiting']} waiting)")
        sid = request_id or f"req-{uuid.uuid4().hex[:12]}"
        if sid in self.queues:
            raise InvalidRequest(f"request id {sid!r} is already in flight")
        q: asyncio.Queue = asyncio.Queue()
        self.queues[sid] = (asyncio.get_running_loop(), q)
        self._send(encode_add(sid, list(prompt_ids), params, spec, drafter))
        return sid, q

    def abort(self, sid: str) -> None:
        self.detoks.pop(sid, None)
        if self.queues.pop(sid, None) is not None and self.alive:
            self._send(["abort", sid])

    def set_inflight(self, inflight: int, replicas: int) -> None:
        """The cluster's requests in flight and verifier replicas, for the controller."""
        self._send(["inflight", inflight, replicas])

    def pause(self, on: bool) -> Future:
        """Stop (or restart) the core's steps; the stats that answer come after it took effect."""
        if self.alive:
            self._send(["pause", on])
        return self.request_stats()

    def request_stats(self) -> Future:
        """The engine's stats, answered between steps after everything sent before."""
        fut: Future = Future()
        if not self.alive:
            fut.set_exception(CoreGone(f"engine core is down: {self.error}"))
            return fut
        token = next(self.tokens)
        self.replies[token] = fut
        self._send(["stats", token])
        return fut

    def stop(self) -> None:
        if self.alive:
            self._send(["stop"])
        self._stop = True
        self.thread.join(timeout=5)
        # linger: a `stop` still queued here is delivered, not dropped (a core that never got it
        # would step on); a dead core costs at most this wait
        self.ctx.destroy(linger=STOP_LINGER_MS)

    # ---- from the core -------------------------------------------------------------------
    def _read(self) -> None:
        while not self._stop:
            try:
                if not self.rx.poll(POLL_MS):
                    continue
                msg = unpack(self.rx.recv())
            except zmq.ZMQError:  # the context was destroyed: stopping
                return
            try:
                self._dispatch(msg)
            except Exception:  # noqa: BLE001 - a bad message must not end the reader
                log.exception("engine core message %r failed", msg[0])

    def _dispatch(self, msg) -> None:
        kind = msg[0]
        if kind == "step":
            _, rows, obs, kv, self.running, self.waiting, self.hit_rate, sent = msg
            self.lag_s += max(0.0, time.time() - sent)
            self.messages += 1
            outs = [decode_output(r) for r in rows]
            if self.on_step is not None:
                self.on_step([decode_observation(o) for o in obs], kv[0], kv[1])
            self._deliver(outs)
        elif kind == "refused":
            _, sid, why, text = msg
            self._fail([sid], InvalidRequest(text) if why == "invalid" else QueueFull(text))
        elif kind == "failed":
            self._fail(msg[1], RuntimeError(msg[2]))
        elif kind == "stats":
            fut = self.replies.pop(msg[1], None)
            if fut is not None:
                fut.set_result(msg[2])
        elif kind == "dead":
            self.gone(RankFailure(msg[1]) if msg[2] else CoreGone(msg[1]))

    def _deliver(self, outs) -> None:
        for o in outs:
            if o.text is None:
                o.text = self._text(o)
        self._route([(o.seq_id, o, o.finished) for o in outs])

    def _text(self, o) -> str:
        """The text delta of output `o` whose core left it undecoded."""
        d = self.detoks.get(o.seq_id)
        if d is None:
            if o.seq_id not in self.queues:  # aborted: nobody reads it
                return ""
            d = self.detoks[o.seq_id] = Detokenizer(self.tokenizer, [])
        for t in o.token_ids:
            d.add(t)
        text = d.delta(final=o.finished)
        if o.finished or o.seq_id not in self.queues:
            self.detoks.pop(o.seq_id, None)
        return text

    def _fail(self, sids, error: BaseException) -> None:
        for sid in sids:
            self.detoks.pop(sid, None)
        self._route([(sid, error, True) for sid in sids])

    def _route(self, items) -> None:
        """(request id, output or error, last) to each request's queue, with one wake-up of
        each event loop for all of them; a request's queue goes with its last item. Requests
        aborted meanwhile get nothing."""
        by_loop: dict[asyncio.AbstractEventLoop, list] = {}
        for sid, item, last in items:
            target = self.queues.pop(sid, None) if last else self.queues.get(sid)
            if target is not None:
                by_loop.setdefault(target[0], []).append((target[1], item))
        for loop, group in by_loop.items():
            loop.call_soon_threadsafe(_put_all, group)

    def gone(self, error: BaseException) -> None:
        """The core is dead (it said so, or its actor ended): fail everything in flight."""
        if self.error is None:
            self.error = error
        log.error("engine core is down: %s", error)
        self._fail(list(self.queues), error)
        for fut in list(self.replies.values()):
            if not fut.done():
                fut.set_exception(CoreGone(f"engine core is down: {error}"))
        self.replies.clear()


def _put_all(items) -> None:
    for q, item in items:
        q.put_nowait(item)
