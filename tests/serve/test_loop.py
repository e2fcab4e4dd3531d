"""The engine loop around a real engine (tiny random model on CPU); only the runner's forward,
the hardware call, is replaced where a test needs a step to fail or to hold.

- A failed step: a lost tensor-parallel rank (RankFailure) ends the loop, so the replica's
  health check fails and Serve replaces it; any other error fails only the requests in
  flight and the loop serves the next ones.
- The replica's event loop never waits for a step: while a step runs, `submit` and `abort`
  return at once and take effect between steps; a full engine is refused at once.
"""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from cluster.engine.config import EngineConfig
from cluster.engine.engine import Engine
from cluster.engine.loader import load_model
from cluster.engine.parallel import RankFailure
from cluster.engine.sampling import SamplingParams
from cluster.engine.scheduler import QueueFull
from cluster.engine.sequence import SpecParams
from cluster.serve.loop import EngineLoop
from tests.engine.conftest import CharTokenizer

LONG = SamplingParams(max_tokens=200, ignore_eos=True)


@pytest.fixture
def engine(random_models):
    model = load_model(random_models["llama"], torch.float32, "cpu")
    return Engine(model, CharTokenizer(), EngineConfig(max_num_seqs=2, max_waiting=1, max_model_len=256))


@pytest.fixture(scope="session")
def random_models(tmp_path_factory):
    from tests.engine.conftest import save_random

    return {"llama": save_random(tmp_path_factory.mktemp("loop") / "llama", "llama")}


class Held:
    """Wraps the runner's forward: while `hold` is clear, a step waits in its forward
    (`entered` set), as a long GPU step would."""

    def __init__(self, engine: Engine):
        self.forward, self.hold, self.entered = engine.runner.forward, threading.Event(), threading.Event()
        self.hold.set()
        engine.runner.forward = self

    def __call__(self, *args, **kwargs):
        if not self.hold.is_set():
            self.entered.set()
            self.hold.wait(30)
        return self.forward(*args, **kwargs)


def submit(loop: EngineLoop, text: str = "abc", params: SamplingParams = LONG):
    return loop.submit([ord(c) for c in text], params, SpecParams("off"), None, None)


async def _first(q: asyncio.Queue):
    return await asyncio.wait_for(q.get(), 30)


@pytest.mark.parametrize("error,ends", [(RankFailure("rank 1 gone"), True), (RuntimeError("a bug"), False)])
def test_a_failed_step_fails_its_requests_and_only_a_lost_rank_ends_the_loop(engine, error, ends):
    forward, failed = engine.runner.forward, []

    def once(*args, **kwargs):
        if not failed:
            failed.append(1)
            raise error
        return forward(*args, **kwargs)

    engine.runner.forward = once
    loop = EngineLoop(engine)

    async def run():
        _, q = submit(loop)
        out = await _first(q)
        assert out is error  # the request hears why
        if not ends:  # and the loop serves the next one
            _, q = submit(loop, params=SamplingParams(max_tokens=3, ignore_eos=True))
            while not (await _first(q)).finished:
                pass

    try:
        asyncio.run(run())
        loop.thread.join(timeout=5 if ends else 0)
        assert loop.alive is not ends
        assert (loop.error is error) if ends else loop.error is None
        assert not engine.seqs and engine.kv.held() == (0, 0)  # nothing held
    finally:
        loop.stop()


def test_submit_and_abort_never_wait_for_a_step(engine):
    held = Held(engine)
    loop = EngineLoop(engine)

    async def run():
        sid, q = submit(loop)
        await _first(q)  # running
        held.hold.clear()
        held.entered.wait(30)  # a step is in its forward now, holding the loop's lock
        assert loop.lock.locked()
        sid2, _ = submit(loop, "second")  # returns while the step holds
        loop.abort(sid)
        assert loop.lock.locked() and sid in engine.seqs  # applied between steps, not now
        held.hold.set()
        for _ in range(300):
            if sid not in engine.seqs and sid2 in engine.seqs:
                break
            await asyncio.sleep(0.01)
        assert sid not in engine.seqs and sid2 in engine.seqs
        loop.abort(sid2)

    try:
        asyncio.run(run())
        for _ in range(300):
            if not engine.has_work:
                break
            threading.Event().wait(0.01)
        assert engine.totals["aborted"] == 2 and engine.totals["finished"] == 0
        assert engine.kv.held() == (0, 0)
    finally:
        loop.stop()


def test_a_full_engine_refuses_at_once(engine):
    held = Held(engine)
    held.hold.clear()  # the first step holds: nothing finishes meanwhile
    loop = EngineLoop(engine)

    async def run():
        for i in range(3):  # max_num_seqs 2 + max_waiting 1
            submit(loop, f"r{i}")
        held.entered.wait(30)
        with pytest.raises(QueueFull):
            submit(loop, "one too many")

    try:
        asyncio.run(run())
    finally:
        held.hold.set()
        loop.stop()
