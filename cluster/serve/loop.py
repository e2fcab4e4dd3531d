"""Runs `engine.step()` on its own thread and hands each request's outputs to asyncio.

The engine is single-threaded by design. The replica's event loop never waits for a step:
`submit` and `abort` leave their request in an inbox that the engine thread applies between
steps. (They used to take the step's lock, and a lock is not fair: each call waited for at
least one whole step, so 50 cancelled streams took 50 steps, seconds, to be freed, and
arrivals reached the engine slower than it finished sequences.) What can be refused at once
is refused in `submit`: a bad request, a full queue, an id already in flight.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import traceback
import uuid
from collections import deque

from cluster.engine.engine import Engine
from cluster.engine.parallel import RankFailure
from cluster.engine.requests import validate_request
from cluster.engine.sampling import InvalidRequest
from cluster.engine.scheduler import QueueFull

log = logging.getLogger(__name__)


class EngineLoop:
    def __init__(self, engine: Engine, on_idle=None):
        self.engine = engine
        self.lock = threading.Lock()  # held for a step; readers of the engine's state take it too
        self.wake = threading.Event()
        self.queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self.inbox: deque = deque()  # ("add", sid, args) | ("abort", sid), applied between steps
        self.on_idle = on_idle
        self.error: BaseException | None = None
        self._stop = False
        self.thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.thread.start()

    @property
    def alive(self) -> bool:
        return self.thread.is_alive() and self.error is None

    def submit(self, prompt_ids, params, spec, drafter, request_id) -> tuple[str, asyncio.Queue]:
        """Raises InvalidRequest / QueueFull straight to the caller; the engine takes the
        request before its next step."""
        cfg = self.engine.cfg
        validate_request(prompt_ids, params, spec, drafter, self.engine.limits)
        if len(self.queues) >= cfg.max_num_seqs + cfg.max_waiting:  # the most the engine holds
            raise QueueFull(f"admission queue full ({cfg.max_waiting} waiting)")
        sid = request_id or f"req-{uuid.uuid4().hex[:12]}"
        if sid in self.queues:
            raise InvalidRequest(f"request id {sid!r} is already in flight")
        q: asyncio.Queue = asyncio.Queue()
        self.queues[sid] = (asyncio.get_running_loop(), q)
        self.inbox.append(("add", sid, (prompt_ids, params, spec, drafter)))
        self.wake.set()
        return sid, q

    def abort(self, sid: str) -> None:
        if self.queues.pop(sid, None) is not None:
            self.inbox.append(("abort", sid))
            self.wake.set()

    def stop(self) -> None:
        self._stop = True
        self.wake.set()
        self.thread.join(timeout=5)

    def _take_inbox(self) -> None:
        """Arrivals and aborts since the last step, in the order they came (an abort always
        follows its request's add)."""
        while self.inbox:
            item = self.inbox.popleft()
            if item[0] == "abort":
                self.engine.abort(item[1])
                continue
            _, sid, args = item
            try:
                self.engine.add_request(*args, request_id=sid)
            except (InvalidRequest, QueueFull) as e:  # submit checked; the engine has the last word
                target = self.queues.pop(sid, None)
                if target is not None:
                    target[0].call_soon_threadsafe(target[1].put_nowait, e)

    def _run(self) -> None:
        while not self._stop:
            with self.lock:
                self._take_inbox()
            if not self.engine.has_work:
                if self.on_idle:
                    self.on_idle()
                self.wake.wait(0.05)
                self.wake.clear()
                continue
            try:
                with self.lock:
                    outs = self.engine.step()
                    targets = [(o, self.queues.get(o.seq_id)) for o in outs]
                    for o in outs:
                        if o.finished:
                            self.queues.pop(o.seq_id, None)
            except Exception as e:  # a broken step fails every request in flight, loudly
                log.error("engine step failed: %s", traceback.format_exc())
                if isinstance(e, RankFailure):  # the group is gone: no later step can run
                    self.error = e
                self._fail_all(e)
                if self.error is not None:
                    return
                continue
            for o, target in targets:
                if target is not None:
                    target[0].call_soon_threadsafe(target[1].put_nowait, o)

    def _fail_all(self, error: Exception) -> None:
        with self.lock:
            self._take_inbox()
            for sid, (loop, q) in list(self.queues.items()):  # a request submitted meanwhile runs on
                self.engine.abort(sid)
                self.queues.pop(sid, None)
                loop.call_soon_threadsafe(q.put_nowait, error)
