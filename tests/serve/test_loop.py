"""The engine loop after a failed step: a lost tensor-parallel rank (RankFailure) ends the loop,
so the replica's health check fails and Serve replaces it; any other step error fails only the
requests in flight and the loop serves the next ones."""

from __future__ import annotations

import asyncio

import pytest

from cluster.engine.parallel import RankFailure
from cluster.serve.loop import EngineLoop


class BrokenEngine:
    """Each step raises the next error of `errors`, then steps finish nothing."""

    def __init__(self, *errors: Exception):
        self.errors, self.waiting, self.aborted, self.n = list(errors), set(), [], 0

    @property
    def has_work(self) -> bool:
        return bool(self.waiting)

    def add_request(self, *args) -> str:
        self.n += 1
        self.waiting.add(f"s{self.n}")
        return f"s{self.n}"

    def abort(self, sid: str) -> None:
        self.aborted.append(sid)
        self.waiting.discard(sid)

    def step(self):
        if self.errors:
            raise self.errors.pop(0)
        return []


async def _first_output(loop: EngineLoop):
    sid, q = loop.submit([1], None, None, None, None)
    return sid, await asyncio.wait_for(q.get(), 10)


@pytest.mark.parametrize("error,ends", [(RankFailure("rank 1 gone"), True), (RuntimeError("a bug"), False)])
def test_a_failed_step_fails_its_requests_and_only_a_lost_rank_ends_the_loop(error, ends):
    engine = BrokenEngine(error)
    loop = EngineLoop(engine)
    try:
        sid, out = asyncio.run(_first_output(loop))
        assert out is error and engine.aborted == [sid]  # the request hears why and holds nothing
        loop.thread.join(timeout=2 if ends else 0.3)
        assert loop.alive is not ends
        assert (loop.error is error) if ends else loop.error is None
    finally:
        loop.stop()
