"""A client that leaves stops its sequence: 50 gRPC streams and 50 OpenAI SSE streams, each
dropped after a few tokens, are all aborted and freed on the verifier. Read from the verifier's
own counters (engine totals `finished` and `aborted`, running sequences, KV).

Through gRPC this needs cluster.serve.proxy_patch's cancel from the RPC's done callback (Ray
2.60's proxy loses a few of these cancels without it). The engine is paused
(Verifier.pause) once every stream has its first tokens and before the clients leave: how
fast an abort crosses proxy, router and replica is a speed (past 1 s for a few streams in a
full suite on 2 cores), and a sequence that outran its abort would end as `finished`.
Paused, each sequence alive when its client left can end only by its abort. How soon they are
freed is printed, not asserted (a speed, for benchmarks).
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
openai = pytest.importorskip("openai")

APP, N, MAX_TOKENS = "cancel", 50, 400
FREED_WITHIN_S = 20.0  # a bound for a hang, not a speed

META = [("application", APP)]
# greedy: the demo target's continuation has no EOS within MAX_TOKENS, so a sequence can only
# end by running to MAX_TOKENS (far past the few tokens read) or by its client leaving
PROMPT = "import os\nimport sys\n\ndef main("


@pytest.fixture(scope="module")
def app(serve_ports, demo_pair):
    from ray import serve

    from cluster.serve.launch import run_app

    run_app(parse_config({
        "placement": "colocated",
        "engine": {"max_num_seqs": 64, "max_waiting": 64, "max_model_len": 512},
        "router": {"per_client_concurrency": 128},
        "verifier": {"ray_actor_options": {"num_cpus": 1}},
        "kvdir": {"url": None},
        "network": {"grpc_port": serve_ports[0], "http_port": serve_ports[1], "app_name": APP,
                    "route_prefix": f"/{APP}"},
    }))
    yield serve_ports
    serve.delete(APP)


def _leave_together(streams: list, after) -> tuple[float, dict]:
    """Each stream reads a few tokens; then the engine is paused and all leave at once.
    Returns when the last left, with the verifier's stats once the pause took effect."""
    started, errors, ready, go = [], [], threading.Barrier(len(streams) + 1), threading.Event()

    def one(i, open_stream):
        it, close = open_stream(i)
        try:
            for _ in range(after(i)):
                next(it)
        except Exception as e:  # noqa: BLE001 - reported below: a stream that never ran
            errors.append((i, repr(e)))
        finally:
            started.append(i)
            ready.wait(120)
            go.wait(120)
            close()

    threads = [threading.Thread(target=one, args=(i, s)) for i, s in enumerate(streams)]
    for t in threads:
        t.start()
    ready.wait(120)  # every stream is generating
    paused = _verifier().pause.remote(True).result(timeout_s=30)
    go.set()
    for t in threads:
        t.join(60)
    assert not errors, errors
    assert len(started) == len(streams)
    return time.monotonic(), paused


def _verifier():
    from ray import serve

    return serve.get_deployment_handle("Verifier", APP)


def _check_freed(left: tuple[float, dict], before: dict) -> None:
    """Every sequence alive when its client left is aborted and freed, while the engine,
    paused, runs no step: none can end any other way."""
    left_at, paused = left
    try:
        s = wait_until(lambda: (s := verifier_stats(APP))["running"] == 0 and s["waiting"] == 0
                       and s["kv_slots_used"] == 0 and s, FREED_WITHIN_S, "every dropped sequence to be freed", 0.02)
        print(f"freed {time.monotonic() - left_at:.2f} s after the clients left; "
              f"{paused['finished'] - before['finished']} had run to their end before")
        assert s["steps"] == paused["steps"], "the engine stepped while paused"
        assert s["finished"] == paused["finished"], (s, paused)
        assert s["aborted"] - before["aborted"] == N - (paused["finished"] - before["finished"]), (s, paused, before)
    finally:
        _verifier().pause.remote(False).result(timeout_s=30)
    wait_idle(APP)


def test_dropped_grpc_streams_stop(app):
    before = wait_idle(APP)
    with grpc.insecure_channel(f"localhost:{app[0]}") as ch:
        stub = pb_grpc.GenerationStub(ch)

        def open_stream(i):
            call = stub.GenerateStream(build_request(PROMPT, max_tokens=MAX_TOKENS, speculation=4 if i % 2 else "off"),
                                       metadata=META, timeout=120)
            return call, call.cancel

        left = _leave_together([open_stream] * N, lambda i: 1 + i % 5)
        _check_freed(left, before)


def test_dropped_sse_streams_stop(app):
    before = wait_idle(APP)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{app[1]}/{APP}/v1", api_key="unused", max_retries=0,
                           timeout=120)

    def open_stream(i):
        stream = client.completions.create(model="demo-target", prompt=PROMPT, max_tokens=MAX_TOKENS, stream=True,
                                           temperature=0.0, extra_body={"speculation": 4 if i % 2 else "off"})
        return iter(stream), stream.close

    left = _leave_together([open_stream] * N, lambda i: 1 + i % 5)
    _check_freed(left, before)
