"""The router's failover (cluster.serve.calls.stream_outputs) against a stand-in Verifier
handle: a call that breaks mid-stream is resubmitted as prompt + streamed tokens, with
backoff, until `failover_wait_s`; then UNAVAILABLE."""

from __future__ import annotations

import asyncio
import time

import pytest

from cluster.engine.sampling import SamplingParams
from cluster.engine.scheduling.sequence import RequestOutput, SpecParams
from cluster.serve.calls import ErrorKind, GenerateCall, RequestError, stream_outputs


class ReplicaDied(Exception):
    pass


class FakeVerifier:
    """Counts up from the prompt's last token; each call in `breaks` dies after that many
    outputs (None: runs to the end). Records every call it gets."""

    def __init__(self, breaks: list[int | None]):
        self.breaks, self.calls, self.cancelled = list(breaks), [], 0

    def options(self, stream: bool):
        return self

    @property
    def generate(self):
        return self

    def remote(self, call: GenerateCall):
        self.calls.append(call)
        die_after = self.breaks.pop(0) if self.breaks else None
        return _Gen(self, call, die_after)


class _Gen:
    def __init__(self, owner, call, die_after):
        self.owner, self.call, self.die_after = owner, call, die_after
        self.hang_s = owner.hangs.pop(0) if getattr(owner, "hangs", None) else 0.0

    def cancel(self):
        self.owner.cancelled += 1

    async def __aiter__(self):
        last, n = self.call.prompt_ids[-1], self.call.params.max_tokens
        await asyncio.sleep(self.hang_s)
        for i in range(n):
            if self.die_after is not None and i == self.die_after:
                raise ReplicaDied("actor died")
            last += 1
            yield RequestOutput("s", [last], str(last), i == n - 1, "length" if i == n - 1 else None,
                                len(self.call.prompt_ids))


def collect(verifier, call, wait):
    async def run():
        return [o async for o in stream_outputs(verifier, call, wait)]
    return asyncio.run(run())


def call(max_tokens=10, seed=None):
    return GenerateCall([1, 2, 3], SamplingParams(max_tokens=max_tokens, seed=seed), SpecParams("off"))


def test_a_broken_stream_goes_on_without_gap_or_repeat():
    v = FakeVerifier([4, 0, 3])  # dies after 4 tokens, then at once, then after 3 more
    outs = collect(v, call(), wait=5.0)
    assert [t for o in outs for t in o.token_ids] == list(range(4, 14))  # as one unbroken call
    assert outs[-1].finished and all(o.num_prompt == 3 for o in outs)
    assert [(c.prompt_ids, c.params.max_tokens) for c in v.calls] == [
        ([1, 2, 3], 10), ([1, 2, 3, 4, 5, 6, 7], 6), ([1, 2, 3, 4, 5, 6, 7], 6), ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 3)]
    assert v.cancelled == 3  # each broken call is cancelled (frees whatever the replica still holds)


def test_a_seeded_continuation_draws_a_stream_of_its_own():
    v = FakeVerifier([4])
    collect(v, call(seed=7), wait=5.0)
    assert v.calls[0].params.seed == 7 and v.calls[1].params.seed not in (7, None)


def test_no_wait_fails_at_once_and_a_dead_cluster_within_the_wait():
    with pytest.raises(RequestError) as e:
        collect(FakeVerifier([2]), call(), wait=0.0)
    assert e.value.kind == ErrorKind.UNAVAILABLE and "verifier unavailable" in e.value.message
    t = time.monotonic()
    v = FakeVerifier([2] + [0] * 100)  # every resubmission dies too
    with pytest.raises(RequestError):
        collect(v, call(), wait=0.6)
    assert 0.5 < time.monotonic() - t < 2.0
    assert 3 <= len(v.calls) <= 8  # backed off (0.1, 0.2, 0.4 ... s), not a busy loop


def test_a_retry_that_hung_past_the_wait_gets_a_successor():
    """The first resubmission hangs longer than the whole wait, then fails (a call routed to a
    replica that died meanwhile); the next one is still made, and completes."""
    v = FakeVerifier([2, 0, None])
    v.hangs = [0.0, 0.5, 0.0]
    outs = collect(v, call(), wait=0.3)
    assert [t for o in outs for t in o.token_ids] == list(range(4, 14)) and len(v.calls) == 3
