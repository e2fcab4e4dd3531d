"""Faults on a live app through the real gRPC endpoint: they cost speed or a clean error,
never a wrong answer, a hang or a leak.

One disaggregated app (one verifier, one drafter, a real Redis-protocol KV directory):
- the drafter replica is killed mid-generation: in-flight greedy streams finish with the
  tokens of plain decoding; once Serve has replaced the drafter, speculation resumes;
- the verifier replica is killed: with `router.failover_wait_s: 0` its streams end promptly
  with UNAVAILABLE (with two replicas they go on: test_failover.py); the next request is
  served by the replacement;
- the KV directory is killed and restarted under load: every request succeeds, and the
  verifier republishes its blocks;
after each: no KV slot, sequence or draft state left behind.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import redis

from cluster.client import Client
from cluster.config import parse_config
from cluster.kvdir.embedded import free_port, start_local_server
from cluster.bench.chaos import (
    drafter_sequences,
    kill_replica,
    plain_tokens,
    replica_ids,
    wait_healthy,
    wait_idle,
    wait_until,
)

pytestmark = pytest.mark.slow

APP = "faults"
PROMPTS = ["import os\nimport sys\n\ndef main(", "class Config:\n    def __init__(self", "for i in range(",
           "    return self._", "def parse_args(argv):", "with open(path) as f:"]
MAX_TOKENS = 96
ENGINE = {"max_num_seqs": 8, "max_model_len": 256}


@pytest.fixture(scope="module")
def kvdir():
    port = free_port()
    url, stop = start_local_server(port=port)
    server = {"url": url, "port": port, "stop": stop}
    yield server
    server["stop"]()


@pytest.fixture(scope="module")
def client(serve_grpc, demo_pair, kvdir):
    from ray import serve

    from cluster.serve.launch import run_app

    run_app(parse_config({
        "name": APP,
        "placement": "disaggregated",
        "engine": ENGINE,
        # one verifier: its death ends its streams at once (test_failover.py: with two, they go on)
        "router": {"drafter_timeout_s": 1.0, "drafter_state_ttl_s": 5.0, "failover_wait_s": 0.0},
        "verifier": {"ray_actor_options": {"num_cpus": 1}},
        "drafter": {"ray_actor_options": {"num_cpus": 1, "resources": {"head": 0.01}}},
        "kvdir": {"url": kvdir["url"], "ttl_s": 3.0},
        "network": {"grpc_port": serve_grpc, "app_name": APP, "route_prefix": f"/{APP}"},
    }))
    with Client(f"localhost:{serve_grpc}", application=APP, timeout=120) as c:
        yield c
    serve.delete(APP)


@pytest.fixture(scope="module")
def reference(demo_pair):
    return plain_tokens(PROMPTS, MAX_TOKENS, ENGINE)


def run_streams(client, prompts, **kw):
    """Start one stream per prompt; returns (ids per stream, errors, all-started event,
    end times, threads)."""
    ids, errors, ends = [[] for _ in prompts], [None] * len(prompts), [0.0] * len(prompts)
    started, count, lock = threading.Event(), [0], threading.Lock()

    def run(i):
        try:
            for k, chunk in enumerate(client.generate_stream(prompts[i], **kw)):
                ids[i] += chunk.token_ids
                if k == 0:
                    with lock:
                        count[0] += 1
                        if count[0] == len(prompts):
                            started.set()
        except grpc.RpcError as e:
            errors[i] = e
            started.set()
        ends[i] = time.monotonic()

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(prompts))]
    for t in threads:
        t.start()
    return ids, errors, started, ends, threads


def test_drafter_killed_mid_generation(client, reference):
    ids, errors, started, ends, threads = run_streams(client, PROMPTS, max_tokens=MAX_TOKENS, speculation=4)
    assert started.wait(60)
    at_kill = sum(map(len, ids))
    killed = kill_replica(APP, "Drafter")
    for t in threads:
        t.join(120)
    assert errors == [None] * len(PROMPTS)
    assert ids == reference  # lossless with the drafter gone mid-stream
    assert sum(map(len, ids)) > at_kill  # the kill did land mid-generation

    wait_until(lambda: replica_ids(APP, "Drafter") and killed not in replica_ids(APP, "Drafter"), 60,
               "a replacement drafter")
    wait_healthy(APP)
    r = wait_until(lambda: (r := client.generate(PROMPTS[0], max_tokens=24, speculation=4)).spec.drafted > 0 and r,
                   120, "speculation to resume")  # probes back off to 5 s; a loaded host times some out
    assert list(r.token_ids) == reference[0][:24]
    wait_idle(APP, drafter=True)


def test_verifier_killed_mid_generation(client):
    ids, errors, started, ends, threads = run_streams(client, PROMPTS[:4], max_tokens=200, temperature=1.0, seed=3)
    assert started.wait(60)
    before = replica_ids(APP, "Verifier")
    # every live replica reports within FRESH_S (2 s) of the last; a loaded host may miss one
    wait_until(lambda: {r.replica for r in client.stats().replicas} == set(before), 10, "GetStats to show both")
    killed_at = time.monotonic()
    killed = kill_replica(APP, "Verifier")
    # GetStats shows it gone within FRESH_S (2 s) of its last report; slack for a loaded host
    wait_until(lambda: killed not in {r.replica for r in client.stats().replicas}, 15, "GetStats to drop it")
    for t in threads:
        t.join(60)
    # in flight on the dead replica: UNAVAILABLE, promptly (the client deadline is 120 s); a
    # stream may still finish whole in the moment between the kill call and the death
    cut = [e for e in errors if e is not None]
    assert cut and all(e.code() == grpc.StatusCode.UNAVAILABLE for e in cut), errors
    assert all("verifier unavailable" in e.details() for e in cut)
    assert max(ends) - killed_at < 15, f"took {max(ends) - killed_at:.1f}s to fail over"

    r = client.generate(PROMPTS[1], max_tokens=16)  # waits for the replacement, within the deadline
    assert r.finish_reason and r.replica not in before
    wait_healthy(APP)
    # the dead verifier never released its draft state: it expires (drafter_state_ttl_s)
    wait_until(lambda: drafter_sequences(APP) == 0, 30, "orphaned draft state to expire")
    wait_idle(APP, drafter=True)


def test_kv_directory_killed_and_restarted(client, kvdir):
    registry = f"sc:{{{APP}:demo-target}}:replicas"
    wait_healthy(APP)  # on its own, not only after the tests before it: a verifier serves
    assert client.generate(PROMPTS[0], max_tokens=4).finish_reason
    wait_until(lambda: redis.Redis.from_url(kvdir["url"]).zcard(registry) >= 1, 20, "the verifier registered")
    stop_load, failures, done = threading.Event(), [], [0]

    def load(i):
        while not stop_load.is_set():
            try:
                client.generate(PROMPTS[i % len(PROMPTS)] + f" {done[0]}", max_tokens=8, speculation=2)
                done[0] += 1
            except grpc.RpcError as e:
                failures.append(e)

    threads = [threading.Thread(target=load, args=(i,), daemon=True) for i in range(3)]
    for t in threads:
        t.start()
    time.sleep(2)
    kvdir["stop"](hard=True)
    time.sleep(4)
    before_restart = done[0]
    url, kvdir["stop"] = start_local_server(port=kvdir["port"])
    assert url == kvdir["url"]
    time.sleep(4)
    stop_load.set()
    for t in threads:
        t.join(60)
    assert failures == [] and before_restart > 0 and done[0] > before_restart
    wait_until(lambda: redis.Redis.from_url(url).zcard(registry) >= 1, 20, "the verifier republished")
    wait_idle(APP, drafter=True)
