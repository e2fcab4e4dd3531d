"""How a verifier paces a stream's messages (cluster.serve.verifier): what arrives within an
interval goes as one message, in order; the last output, or an error, goes at once; the
interval widens with the replica's load. The end to end behaviour (every token arrives, the
same tokens) is held by the serve tests, which run with the default pacing."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from cluster.engine.scheduling.sequence import RequestOutput
from cluster.serve.verifier import UNARY_INTERVAL_S, Verifier, _collect

LONG_S = 60.0  # an interval no test may wait out: each ends within seconds or fails its timeout


def out(tokens, finished=False):
    return RequestOutput("r", list(tokens), "".join(chr(97 + t) for t in tokens), finished,
                         "length" if finished else None)


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 10))


def test_outputs_within_the_interval_go_as_one_in_order():
    async def go():
        q = asyncio.Queue()
        for t in ([1], [2, 3]):
            q.put_nowait(out(t))
        merged = await _collect(out([0]), q, 0.5)  # nothing more comes: the interval ends it
        return merged, q.empty()

    merged, drained = run(go())
    assert merged.token_ids == [0, 1, 2, 3] and merged.text == "abcd" and not merged.finished and drained


def test_the_last_output_goes_at_once():
    async def go():
        q = asyncio.Queue()
        task = asyncio.create_task(_collect(out([0]), q, LONG_S))
        await asyncio.sleep(0)  # it waits on the queue now
        q.put_nowait(out([1]))
        q.put_nowait(out([2], finished=True))
        return await task

    merged = run(go())
    assert merged.token_ids == [0, 1, 2] and merged.finished and merged.finish_reason == "length"


def test_an_error_goes_at_once_and_wins():
    async def go():
        q = asyncio.Queue()
        task = asyncio.create_task(_collect(out([0]), q, LONG_S))
        await asyncio.sleep(0)
        error = RuntimeError("core gone")
        q.put_nowait(error)
        return await task, error

    got, error = run(go())
    assert got is error


@pytest.mark.parametrize("in_flight,stream,want", [
    (0, True, 0.02),        # the floor: router.stream_interval_ms
    (256, True, 0.256),     # 256 streams share 1,000 messages a second
    (10, False, UNARY_INTERVAL_S),  # a unary call: a message a second at most
    (2000, False, 2.0),
])
def test_the_interval_widens_with_the_replica_load(in_flight, stream, want):
    v = SimpleNamespace(stream_s=0.02, stream_rate=1000.0, client=SimpleNamespace(queues=dict.fromkeys(range(in_flight))))
    assert Verifier.func_or_class._interval(v, stream) == pytest.approx(want)
