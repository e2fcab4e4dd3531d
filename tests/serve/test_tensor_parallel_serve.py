"""A tensor-parallel verifier through Serve (issue 26): the demo pair over 2 ranks (gloo, fp32,
CPU), the replica's two CPUs reserved as one STRICT_PACK placement group, rank 1 a Ray actor
in bundle 1. Greedy tokens through the real gRPC endpoint are the one-process engine's, for
plain decoding and for every drafter tensor parallelism serves; a follower killed under load
takes its replica down cleanly (streams fail over or end UNAVAILABLE, never wrong tokens or
a hang), Serve replaces it, and no rank outlives its replica."""

from __future__ import annotations

import os
import signal
import threading
import time

import grpc
import pytest
import ray

from cluster.client import Client
from cluster.config import parse_config
from cluster.bench.chaos import PREFIX, plain_tokens, replica_ids, wait_healthy, wait_idle, wait_until

pytestmark = pytest.mark.slow

APP = "tensor-parallel"
PROMPTS = ["import os\nimport sys\n\ndef main(", "class Config:\n    def __init__(self", "for i in range(",
           "def parse_args(argv):"]
MAX_TOKENS = 48  # per request in the parity tests; the fault test's streams run to LONG
LONG = 160
ENGINE = {"max_num_seqs": 8, "max_model_len": 256}


@pytest.fixture(scope="module")
def client(serve_grpc, demo_pair):
    from ray import serve

    from cluster.serve.launch import run_app

    run_app(parse_config({
        "placement": "colocated",
        "engine": {**ENGINE, "tensor_parallel_size": 2},
        "models": {"dtype": "float32", "device": "cpu"},
        # one replica: while it is replaced, broken streams wait for the new one (or end UNAVAILABLE)
        "router": {"failover_wait_s": 90.0},
        "verifier": {"ray_actor_options": {"num_cpus": 1}},
        "kvdir": {"url": None},
        "network": {"grpc_port": serve_grpc, "app_name": APP, "route_prefix": f"/{APP}"},
    }))
    with Client(f"localhost:{serve_grpc}", application=APP, timeout=240) as c:
        yield c
    serve.delete(APP)
    wait_until(lambda: not followers(), 60, "the followers to end with their replica")


@pytest.fixture(scope="module")
def reference(demo_pair):
    """The one-process engine's greedy tokens (LONG; a shorter request's are their prefix)."""
    return plain_tokens(PROMPTS, LONG, ENGINE)


def followers(rid: str | None = None) -> dict[str, dict]:
    """Live follower ranks of the app's verifier replicas (or of replica `rid`), by actor name:
    cluster.serve.followers names them `<replica actor>::rank-<r>`; each says where it runs."""
    head = f"{PREFIX}{APP}#Verifier#{rid or ''}"
    named = [(a["name"], a["namespace"]) for a in ray.util.list_named_actors(all_namespaces=True)
             if a["name"].startswith(head) and "::rank-" in a["name"]]
    return {n: ray.get(ray.get_actor(n, namespace=ns).where.remote(), timeout=30) for n, ns in named}


def replica_group(rid: str) -> tuple[str, dict]:
    """(id, table entry) of the placement group Serve made for replica `rid` (named after it)."""
    name = f"{PREFIX}{APP}#Verifier#{rid}"
    [(pg, entry)] = [(k, v) for k, v in ray.util.placement_group_table().items()
                     if v["name"] == name and v["state"] == "CREATED"]
    return pg, entry


@pytest.mark.parametrize("drafter,speculation", [("", "off"), ("model", 4), ("ngram", 3), ("early-exit", 2)])
def test_greedy_tokens_match_one_process(client, reference, drafter, speculation):
    got = [client.generate(p, max_tokens=MAX_TOKENS, speculation=speculation, drafter=drafter) for p in PROMPTS]
    assert [list(r.token_ids) for r in got] == [r[:MAX_TOKENS] for r in reference]
    if drafter in ("model", "early-exit"):
        assert sum(r.spec.drafted for r in got) > 0, "it speculated"
    wait_idle(APP)


def test_the_replica_and_its_follower_share_one_placement_group(client):
    wait_healthy(APP)
    (rid,) = replica_ids(APP, "Verifier")
    pg, group = replica_group(rid)
    assert group["strategy"] == "STRICT_PACK"
    assert list(group["bundles"].values()) == [{"CPU": 1.0}, {"CPU": 1.0}]
    (follower,) = followers(rid).values()
    assert follower["placement_group_id"] == pg
    assert follower["node_id"] == group["bundles_to_node_id"][1] == group["bundles_to_node_id"][0]


def test_a_killed_follower_takes_its_replica_down(client, reference):
    wait_healthy(APP)
    (before,) = replica_ids(APP, "Verifier")
    ((victim_name, victim),) = followers(before).items()
    streamed, errors, ends = [[] for _ in PROMPTS], [None] * len(PROMPTS), [0.0] * len(PROMPTS)
    first = threading.Barrier(len(PROMPTS) + 1, timeout=120)

    def run(i):
        try:
            for k, chunk in enumerate(client.generate_stream(PROMPTS[i], max_tokens=LONG,
                                                             speculation=4 if i % 2 else "off")):
                streamed[i] += chunk.token_ids
                if k == 0:
                    first.wait()
        except grpc.RpcError as e:
            errors[i] = e
        ends[i] = time.monotonic()

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    first.wait()  # every stream has its first tokens: all four are in flight
    os.kill(victim["pid"], signal.SIGKILL)  # a crash, not a polite stop
    at_kill = sum(map(len, streamed))
    for t in threads:
        t.join(240)
    assert not any(t.is_alive() for t in threads), "a stream hung"
    assert at_kill < sum(map(len, reference)), "the kill landed while tokens were still to come"
    # each stream either failed over to the replacement with the unbroken run's tokens, or
    # ended UNAVAILABLE with a prefix of them: never other tokens, never another error
    for i, (ids, e) in enumerate(zip(streamed, errors)):
        if e is None:
            assert ids == reference[i], i
        else:
            assert e.code() == grpc.StatusCode.UNAVAILABLE and ids == reference[i][:len(ids)], (i, e)

    wait_until(lambda: replica_ids(APP, "Verifier") and before not in replica_ids(APP, "Verifier"), 120,
               "a replacement verifier")
    wait_healthy(APP, 180)
    r = client.generate(PROMPTS[1], max_tokens=MAX_TOKENS, speculation=4, drafter="model")
    assert list(r.token_ids) == reference[1][:MAX_TOKENS] and r.replica != before
    # nothing outlived the old replica: one live follower, the new replica's, in its group
    (rid,) = replica_ids(APP, "Verifier")
    wait_until(lambda: list(followers()) == [f"{PREFIX}{APP}#Verifier#{rid}::rank-1"], 60, "one live follower")
    assert followers()[f"{PREFIX}{APP}#Verifier#{rid}::rank-1"]["placement_group_id"] == replica_group(rid)[0]
    assert victim_name not in followers() and not any(v["name"].startswith(f"{PREFIX}{APP}#Verifier#{before}")
                                                       for v in ray.util.placement_group_table().values()
                                                       if v["state"] == "CREATED")
    wait_idle(APP)
