"""Autoscaling on the session's Ray cluster, through Serve's own controller and our policies
(cluster.policy.autoscaling), with short delays from a test autoscaling file.

One app, speculation off, under load: the drafter pool (started at 2) shrinks to its
minimum of 1 because nobody asks it for drafts, while the verifier pool grows to 2 because
each pass carries more verify tokens than the (deliberately low) target. GetStats reports
the same state.
"""

from __future__ import annotations

import threading
import time

import pytest

from cluster.client import Client
from cluster.config import parse_config

pytestmark = pytest.mark.slow

SCALING = """
verifier:
  min_replicas: 1
  max_replicas: 2
  target_verify_tokens: 2      # a batch of 4 plain-decoding rows is 4 tokens: 2 replicas
  upscale_delay_s: 0
  downscale_delay_s: 600
  look_back_period_s: 2
  metrics_interval_s: 0.5
drafter:
  min_replicas: 1
  max_replicas: 2
  initial_replicas: 2
  target_draft_tokens: 64
  upscale_delay_s: 0
  downscale_delay_s: 20        # the test watches the initial 2 while the app deploys
  look_back_period_s: 2
  metrics_interval_s: 0.5
"""


def running(app: str) -> dict[str, int]:
    from ray import serve

    deps = serve.status().applications[app].deployments
    return {name: d.replica_states.get("RUNNING", 0) for name, d in deps.items()}


def wait_for(check, timeout_s: float, what: str, seen: list):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.5)
    pytest.fail(f"timed out waiting for {what}; replica counts seen: {seen[-5:]}")


def test_speculation_off_shrinks_drafters_and_load_grows_verifiers(serve_grpc, demo_pair, tmp_path):
    from ray import serve

    from cluster.serve.launch import run_app

    scaling = tmp_path / "autoscaling.yaml"
    scaling.write_text(SCALING)
    name = "spec-autoscaling"
    cfg = parse_config({
        "placement": "disaggregated",
        "speculation": {"mode": "off"},
        "autoscaling_file": str(scaling),
        "network": {"grpc_port": serve_grpc, "app_name": name, "route_prefix": f"/{name}"},
        "engine": {"max_num_seqs": 8, "max_model_len": 256},
        "kvdir": {"url": None},
        "verifier": {"autoscaling": True, "ray_actor_options": {"num_cpus": 1, "accelerator_type": "H100"}},
        "drafter": {"autoscaling": True, "ray_actor_options": {"num_cpus": 1, "resources": {"head": 0.01}}},
    })
    t0 = time.monotonic()
    stop, errors, seen = threading.Event(), [], []
    deployed = threading.Event()

    def watch():  # the drafters' count while the app deploys: they may start shrinking before it returns
        while not deployed.is_set():
            try:
                seen.append(running(name))
            except Exception:  # noqa: BLE001 - the app is not there yet
                pass
            deployed.wait(0.25)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        run_app(cfg)
    finally:
        deployed.set()
        watcher.join(10)
    client = Client(f"localhost:{serve_grpc}", application=name, timeout=60)

    def stream(i):
        while not stop.is_set():
            try:
                r = client.generate(f"def f{i}(x):\n    return", max_tokens=24, speculation="auto")
                assert r.spec.drafted == 0  # policy off: auto means plain decoding
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(e)
                return

    def counts():
        seen.append(running(name))
        return seen[-1]

    try:
        counts()
        assert max(c.get("Drafter", 0) for c in seen) == 2, seen[-5:]  # initial_replicas
        threads = [threading.Thread(target=stream, args=(i,), daemon=True) for i in range(4)]
        for t in threads:
            t.start()
        wait_for(lambda: counts().get("Drafter") == 1, 120, "drafters to shrink to min_replicas", seen)
        wait_for(lambda: counts().get("Verifier") == 2, 90, "a second verifier under load", seen)
        assert not errors, errors[:3]
        stats = client.stats()
        assert stats.metrics["drafted"] == 0 and stats.metrics["mean_gamma"] == 0
        assert stats.metrics["speculating_replicas"] == 0
        assert stats.metrics["verify_tokens"] > 0
    finally:
        stop.set()
        client.close()
        serve.delete(name)
    assert time.monotonic() - t0 < 300
