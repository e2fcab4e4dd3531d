"""The Serve cluster end to end: real Ray (two simulated nodes), real gRPC proxy and client.

Greedy outputs through gRPC equal the in-process engine's with speculation off, for both
placements; the verifier lands on the Hopper-labelled node and the drafter elsewhere;
cancelled and expired calls free their sequence; bad input gets INVALID_ARGUMENT.
"""

from __future__ import annotations

import time

import grpc
import pytest

from cluster.client import Client
from cluster.config import parse_config
from cluster.engine.sampling import SamplingParams
from cluster.engine.scheduling.sequence import SpecParams
from cluster.serve.build import build_engine
from tests.conftest import HOPPER
from cluster.bench.chaos import run_concurrently, wait_until
from tests.serve.test_listen import listening

PROMPTS = ["import os\nimport sys\n\ndef main(", "class Config:\n    def __init__(self", "for i in range(",
           "    return self._"]
MAX_TOKENS = 40


def _config(port: int, placement: str, name: str) -> dict:
    return {
        "placement": placement,
        "network": {"grpc_port": port, "app_name": name, "route_prefix": f"/{name}"},
        "engine": {"max_num_seqs": 16, "max_model_len": 512},
        "verifier": {"ray_actor_options": {"num_cpus": 1, "accelerator_type": "H100"}},
        "drafter": {"ray_actor_options": {"num_cpus": 1, "resources": {"head": 0.01}}},
        # the colocated app runs every test here through two Router replicas
        "router": {"num_replicas": 2 if placement == "colocated" else 1},
    }


@pytest.fixture(scope="module")
def reference(demo_pair):
    """Greedy outputs of the in-process engine with speculation off."""
    engine = build_engine(parse_config({"engine": {"max_num_seqs": 16, "max_model_len": 512}}))
    out = engine.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS), SpecParams("off"))
    return [r["token_ids"] for r in out]


@pytest.fixture(scope="module", params=["disaggregated", "colocated"])
def app(request, serve_grpc, demo_pair):
    from ray import serve

    from cluster.serve.launch import run_app

    name = f"spec-{request.param}"
    cfg = parse_config(_config(serve_grpc, request.param, name))
    run_app(cfg)
    client = Client(f"localhost:{serve_grpc}", application=name)
    yield request.param, name, client
    client.close()
    serve.delete(name)


def _verifier_stats(name):
    from ray import serve

    return serve.get_deployment_handle("Verifier", name).stats.remote().result()


def test_unary_and_stream_equal_local_engine(app, reference):
    _, _, client = app
    for prompt, expect in zip(PROMPTS, reference):
        r = client.generate(prompt, max_tokens=MAX_TOKENS, speculation=4)
        assert list(r.token_ids) == expect
        assert r.finish_reason in ("length", "eos", "stop") and r.spec.drafted > 0
        ids = []
        chunks = list(client.generate_stream(prompt, max_tokens=MAX_TOKENS, speculation=3))
        for c in chunks:
            ids += c.token_ids
        assert ids == expect
        assert chunks[-1].final and chunks[-1].timing.ttft_ms > 0
        assert all(not c.final for c in chunks[:-1])


def test_eagle3_per_request_equals_local_engine(app, reference):
    """drafter=eagle3 over gRPC: the head beside the demo target, in the Drafter replica
    (disaggregated: the verifier ships the aux hidden states of new tokens over ZeroMQ) or
    in the verifier's process (colocated); greedy output is the reference token for token."""
    from cluster.serve.build import eagle3_dir

    placement, name, client = app
    if eagle3_dir(parse_config(_config(1, placement, name))) is None:
        pytest.skip("no EAGLE-3 head beside the demo target")
    accepted = 0
    for prompt, expect in zip(PROMPTS, reference):
        r = client.generate(prompt, max_tokens=MAX_TOKENS, speculation=4, drafter="eagle3")
        assert list(r.token_ids) == expect
        accepted += r.spec.accepted
        ids = [t for c in client.generate_stream(prompt, max_tokens=MAX_TOKENS, speculation="auto",
                                                 drafter="eagle3") for t in c.token_ids]
        assert ids == expect
    assert accepted > 0
    failures = _verifier_stats(name)["draft_failures"]
    if placement == "disaggregated":  # the head ran in the Drafter replica
        from ray import serve

        info = serve.get_deployment_handle("Drafter", name).info.remote().result()
        # a call given up on (its replica's process stalled on a loaded host) costs speed only;
        # a broken path fails them all
        assert info["calls"]["eagle3"] > 10 * failures, (info["calls"], failures)
    else:
        assert failures == 0  # no call to fail


def test_sixteen_concurrent_streams_complete_and_correct(app, reference):
    _, _, client = app

    def run(i):
        return [t for c in client.generate_stream(PROMPTS[i % len(PROMPTS)], max_tokens=MAX_TOKENS,
                                                  speculation="auto") for t in c.token_ids]

    results, errors = run_concurrently(run, 16, timeout_s=240)
    assert not errors
    assert len(results) == 16
    for i, ids in results.items():
        assert ids == reference[i % len(PROMPTS)]


def test_placement(app, ray_cluster):
    import ray
    from ray import serve

    placement, name, _ = app
    hopper_nodes = {n["NodeID"] for n in ray.nodes() if n["Alive"] and HOPPER in n["Resources"]}
    assert _verifier_stats(name)["node_id"] in hopper_nodes
    if placement == "disaggregated":
        drafter = serve.get_deployment_handle("Drafter", name)
        assert drafter.info.remote().result()["node_id"] not in hopper_nodes
        # network.drafter_host auto: the test's Ray nodes share one host, so loopback only
        endpoint = drafter.endpoint.remote().result()
        assert endpoint.startswith("tcp://127.0.0.1:"), endpoint
        assert listening(int(endpoint.rsplit(":", 1)[1])) == {"0100007F"}


def _wait_idle(name, timeout=20.0):
    deadline = time.time() + timeout
    while time.time() < deadline:
        s = _verifier_stats(name)
        if s["kv_slots_used"] == 0 and s["kv_blocks_used"] == 0 and s["running"] == 0 and s["waiting"] == 0:
            return s
        time.sleep(0.2)
    raise AssertionError(f"sequences left behind: {s}")


def test_cancelled_stream_frees_its_sequence(app):
    _, name, client = app
    stream = client.generate_stream(PROMPTS[0], max_tokens=400, temperature=1.0, seed=1)
    next(stream)
    s = _verifier_stats(name)
    assert s["kv_slots_used"] >= 1 and s["kv_blocks_used"] >= 1
    stream.close()  # the client cancels the call
    _wait_idle(name)


def test_deadline_frees_its_sequence(app, serve_grpc):
    _, name, _ = app
    with Client(f"localhost:{serve_grpc}", application=name, timeout=0.5) as c:
        with pytest.raises(grpc.RpcError) as e:
            c.generate(PROMPTS[1], max_tokens=500, temperature=1.0, seed=2)
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    _wait_idle(name)


@pytest.mark.parametrize("kwargs,needle", [
    (dict(prompt=""), "prompt is empty"),
    (dict(temperature=-0.5), "temperature"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_k=-1), "top_k"),
    (dict(max_tokens=100000), "max_tokens"),
    (dict(speculation=99), "gamma"),
])
def test_invalid_argument(app, kwargs, needle):
    _, _, client = app
    kwargs = dict(kwargs)  # parametrized dicts are shared between the two placements
    prompt = kwargs.pop("prompt", "x = ")
    with pytest.raises(grpc.RpcError) as e:
        client.generate(prompt, **{"max_tokens": 8, **kwargs})
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert needle in e.value.details()


def test_model_info_stats_and_health(app):
    placement, _, client = app
    info = client.model_info()
    assert info.placement == placement and info.attention_backend == "sdpa" and info.vocab_size > 0
    assert client.health() == "SERVING"
    deadline = time.time() + 10
    while time.time() < deadline:
        stats = client.stats()
        if stats.replicas:
            break
        time.sleep(0.5)
    assert len(stats.replicas) == 1 and stats.replicas[0].kv_slots_total == 16


def test_router_replicas(app):
    from ray import serve

    placement, name, client = app
    router = serve.status().applications[name].deployments["Router"]
    assert sum(n for state, n in router.replica_states.items() if state == "RUNNING") == (
        2 if placement == "colocated" else 1)
    # concurrent requests through the proxy, which spreads them over the routers by load
    outs, errors = run_concurrently(lambda i: client.generate(PROMPTS[i % len(PROMPTS)], max_tokens=4), 8, 120)
    assert not errors and sorted(outs) == list(range(8)) and all(len(o.token_ids) == 4 for o in outs.values())


def test_get_stats_reports_the_paged_kv_pool(app):
    """GetStats carries each replica's KV pool: blocks exist, and once the replica is idle
    none is held by a sequence (a leak would keep some); the cluster map sums them."""
    _, name, client = app
    client.generate(PROMPTS[2], max_tokens=MAX_TOKENS)
    _wait_idle(name)

    def idle_pool():  # the board takes each replica's stats once a second
        s = client.stats()
        r = s.replicas[0] if len(s.replicas) == 1 else None
        return s if r is not None and r.kv_blocks_total > 0 and r.kv_blocks_used == 0 and r.kv_slots_used == 0 else None

    stats = wait_until(idle_pool, 15, "GetStats to report an idle KV pool")
    r = stats.replicas[0]
    # on CPU with kv_cache_gb unset the pool has room for max_num_seqs x max_model_len tokens
    assert r.kv_blocks_total * 16 >= 16 * 512  # blocks x block_size, max_num_seqs x max_model_len
    assert 0 <= r.kv_blocks_cached <= r.kv_blocks_total and r.preemptions == 0
    assert stats.metrics["kv_blocks_total"] == r.kv_blocks_total and stats.metrics["kv_blocks_used"] == 0


def test_get_stats_reports_drafts_made_ahead(app):
    """A drafter replica drafts the next step while the verifier verifies this one (on the guess
    that every draft is accepted): GetStats counts the rows whose guessed drafts were used or
    dropped, as the engine does. A CPU draft model beside the target has no stream of its own
    to draft on meanwhile, so colocated there is none."""
    placement, name, client = app
    client.generate(PROMPTS[0], max_tokens=MAX_TOKENS, speculation=4)
    _wait_idle(name)
    engine = _verifier_stats(name)

    def reported():  # the board takes each replica's stats once a second
        r = client.stats().replicas
        made = engine["ahead_hits"] + engine["ahead_misses"]
        return r[0] if len(r) == 1 and r[0].ahead_hits + r[0].ahead_misses >= made else None

    r = wait_until(reported, 15, "GetStats to report the drafts made ahead")
    assert (r.ahead_hits, r.ahead_misses, r.draft_failures) == (
        engine["ahead_hits"], engine["ahead_misses"], engine["draft_failures"])
    if placement == "disaggregated":
        assert r.ahead_hits + r.ahead_misses > 0
    else:
        assert r.ahead_hits + r.ahead_misses == 0


def test_a_repeated_prompt_reports_its_cached_tokens(app):
    """The final response and the stream's final chunk say how many prompt tokens the replica's
    prefix cache served (OpenAI's `cached_tokens`): none for a new prompt, every full block but
    the last token's for the same prompt again, from the replica that served both."""
    _, name, client = app
    prompt = f"# {name}: cached tokens\n" + "".join(f"x{i} = {i}\n" for i in range(24))
    first = client.generate(prompt, max_tokens=4)
    assert first.cached_tokens == 0 and first.prompt_tokens > 48
    *_, final = client.generate_stream(prompt, max_tokens=4)
    assert final.final and final.prompt_tokens == first.prompt_tokens and final.replica == first.replica
    assert final.cached_tokens == 16 * ((first.prompt_tokens - 1) // 16)
