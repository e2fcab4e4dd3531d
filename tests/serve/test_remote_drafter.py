"""RemoteDrafter without Ray: a dead drafter costs one timeout, then a back-off of plain
decoding; releases of a failed call are sent again; a stale call is cancelled. The direct
transport against real ZeroMQ servers: drafts arrive intact, and a replaced replica (new
address) is found again through the handle after the back-off."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest

from cluster.engine.drafters.base import DraftOutput, DraftRequest
from cluster.engine.sampling import SamplingParams
from cluster.serve.drafter import RemoteDrafter
from tests.factories import draft_output, draft_request


class FakeResponse:
    def __init__(self, ok: bool):
        self.ok, self.cancelled = ok, False

    def result(self, timeout_s=None):
        if not self.ok:
            raise TimeoutError("no replica answered")
        return draft_output()

    def cancel(self):
        self.cancelled = True


class FakeHandle:
    def __init__(self):
        self.up, self.calls = False, []
        self.propose = SimpleNamespace(remote=self._propose)

    def _propose(self, requests, release, caller, drafter="model"):
        r = FakeResponse(self.up)
        self.calls.append((list(release), r))
        return r


def test_backoff_then_probe_then_resume(monkeypatch):
    handle = FakeHandle()
    d = RemoteDrafter(handle, timeout_s=0.01, caller="v", transport="handle")
    d.release(["a", "b"])
    with pytest.raises(TimeoutError):
        d.propose([draft_request()])
    release, response = handle.calls[-1]
    assert release == ["a", "b"] and response.cancelled
    assert d.pending_release == ["a", "b"]  # sent again with the next call

    # during the back-off: no call at all, empty drafts for every request
    out = d.propose([draft_request(), draft_request()])
    assert out.tokens == [[], []] and len(handle.calls) == 1

    # after it, a probe (an empty call) on a thread of its own: the step does not wait for it
    monkeypatch.setattr(time, "monotonic", lambda t=time.monotonic(): t + 60)
    assert d.propose([draft_request()]).tokens == [[]]
    d.probe.join(5)
    assert handle.calls[-1][0] == [] and len(handle.calls) == 2
    assert d.down and d.backoff_s == 2 * RemoteDrafter.MIN_BACKOFF_S  # it failed: a longer back-off

    # the drafter is back: the next probe reaches it, and the step after drafts again
    monkeypatch.setattr(time, "monotonic", lambda t=time.monotonic(): t + 120)
    handle.up = True
    assert d.propose([draft_request()]).tokens == [[]]
    d.probe.join(5)
    assert d.propose([draft_request()]).tokens == [[1, 2]]
    assert handle.calls[-1][0] == ["a", "b"] and d.pending_release == []
    assert d.backoff_s == 0 and not d.down and d.propose([draft_request()]).tokens == [[1, 2]]


class Replica:
    """A drafter replica's direct endpoint: a real ZeroMQ server around a fake drafter."""

    def __init__(self, reply: DraftOutput):
        from cluster.serve.draft_rpc import DraftServer

        self.reply, self.calls = reply, []
        self.server = DraftServer(self.propose, "127.0.0.1")
        self.address = self.server.address

    def propose(self, requests, starts, release, caller):
        self.calls.append((requests, starts, release, caller))
        if any(r.seq_id == "boom" for r in requests):
            raise RuntimeError("drafter bug")
        return self.reply, [False] * len(requests)


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
        (sent, starts, release, caller), = replica.calls
        assert release == ["old"] and caller == "v1" and d.pending_release == []
        assert [r.seq_id for r in sent] == ["s1", "s2"] and sent[0].token_ids == list(range(3000)) and starts == [0, 0]
        p = sent[0].params
        assert (p.seed, p.top_k, sent[0].k) == (3, 5, 2) and abs(p.temperature - 0.7) < 1e-6 and sent[1].params.seed is None
    finally:
        replica.server.stop()


def test_direct_transport_finds_the_replacement_replica(monkeypatch):
    first = Replica(draft_output())
    handle = EndpointHandle(first)
    d = RemoteDrafter(handle, timeout_s=2.0, caller="v")
    assert d.propose([draft_request()]).tokens == [[1, 2]] and handle.lookups == 1
    assert d.propose([draft_request()]).tokens == [[1, 2]] and handle.lookups == 1  # kept

    with pytest.raises(Exception):  # a drafter error is a failed call, not a wrong draft
        d.propose([DraftRequest("boom", [1, 2], 2)])
    assert d.backoff_s == RemoteDrafter.MIN_BACKOFF_S

    first.server.stop()  # Serve replaced the replica: a new one at a new address
    second = Replica(DraftOutput([[3]], [np.array([[3]], np.int32)], [np.ones((1, 1), np.float32)]))
    handle.replica = second
    try:
        monkeypatch.setattr(time, "monotonic", lambda t=time.monotonic(): t + 60)
        assert d.propose([draft_request()]).tokens == [[]]  # starts the probe, waits for nothing
        d.probe.join(5)
        assert d.propose([draft_request()]).tokens == [[3]]  # through the probe's connection
        assert handle.lookups == 2 and d.backoff_s == 0 and len(second.calls) == 2  # the probe, the call
    finally:
        second.server.stop()


def test_a_replica_that_dies_fails_its_call_at_once():
    """Its socket closes: the waiting call fails then, not at the (5 s) timeout, and the
    steps after it draft nothing without waiting."""
    replica = Replica(draft_output())
    d = RemoteDrafter(EndpointHandle(replica), timeout_s=5.0, caller="v")
    assert d.propose([draft_request()]).tokens == [[1, 2]]
    replica.server.stop()
    t = time.monotonic()
    with pytest.raises(Exception, match="closed the connection|did not answer"):
        d.propose([draft_request()])
    assert time.monotonic() - t < 2.5  # not the 5 s timeout
    t = time.monotonic()
    assert d.propose([draft_request()]).tokens == [[]] and time.monotonic() - t < 1.0  # no wait at all


def test_a_late_reply_is_not_taken_for_the_next_call():
    """A call given up on (timed out) is answered later; the next call must get its own
    reply, not that one, and a malformed request is an error reply, not a dead server."""
    from cluster.serve.draft_rpc import DraftError, DraftingClient, DraftServer, _Call

    def propose(requests, starts, release, caller):
        if requests[0].seq_id == "slow":
            time.sleep(0.5)
        t = len(requests[0].token_ids)
        return DraftOutput([[t]], [np.array([[t]], np.int32)], [np.ones((1, 1), np.float32)]), [False]

    server = DraftServer(propose, "127.0.0.1")
    client = DraftingClient(server.address)
    try:
        with pytest.raises(DraftError, match="in time"):
            client.propose([DraftRequest("slow", [1] * 3, 1)], [0], [], "v", timeout_s=0.1).result()
        fast = client.propose([DraftRequest("fast", [1] * 7, 1)], [0], [], "v", timeout_s=5.0)
        assert fast.result().tokens == [[7]]  # the slow call's [[3]] arrived first and was dropped
        client.socket.send_multipart([b"x", b"\xff not a protobuf"])  # as a foreign peer might
        bad = client.waiting[b"x"] = _Call(client, b"x", time.monotonic() + 5)
        with pytest.raises(DraftError, match="drafter failed"):
            bad.result()
        assert client.propose([DraftRequest("s", [1] * 2, 1)], [0], [], "v", 5.0).result().tokens == [[2]]
    finally:
        client.close()
        server.stop()


class Counting:
    """Wraps a replica's propose_from to see what each direct call carried."""

    def __init__(self, replica):
        self.replica, self.calls = replica, []

    def __call__(self, requests, starts, release, caller):
        self.calls.append([(r.seq_id, s, len(r.token_ids)) for r, s in zip(requests, starts)])
        return self.replica.propose_from(requests, starts, release, caller)


def test_direct_calls_send_only_new_tokens_and_resync_after_eviction(demo_pair):
    """The real Drafter replica class behind a real ZeroMQ server, an in-process engine using
    it as its remote drafter: greedy output equals speculation off, seeded sampled output repeats;
    after the first call a sequence's call carries only its new tokens; evicted draft state is
    re-sent in full."""
    import torch

    from cluster.config import parse_config
    from cluster.engine.scheduling.sequence import SpecParams
    from cluster.serve.build import build_engine
    from cluster.serve.draft_rpc import DraftServer
    from cluster.serve.drafter import DrafterDeployment

    torch.manual_seed(0)
    cfg = parse_config({"models": {"target": str(demo_pair[0]), "draft": str(demo_pair[1]), "device": "cpu"},
                        "placement": "disaggregated", "kvdir": {"url": None}})
    replica = DrafterDeployment.func_or_class(cfg.model_dump())
    replica.check_health()
    replica.server.stop()  # serve it through the counting wrapper instead
    with pytest.raises(RuntimeError, match="stopped"):  # Serve would replace this replica
        replica.check_health()
    counting = Counting(replica)
    server = DraftServer(counting, "127.0.0.1")
    address = server.address
    try:
        remote = RemoteDrafter(EndpointHandle(SimpleNamespace(address=address)), timeout_s=10.0, caller="v")
        remote.SLOW_FACTOR = float("inf")  # the slow-call rule is test_a_hung_replica's: a stall of this process must not look like one
        engine = build_engine(cfg, remote)
        prompts = ["def fibonacci(n):", "import os\nimport sys\n\ndef main("]
        greedy = SamplingParams(max_tokens=40, ignore_eos=True)
        off = engine.generate(prompts, greedy, SpecParams("off"))
        spec = engine.generate(prompts, greedy, SpecParams("fixed", 4), "model")
        assert [r["token_ids"] for r in spec] == [r["token_ids"] for r in off]
        assert sum(r["spec"]["accepted"] for r in spec) > 0
        rows = [row for call in counting.calls for row in call]
        assert rows[0][1] == 0 and any(start > 0 for _, start, _ in rows)
        later = [n for _, start, n in rows if start > 0]
        # a call carries what the verifier accepted since its last call for the sequence: one
        # step's tokens plus assumed drafts (a guessed call), or two steps' when a guessed call
        # hit and the look-ahead was off for the next step; never the whole context
        assert max(later) <= 2 * (4 + 1)
        # seeded sampled requests repeat through the replica, guessed calls or not
        seeded = [SamplingParams(max_tokens=24, temperature=0.8, seed=s, ignore_eos=True) for s in (1, 2)]
        twice = [[r["token_ids"] for r in engine.generate(prompts, seeded, SpecParams("fixed", 4), "model")]
                 for _ in range(2)]
        assert twice[0] == twice[1]

        # the replica loses a sequence's state mid-run: that row resyncs, output is unchanged
        sid = engine.add_request(prompts[1], greedy, SpecParams("fixed", 4), "model")
        out, steps = [], 0
        while engine.has_work:
            for o in engine.step():
                out += o.token_ids
            steps += 1
            if steps == 6:
                with replica.lock:
                    replica.drafter.release([sid])
        assert out == off[1]["token_ids"]
        after = [row for call in counting.calls[-12:] for row in call if row[0] == sid]
        assert any(start == 0 for _, start, _ in after[1:]), "the evicted row was not sent again in full"
        assert sid not in remote.held and remote.pending_release
        deadline = time.monotonic() + 10
        while (replica.drafter.state or remote.pending_release) and time.monotonic() < deadline:
            remote.flush()  # what the verifier's loop does when idle: the release reaches the replica
            time.sleep(0.05)
        assert not replica.drafter.state and not remote.pending_release
    finally:
        server.stop()


def test_eagle3_in_its_own_replica_ships_new_aux_states_only(demo_pair):
    """EAGLE-3 in the Drafter replica behind a real ZeroMQ server: greedy output equals
    speculation off; each call after a sequence's first carries the aux hidden states of that
    step's accepted tokens only (the bytes per step below), and drafts are accepted."""
    import torch

    from cluster.config import parse_config
    from cluster.engine.scheduling.sequence import SpecParams
    from cluster.serve.build import build_engine, eagle3_dir
    from cluster.serve.draft_rpc import DraftServer, encode_request
    from cluster.serve.drafter import DrafterDeployment

    cfg = parse_config({"models": {"device": "cpu"}, "placement": "disaggregated", "kvdir": {"url": None}})
    if eagle3_dir(cfg) is None:
        pytest.skip("no EAGLE-3 head beside the demo target (spec-cluster models train-eagle3)")
    torch.manual_seed(0)
    replica = DrafterDeployment.func_or_class(cfg.model_dump())
    assert set(replica.drafters) == {"model", "eagle3"}
    replica.server.stop()
    seen = []

    def counting(requests, starts, release, caller, drafter="model"):
        seen.append([(drafter, s, 0 if r.aux is None else len(r.aux), r.aux_start, len(r.token_ids))
                     for r, s in zip(requests, starts)])
        return replica.propose_from(requests, starts, release, caller, drafter)

    server = DraftServer(counting, "127.0.0.1")
    try:
        handle = EndpointHandle(SimpleNamespace(address=server.address))
        remote = RemoteDrafter(handle, timeout_s=10.0, caller="v", name="eagle3")
        remote.SLOW_FACTOR = float("inf")  # the slow-call rule is test_a_hung_replica's: a stall of this process must not look like one
        engine = build_engine(cfg, {"eagle3": remote})
        assert engine.model.aux_layers == replica.drafters["eagle3"].aux_layers and remote.look_ahead is None
        prompts = ["def fibonacci(n):", "import os\nimport sys\n\ndef main("]
        greedy = SamplingParams(max_tokens=40, ignore_eos=True)
        off = engine.generate(prompts, greedy, SpecParams("off"))
        spec = engine.generate(prompts, greedy, SpecParams("fixed", 4), "eagle3")
        assert [r["token_ids"] for r in spec] == [r["token_ids"] for r in off]
        assert sum(r["spec"]["accepted"] for r in spec) > 0
        rows = [row for call in seen for row in call]
        assert all(d == "eagle3" for d, *_ in rows)
        first = {}
        for _, start, n_aux, aux_start, n_tok in rows:
            if start == 0:  # a sequence's first call: the prompt's states (minus the last token's)
                assert n_aux == n_tok - 1 and aux_start == 0
            else:  # later: only the positions accepted since, never the context again
                assert 1 <= n_aux <= 4 + 1
            first.setdefault(n_tok, start)
        # bytes per verify step per sequence: aux states of the accepted tokens, fp32 here
        A = engine.model.shape.hidden * len(engine.model.aux_layers)
        later = [n_aux for _, start, n_aux, _, _ in rows if start > 0]
        msg = encode_request([], [], [], "v", "eagle3")
        assert msg.drafter == "eagle3"
        per_token = A * 4
        print(f"\neagle3 over ZeroMQ: {sum(later) / len(later):.2f} aux rows a call, {per_token} B a row "
              f"(fp32, A={A}); {remote.client.sent_bytes} request bytes in {len(seen)} calls")
    finally:
        server.stop()


def test_a_hung_replica_costs_a_fraction_of_the_timeout():
    """A replica that stops answering but keeps its socket open (a hung process): the call
    is given up after a few times the slowest recent call, not the 5 s timeout."""
    hang, release = threading.Event(), threading.Event()

    class Hanging(Replica):
        def propose(self, requests, starts, release_ids, caller):
            if hang.is_set():
                release.wait(10)
            return super().propose(requests, starts, release_ids, caller)

    replica = Hanging(draft_output())
    try:
        d = RemoteDrafter(EndpointHandle(replica), timeout_s=5.0, caller="v")
        for _ in range(10):
            assert d.propose([draft_request()]).tokens == [[1, 2]]
        assert d.wait_s() < 2.0  # loopback calls take milliseconds: the 0.5 s floor
        hang.set()
        t = time.monotonic()
        with pytest.raises(Exception, match="did not answer"):
            d.propose([draft_request()])
        assert time.monotonic() - t < 2.5 and d.down  # not the 5 s timeout
    finally:
        release.set()
        replica.server.stop()


def test_a_reply_read_late_counts_the_wait_it_had_not_the_stall():
    """The verifier's thread stalled past its call's wait (a GC pause) while the reply came: the
    step takes it, and the slow-call rule leaves that call out (it timed the stall, not the
    replica), so one pause does not stretch the limit for the 64 calls after it."""
    replica = Replica(draft_output())
    try:
        d = RemoteDrafter(EndpointHandle(replica), timeout_s=5.0, caller="v")
        d.MIN_WAIT_S = 0.05
        for _ in range(10):
            assert d.propose([draft_request()]).tokens == [[1, 2]]
        wait = d.wait_s()
        pending = d.propose_async([draft_request()])
        deadline = time.monotonic() + 10
        while not d.last_call.client.poll_now() and time.monotonic() < deadline:  # the reply is in
            time.sleep(0.01)
        time.sleep(wait + 0.2)  # the stall, past the call's wait
        assert pending.result().tokens == [[1, 2]]
        assert max(d.recent_s) <= wait and d.wait_s() == wait
    finally:
        replica.server.stop()


def test_a_reply_that_came_while_the_caller_stalled_is_taken():
    """The caller's thread did not read the socket until past the call's deadline (a GC
    pause, a loaded host) while the reply was already there: the call succeeds."""
    from cluster.serve.draft_rpc import DraftingClient, DraftServer

    server = DraftServer(lambda requests, starts, release, caller: (draft_output(), [False] * len(requests)),
                         "127.0.0.1")
    client = DraftingClient(server.address)
    try:
        call = client.propose([draft_request()], [0], [], "v", 5.0)
        deadline = time.monotonic() + 10
        while not client.poll_now() and time.monotonic() < deadline:  # the reply is in the socket
            time.sleep(0.01)
        call.deadline = time.monotonic() - 1.0  # ... and the caller comes back too late
        assert call.result().tokens == [[1, 2]]
    finally:
        client.close()
        server.stop()


def test_calls_waiting_together_from_different_verifiers_are_drafted_as_one_batch():
    """While the drafter is busy, two verifiers' calls arrive (and a second call from one of
    them): the two verifiers' calls become one pass over both their rows, each verifier
    gets its own rows back, and the second call of the same verifier comes after."""
    from cluster.serve.draft_rpc import DraftingClient, DraftServer, split_output

    busy, entered, batches = threading.Event(), threading.Event(), []

    def echo(requests):  # each row drafts its own length: whose row is whose shows
        return DraftOutput([[len(r.token_ids)] for r in requests],
                           [np.array([[len(r.token_ids)]], np.int32) for r in requests],
                           [np.ones((1, 1), np.float32) for _ in requests], seconds=0.5)

    def propose(requests, starts, release, caller):
        entered.set()
        busy.wait(5)
        batches.append([(caller, [len(r.token_ids) for r in requests])])
        return echo(requests), [False] * len(requests)

    def propose_many(calls):  # two sockets' calls arrive in either order: the batch is a set
        batches.append(sorted((c[3], [len(r.token_ids) for r in c[0]]) for c in calls))
        rows = [r for c in calls for r in c[0]]
        parts = split_output(echo(rows), [len(c[0]) for c in calls])
        return [(p, [False] * len(c[0])) for p, c in zip(parts, calls)]

    server = DraftServer(propose, "127.0.0.1", propose_many=propose_many)
    read, seen = server._waiting, [0]

    def waiting():  # on the server's thread: once the first call is in, its read takes all three behind it
        calls = read()
        deadline = time.monotonic() + 10
        while entered.is_set() and seen[0] + len(calls) < 4 and time.monotonic() < deadline:
            server.socket.poll(50)
            calls += read()
        seen[0] += len(calls)
        return calls

    server._waiting = waiting  # the socket's timing only: batching is the server's own
    a, b = DraftingClient(server.address), DraftingClient(server.address)
    try:
        first = a.propose([DraftRequest("a0", [1], 1)], [0], [], "va", 5.0)  # occupies the drafter
        assert entered.wait(10)
        second = b.propose([DraftRequest("b1", [1] * 2, 1), DraftRequest("b2", [1] * 3, 1)], [0, 0], [], "vb", 5.0)
        third = a.propose([DraftRequest("a1", [1] * 4, 1)], [0], [], "va", 5.0)
        again = a.propose([DraftRequest("a2", [1] * 5, 1)], [0], [], "va", 5.0)
        busy.set()  # all three are read together behind the first, however late they arrive
        assert first.result().tokens == [[1]]
        assert second.result().tokens == [[2], [3]] and third.result().tokens == [[4]]
        assert again.result().tokens == [[5]]
        assert batches == [[("va", [1])], [("va", [4]), ("vb", [2, 3])], [("va", [5])]]
    finally:
        a.close()
        b.close()
        server.stop()
