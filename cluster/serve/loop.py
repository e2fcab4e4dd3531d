"""Runs `engine.step()` on its own thread and hands each request's outputs to asyncio.

The engine is single-threaded by design; a lock serialises add/abort against the step so
the replica's event loop never waits longer than one step.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import traceback

from cluster.engine.engine import Engine
from cluster.engine.parallel import RankFailure

log = logging.getLogger(__name__)


class EngineLoop:
    def __init__(self, engine: Engine, on_idle=None):
        self.engine = engine
        self.lock = threading.Lock()
        self.wake = threading.Event()
        self.queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self.on_idle = on_idle
        self.error: BaseException | None = None
        self._stop = False
        self.thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self.thread.start()

    @property
    def alive(self) -> bool:
        return self.thread.is_alive() and self.error is None

    def submit(self, prompt_ids, params, spec, drafter, request_id) -> tuple[str, asyncio.Queue]:
        """Raises InvalidRequest / QueueFull straight to the caller."""
        q: asyncio.Queue = asyncio.Queue()
        with self.lock:
            sid = self.engine.add_request(prompt_ids, params, spec, drafter, request_id)
            self.queues[sid] = (asyncio.get_running_loop(), q)
        self.wake.set()
        return sid, q

    def abort(self, sid: str) -> None:
        with self.lock:
            self.engine.abort(sid)
            self.queues.pop(sid, None)

    def stop(self) -> None:
        self._stop = True
        self.wake.set()
        self.thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop:
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
            for sid, (loop, q) in list(self.queues.items()):
                self.engine.abort(sid)
                loop.call_soon_threadsafe(q.put_nowait, error)
            self.queues.clear()
