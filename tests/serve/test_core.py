"""The engine core (cluster.serve.core) and the replica's client (cluster.serve.core_client)
around a real engine (tiny random model on CPU), over real ZeroMQ sockets; the core's loop
runs on a thread here as it runs on its actor's. Only the runner's forward, the hardware
call, is replaced where a test needs a step to fail or to hold.

- Outputs cross unchanged: tokens equal the engine's own, logprobs and final stats arrive, and
  the text the core leaves to the client (Engine.detokenize) is the engine's own text.
- A failed step: a lost tensor-parallel rank ends the core (`dead`), so the replica's health
  check fails and Serve replaces it; any other error fails only the requests in flight and
  the core serves the next ones.
- The replica's event loop never waits for a step: while a step runs, `submit` and `abort`
  return at once and take effect between steps; a full engine is refused at once.
- A stats answer follows every output sent before it.
"""

from __future__ import annotations

import asyncio
import threading
import uuid

import pytest
import torch
import zmq

from cluster.engine.config import EngineConfig
from cluster.engine.distributed.parallel import RankFailure
from cluster.engine.engine import Engine
from cluster.engine.sampling import SamplingParams
from cluster.engine.scheduling.scheduler import QueueFull
from cluster.engine.scheduling.sequence import SpecParams
from cluster.engine.worker.loader import load_model
from cluster.serve.core import CoreLoop, bind_pair, engine_info
from cluster.serve.core_client import CoreClient
from tests.engine.conftest import CharTokenizer

LONG = SamplingParams(max_tokens=200, ignore_eos=True)


@pytest.fixture(scope="session")
def random_models(tmp_path_factory):
    from tests.engine.conftest import save_random

    return {"llama": save_random(tmp_path_factory.mktemp("core") / "llama", "llama")}


@pytest.fixture
def engine(random_models):
    model = load_model(random_models["llama"], torch.float32, "cpu")
    return Engine(model, CharTokenizer(), EngineConfig(max_num_seqs=2, max_waiting=1, max_model_len=256))


class Core:
    """A CoreLoop on a thread and a CoreClient connected to it, as an actor and its replica."""

    def __init__(self, engine: Engine, on_step=None):
        base = f"ipc:///tmp/spec-cluster-test-{uuid.uuid4().hex[:12]}"
        self.ctx = zmq.Context()
        inbox, outbox = bind_pair(self.ctx, f"{base}-in", f"{base}-out")
        self.loop = CoreLoop(engine, inbox, outbox)
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        self.client = CoreClient(f"{base}-in", f"{base}-out", engine_info(engine), on_step=on_step,
                                 tokenizer=engine.tokenizer)

    def _run(self):
        try:
            self.loop.run()
        except BaseException as e:  # noqa: BLE001 - what the actor's run would raise
            self.error = e

    def close(self):
        self.client.stop()
        self.thread.join(timeout=30)
        if self.thread.is_alive():  # never destroy the sockets under a loop still sending on them
            self.loop.stopped = True
            self.thread.join(timeout=30)
        self.ctx.destroy(linger=0)


def submit(client: CoreClient, text: str = "abc", params: SamplingParams = LONG, spec=SpecParams("off")):
    return client.submit([ord(c) for c in text], params, spec, None, None)


async def _first(q: asyncio.Queue):
    return await asyncio.wait_for(q.get(), 30)


async def _all(q: asyncio.Queue):
    outs = [await _first(q)]
    while not outs[-1].finished:
        outs.append(await _first(q))
    return outs


def test_outputs_cross_unchanged(engine, random_models):
    model = load_model(random_models["llama"], torch.float32, "cpu")
    local = Engine(model, CharTokenizer(), EngineConfig(max_num_seqs=2, max_waiting=1, max_model_len=256))
    params = SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2)
    want = local.generate(["hello", "world"], params, SpecParams("fixed", 3))
    steps = []
    core = Core(engine, on_step=lambda obs, stored, evicted: steps.append(obs))

    async def run():
        qs = [submit(core.client, t, params, SpecParams("fixed", 3))[1] for t in ("hello", "world")]
        return [await _all(q) for q in qs]

    try:
        got = asyncio.run(run())
        for outs, w in zip(got, want):
            assert sum((o.token_ids for o in outs), []) == w["token_ids"]
            assert "".join(o.text for o in outs) == w["text"]
            lps = sum((o.logprobs for o in outs), [])
            assert [lp.token_id for lp in lps] == w["token_ids"] and all(len(lp.top) == 2 for lp in lps)
            assert outs[-1].finish_reason == "length" and outs[-1].stats["timing"]["ttft_ms"] > 0
        assert any(steps) and all(o.batch_size >= 1 for obs in steps for o in obs)  # observations cross
        stats = core.client.request_stats().result(timeout=30)  # answered after those outputs
        assert stats["finished"] == 2 and stats["running"] == 0
        assert core.client.messages == stats["steps"] == len(steps)  # one message a step, whatever its rows
    finally:
        core.close()


def test_text_is_the_engines_with_and_without_stop_strings(engine, random_models):
    """A row with stop strings is decoded in the core (it needs its text to stop), the others
    by the client: both streams' text is what the engine gives in process."""
    model = load_model(random_models["llama"], torch.float32, "cpu")
    local = Engine(model, CharTokenizer(), EngineConfig(max_num_seqs=2, max_waiting=1, max_model_len=256))
    free = SamplingParams(max_tokens=16, ignore_eos=True)
    text = local.generate(["stop here"], free, SpecParams("off"))[0]["text"]
    stop = SamplingParams(max_tokens=16, ignore_eos=True, stop=[text[6:8]])
    want = local.generate(["stop here", "go on"], [stop, free], SpecParams("off"))
    assert want[0]["finish_reason"] == "stop" and len(want[0]["text"]) < len(text)
    core = Core(engine)

    async def run():
        qs = [submit(core.client, t, p)[1] for t, p in (("stop here", stop), ("go on", free))]
        return [await _all(q) for q in qs]

    try:
        got = asyncio.run(run())
        assert ["".join(o.text for o in outs) for outs in got] == [w["text"] for w in want]
        assert [outs[-1].finish_reason for outs in got] == ["stop", "length"]
        assert not core.client.detoks  # nothing kept once the requests ended
    finally:
        core.close()


@pytest.mark.parametrize("error,ends", [(RankFailure("rank 1 gone"), True), (RuntimeError("a bug"), False)])
def test_a_failed_step_fails_its_requests_and_only_a_lost_rank_ends_the_core(engine, error, ends):
    forward, failed = engine.runner.forward, []

    def once(*args, **kwargs):
        if not failed:
            failed.append(1)
            raise error
        return forward(*args, **kwargs)

    engine.runner.forward = once
    core = Core(engine)

    async def run():
        _, q = submit(core.client)
        out = await _first(q)
        assert isinstance(out, type(error)) and "rank 1 gone" in str(out) if ends else "a bug" in str(out)
        if not ends:  # and the core serves the next one
            _, q = submit(core.client, params=SamplingParams(max_tokens=3, ignore_eos=True))
            await _all(q)

    try:
        asyncio.run(run())
        core.thread.join(timeout=10 if ends else 0)
        assert core.client.alive is not ends
        assert (core.error is error) if ends else core.error is None
        if not ends:
            assert core.client.request_stats().result(timeout=30)["running"] == 0
        assert not engine.seqs and engine.kv.held() == (0, 0)  # nothing held
    finally:
        core.close()


def _run_then_all_aborted(core: Core, engine: Engine, run) -> None:
    """Run the test's coroutine; then both of its requests were aborted and nothing is held."""
    try:
        asyncio.run(run())
        stats = core.client.request_stats().result(timeout=30)
        assert stats["aborted"] == 2 and stats["finished"] == 0 and stats["running"] == 0
        assert engine.kv.held() == (0, 0)
    finally:
        core.close()


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


def test_submit_and_abort_never_wait_for_a_step(engine):
    held = Held(engine)
    core = Core(engine)

    async def run():
        sid, q = submit(core.client)
        await _first(q)  # running
        held.hold.clear()
        held.entered.wait(30)  # a step is in its forward now
        sid2, q2 = submit(core.client, "second")  # returns while the step holds
        core.client.abort(sid)
        assert sid in engine.seqs and sid2 not in engine.seqs  # applied between steps, not now
        held.hold.set()
        await _first(q2)  # the second request runs: the abort was applied before it
        assert sid not in engine.seqs
        core.client.abort(sid2)

    _run_then_all_aborted(core, engine, run)


def test_a_full_engine_refuses_at_once(engine):
    held = Held(engine)
    held.hold.clear()  # the first step holds: nothing finishes meanwhile
    core = Core(engine)

    async def run():
        for i in range(3):  # max_num_seqs 2 + max_waiting 1
            submit(core.client, f"r{i}")
        held.entered.wait(30)
        with pytest.raises(QueueFull):
            submit(core.client, "one too many")

    try:
        asyncio.run(run())
    finally:
        held.hold.set()
        core.close()


def test_a_paused_core_takes_requests_and_aborts_but_runs_no_step(engine):
    core = Core(engine)

    async def run():
        sid, q = submit(core.client)
        await _first(q)  # running
        paused = core.client.pause(True).result(timeout=30)  # answered once it took effect
        sid2, _ = submit(core.client, "second")
        core.client.abort(sid)
        s = core.client.request_stats().result(timeout=30)  # after the add and the abort
        assert s["steps"] == paused["steps"] and s["tokens"] == paused["tokens"]  # no step ran
        assert s["aborted"] == 1 and s["running"] + s["waiting"] == 1 and sid2 in engine.seqs
        core.client.pause(False).result(timeout=30)
        await _first(core.client.queues[sid2][1])  # and steps go on
        core.client.abort(sid2)

    _run_then_all_aborted(core, engine, run)
