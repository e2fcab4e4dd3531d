"""OpenAI API statuses that need a cluster in trouble, provoked for real through Serve's
HTTP proxy with the official `openai` client:

- 429 when the verifier's own queue is full (engine.max_waiting): the engine refuses the
  sequence (QueueFull), as gRPC's RESOURCE_EXHAUSTED;
- 503 when the verifier serving a request is gone (its replica killed mid-generation): the
  Router's call fails and the request ends as UNAVAILABLE, gRPC's code for the same; a
  streamed request, whose 200 headers are already sent, ends with an error event instead.

One small app of its own, since its verifier is killed.
"""

from __future__ import annotations

import threading
import time

import pytest

from cluster.config import parse_config
from cluster.bench.chaos import kill_replica, replica_ids, verifier_stats, wait_healthy, wait_idle, wait_until

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow

APP = "oai-faults"
MODEL = "demo-target"
PROMPT = "import os\nimport sys\n\ndef main("


@pytest.fixture(scope="module")
def oai(serve_ports, demo_pair):
    from ray import serve

    from cluster.serve.launch import run_app

    run_app(parse_config({
        "placement": "colocated",
        "network": {"grpc_port": serve_ports[0], "http_port": serve_ports[1], "app_name": APP,
                    "route_prefix": f"/{APP}"},
        # one running sequence and one waiting: a third finds the verifier's queue full
        "engine": {"max_num_seqs": 1, "max_waiting": 1, "max_model_len": 512},
        "router": {"failover_wait_s": 0.0},  # its one verifier's death is a 503, not a wait for the next
        "verifier": {"ray_actor_options": {"num_cpus": 1, "accelerator_type": "H100"}},
    }))
    yield openai.OpenAI(base_url=f"http://127.0.0.1:{serve_ports[1]}/{APP}/v1", api_key="unused", max_retries=0,
                        timeout=120)
    serve.delete(APP)


def test_full_verifier_queue_is_429(oai):
    # three choices are three sequences on the one verifier, which holds two
    with pytest.raises(openai.APIStatusError) as info:
        oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=200, n=3, extra_body={"speculation": "off"})
    assert info.value.status_code == 429
    assert info.value.body["type"] == "rate_limit_error" and "queue full" in info.value.body["message"]
    stats = wait_idle(APP)  # the two admitted choices were cancelled with the request
    assert stats["running"] == 0 and stats["kv_blocks_used"] == 0


def _kill_once_running(done: threading.Event) -> float:
    """Kill the verifier once a sequence runs on it; returns when."""
    wait_until(lambda: done.is_set() or verifier_stats(APP, timeout_s=5)["running"] > 0, 60, "a running sequence")
    assert not done.is_set(), "the request finished before the verifier could be killed"
    killed_at = time.monotonic()
    kill_replica(APP, "Verifier")
    return killed_at


def test_verifier_gone_is_503_and_a_stream_error_event(oai):
    body = dict(model=MODEL, prompt=PROMPT, max_tokens=480, extra_body={"speculation": "off"})
    errors, done = [], threading.Event()

    def call():
        try:
            oai.completions.create(**body)
        except openai.APIStatusError as e:
            errors.append(e)
        finally:
            done.set()

    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    before = replica_ids(APP, "Verifier")
    killed_at = _kill_once_running(done)
    thread.join(60)
    [error] = errors
    assert error.status_code == 503, error
    assert error.body["type"] == "service_unavailable" and "verifier unavailable" in error.body["message"]
    assert time.monotonic() - killed_at < 15  # promptly, not at the client's timeout

    # the replacement serves; then a stream cut the same way ends with OpenAI's error event
    wait_until(lambda: set(replica_ids(APP, "Verifier")) - set(before), 60, "a replacement verifier")
    wait_healthy(APP)
    assert oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4).choices[0].text
    stream = oai.completions.create(**body, stream=True)
    first = next(iter(stream))
    assert first.choices[0].finish_reason is None
    kill_replica(APP, "Verifier")
    with pytest.raises(openai.APIError) as info:
        for _ in stream:
            pass
    assert "verifier unavailable" in str(info.value.message)
