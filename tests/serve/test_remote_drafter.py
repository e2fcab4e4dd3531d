"""RemoteDrafter without Ray: a dead drafter costs one timeout, then a back-off of plain
decoding; releases of a failed call are sent again; a stale call is cancelled."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest

from cluster.engine.drafter import DraftOutput, DraftRequest
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
    d = RemoteDrafter(handle, timeout_s=0.01, caller="v")
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
