"""Overload, deadlines and cancellation through the real gRPC endpoint.

A tiny verifier (2 sequences, 2 waiting) behind a router that admits 6 requests: a flood
against a paused, full engine gets RESOURCE_EXHAUSTED at once past each bound, the engine
holds exactly its bounds, and the queued requests complete once it goes on. A request cancelled or timed out while queued, prefilling or
decoding frees its place.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from cluster.client import build_request
from cluster.config import parse_config
from cluster.proto import generation_pb2_grpc as pb_grpc
from cluster.bench.chaos import verifier_stats, wait_idle, wait_until

pytestmark = pytest.mark.slow

APP = "overload"
SLOTS, WAITING, INFLIGHT = 2, 2, 6
META = [("application", APP)]
LONG_PROMPT = "def handler(request):\n    return request.get('value')\n" * 16  # ~250 tokens


@pytest.fixture(scope="module")
def stub(serve_grpc, demo_pair):
    from ray import serve

    from cluster.serve.launch import run_app

    run_app(parse_config({
        "placement": "colocated",
        "engine": {"max_num_seqs": SLOTS, "max_waiting": WAITING, "max_model_len": 512,
                   "prefill_chunk": 16, "max_batch_tokens": 64},
        "router": {"max_inflight": INFLIGHT},
        "verifier": {"ray_actor_options": {"num_cpus": 1}},
        "kvdir": {"url": None},
        "network": {"grpc_port": serve_grpc, "app_name": APP, "route_prefix": f"/{APP}"},
    }))
    with grpc.insecure_channel(f"localhost:{serve_grpc}") as ch:
        yield pb_grpc.GenerationStub(ch)
    serve.delete(APP)


def long_request(seed: int, prompt: str = "import os\n", max_tokens: int = 200):
    return build_request(prompt, max_tokens=max_tokens, temperature=1.0, seed=seed)


def test_flood_is_refused_at_once_and_bounded(stub):
    """Two streams hold both slots; the engine is paused so none can end; then 20 requests
    come at once. Exactly WAITING of them are held in the queue and finish once the engine
    goes on; every other is refused at once: by Serve's queue to the Router
    (max_queued_requests), by the router (at capacity) or by the verifier (its queue full). The first requests past the router always find the verifier's queue
    full, so that refusal must appear; the router's own bound is checked in test_admission
    (with one verifier holding SLOTS + WAITING < INFLIGHT, reaching it through gRPC needs
    two refusals in flight at once: a race, not a test)."""
    busy = _occupy(stub, SLOTS)
    verifier = _verifier()
    verifier.pause.remote(True).result(timeout_s=30)
    outcomes, changed = [], threading.Condition()

    def one(i):
        t0 = time.monotonic()
        try:
            stub.Generate(long_request(i, max_tokens=20), metadata=META, timeout=120)
            got = ("OK", "", time.monotonic() - t0)
        except grpc.RpcError as e:
            got = (e.code().name, e.details(), time.monotonic() - t0)
        with changed:
            outcomes.append(got)
            changed.notify_all()

    threads = [threading.Thread(target=one, args=(i,)) for i in range(20)]
    try:
        for t in threads:
            t.start()
        with changed:
            assert changed.wait_for(lambda: len(outcomes) >= 20 - WAITING, 120), outcomes
        s = verifier_stats(APP)
        assert (s["running"], s["waiting"]) == (SLOTS, WAITING), s  # held, and no more
        assert len(outcomes) == 20 - WAITING, outcomes  # the queued ones wait for the engine
    finally:
        verifier.pause.remote(False).result(timeout_s=30)
    for t in threads:
        t.join(180)
    for c in busy:
        c.cancel()

    codes = [c for c, _, _ in outcomes]
    assert len(outcomes) == 20 and codes.count("OK") == WAITING, outcomes
    refused = [(d, s) for c, d, s in outcomes if c != "OK"]
    assert {c for c in codes if c != "OK"} == {"RESOURCE_EXHAUSTED"}, outcomes
    bounds = ("router at capacity", "admission queue full", "dropped due to backpressure")  # the last: Serve's queue to the Router
    assert all(any(b in d for b in bounds) for d, _ in refused), refused
    assert any("admission queue full" in d for d, _ in refused), refused
    # at once, not after a wait: the queued calls never return while the engine is paused, so
    # a refusal is one of its own, whatever a loaded host's hops cost
    assert max(s for _, s in refused) < 15.0, refused
    wait_idle(APP)


def _verifier():
    from ray import serve

    return serve.get_deployment_handle("Verifier", APP)


def _occupy(stub, n: int):
    """n streams holding every KV slot, each past its first chunk."""
    calls = [stub.GenerateStream(long_request(100 + i, max_tokens=400), metadata=META, timeout=120) for i in range(n)]
    for c in calls:
        next(c)
    return calls


def test_cancel_and_deadline_while_queued(stub):
    busy = _occupy(stub, SLOTS)
    queued = stub.GenerateStream(long_request(7), metadata=META, timeout=120)
    wait_until(lambda: verifier_stats(APP)["waiting"] == 1, 20, "the request to queue")
    queued.cancel()
    s = wait_until(lambda: (s := verifier_stats(APP))["waiting"] == 0 and s, 20, "the queue to empty")
    assert s["running"] == SLOTS  # the cancel took only the queued request

    with pytest.raises(grpc.RpcError) as e:  # a deadline that passes in the queue
        stub.Generate(long_request(8), metadata=META, timeout=1.0)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_until(lambda: verifier_stats(APP)["waiting"] == 0, 20, "the expired request to leave the queue")
    for c in busy:
        c.cancel()
    wait_idle(APP)


def test_cancel_and_deadline_at_every_stage(stub):
    """Cancelled or timed out after 0 ms (queued in the proxy or router), 50 ms (prefilling a
    ~250-token prompt in 16-token chunks) and later (decoding): nothing is left behind."""
    stages = []
    for i, delay in enumerate([0.0, 0.05, 0.1, 0.2, 0.6, 1.5]):
        tokens = verifier_stats(APP)["tokens"]
        call = stub.GenerateStream(long_request(i, LONG_PROMPT), metadata=META, timeout=120)
        time.sleep(delay)
        s = verifier_stats(APP)  # where the request is as it is cancelled (about)
        stages.append("queued" if s["running"] + s["waiting"] == 0 or s["waiting"] else
                      "prefilling" if s["tokens"] == tokens else "decoding")
        call.cancel()
        wait_idle(APP)
    assert "decoding" in stages and len(set(stages)) >= 2, stages
    for i, timeout in enumerate([0.05, 0.2, 0.6, 1.5]):
        try:
            stub.Generate(long_request(10 + i, LONG_PROMPT, max_tokens=400), metadata=META, timeout=timeout)
        except grpc.RpcError as e:
            assert e.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        wait_idle(APP)
