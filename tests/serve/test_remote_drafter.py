"""RemoteDrafter without Ray: a dead drafter costs one timeout, then a back-off of plain
decoding; releases of a failed call are sent again; a stale call is cancelled. The direct
transport against real gRPC servers: drafts arrive intact, and a replaced replica (new
address) is found again through the handle after the back-off."""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest

from cluster.engine.drafter import DraftOutput, DraftRequest
from cluster.engine.sampling import SamplingParams
from cluster.serve.drafter import RemoteDrafter


class FakeResponse:
    def __init__(self, ok: bool):
        self.ok, self.cancelled = ok, False

    def result(self, timeout_s=None):
        if not self.ok:
            raise TimeoutError("no replica answered")
        return DraftOutput.make_dummy()

    def cancel(self):
        self.cancelled = True


class FakeHandle:
    def __init__(self):
        self.up, self.calls = False, []
        self.propose = SimpleNamespace(remote=self._propose)

    def _propose(self, requests, release, caller):
        r = FakeResponse(self.up)
        self.calls.append((list(release), r))
        return r


def test_backoff_then_probe_then_resume(monkeypatch):
    handle = FakeHandle()
    d = RemoteDrafter(handle, timeout_s=0.01, caller="v", transport="handle")
    d.release(["a", "b"])
    with pytest.raises(TimeoutError):
        d.propose([DraftRequest.make_dummy()])
    release, response = handle.calls[-1]
    assert release == ["a", "b"] and response.cancelled
    assert d.pending_release == ["a", "b"]  # sent again with the next call

    # during the back-off: no call at all, empty drafts for every request
    out = d.propose([DraftRequest.make_dummy(), DraftRequest.make_dummy()])
    assert out.tokens == [[], []] and len(handle.calls) == 1

    # a second failure doubles the back-off (capped)
    monkeypatch.setattr(time, "monotonic", lambda t=time.monotonic(): t + 60)
    with pytest.raises(TimeoutError):
        d.propose([DraftRequest.make_dummy()])
    assert d.backoff_s == 2 * RemoteDrafter.MIN_BACKOFF_S

    # the drafter is back: the probe succeeds and speculation resumes
    monkeypatch.setattr(time, "monotonic", lambda t=time.monotonic(): t + 120)
    handle.up = True
    assert d.propose([DraftRequest.make_dummy()]).tokens == [[1, 2]]
    assert handle.calls[-1][0] == ["a", "b"] and d.pending_release == []
    assert d.backoff_s == 0 and d.propose([DraftRequest.make_dummy()]).tokens == [[1, 2]]


class Replica:
    """A drafter replica's direct endpoint: a real gRPC server around a fake drafter."""

    def __init__(self, reply: DraftOutput):
        from cluster.serve.draft_rpc import serve_drafting

        self.reply, self.calls = reply, []
        self.server, self.address = serve_drafting(self.propose, "127.0.0.1")

    def propose(self, requests, release, caller):
        self.calls.append((requests, release, caller))
        if any(r.seq_id == "boom" for r in requests):
            raise RuntimeError("drafter bug")
        return self.reply


class EndpointHandle:
    """The Serve handle as the direct transport uses it: only to look up an address."""

    def __init__(self, replica):
        self.replica, self.lookups = replica, 0
        self.endpoint = SimpleNamespace(remote=self._endpoint)

    def _endpoint(self):
        self.lookups += 1
        return SimpleNamespace(result=lambda timeout_s=None: self.replica.address)


def sampled_reply() -> DraftOutput:
    ids = np.array([[5, 9, 2], [7, 7, 7]], np.int32)
    probs = np.array([[0.5, 0.25, 0.25], [1.0, 0.0, 0.0]], np.float32)
    empty = np.zeros((0, 1), np.int32), np.zeros((0, 1), np.float32)
    return DraftOutput([[5, 7], []], [ids, empty[0]], [probs, empty[1]], seconds=0.25)


def test_direct_transport_round_trip():
    replica = Replica(sampled_reply())
    try:
        d = RemoteDrafter(EndpointHandle(replica), timeout_s=5.0, caller="v1")
        d.release(["old"])
        reqs = [DraftRequest("s1", list(range(3000)), 2, SamplingParams(temperature=0.7, top_p=0.9, top_k=5, seed=3)),
                DraftRequest("s2", [1, 2], 0)]
        out = d.propose(reqs)
        assert out.tokens == [[5, 7], []] and out.seconds == 0.25
        np.testing.assert_array_equal(out.q_ids[0], sampled_reply().q_ids[0])
        np.testing.assert_array_equal(out.q_probs[0], sampled_reply().q_probs[0])
        assert out.q_ids[1].shape == (0, 1)
        (sent, release, caller), = replica.calls
        assert release == ["old"] and caller == "v1" and d.pending_release == []
        assert [r.seq_id for r in sent] == ["s1", "s2"] and sent[0].token_ids == list(range(3000))
        p = sent[0].params
        assert (p.seed, p.top_k, sent[0].k) == (3, 5, 2) and abs(p.temperature - 0.7) < 1e-6 and sent[1].params.seed is None
    finally:
        replica.server.stop(0)


def test_direct_transport_finds_the_replacement_replica(monkeypatch):
    first = Replica(DraftOutput.make_dummy())
    handle = EndpointHandle(first)
    d = RemoteDrafter(handle, timeout_s=2.0, caller="v")
    assert d.propose([DraftRequest.make_dummy()]).tokens == [[1, 2]] and handle.lookups == 1
    assert d.propose([DraftRequest.make_dummy()]).tokens == [[1, 2]] and handle.lookups == 1  # kept

    with pytest.raises(Exception):  # a drafter error is a failed call, not a wrong draft
        d.propose([DraftRequest("boom", [1, 2], 2)])
    assert d.backoff_s == RemoteDrafter.MIN_BACKOFF_S

    first.server.stop(0).wait()  # Serve replaced the replica: a new one at a new address
    second = Replica(DraftOutput([[3]], [np.array([[3]], np.int32)], [np.ones((1, 1), np.float32)]))
    handle.replica = second
    try:
        monkeypatch.setattr(time, "monotonic", lambda t=time.monotonic(): t + 60)
        assert d.propose([DraftRequest.make_dummy()]).tokens == [[3]]  # the probe looked it up again
        assert handle.lookups == 2 and d.backoff_s == 0 and len(second.calls) == 1
    finally:
        second.server.stop(0)
