"""Placement of the multi-GPU runs (cluster.bench.placement): what each mode asks Ray for, the
check against the GPU ids replicas report, and (slow) a real deployment on fake GPUs."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from cluster.bench import placement
from cluster.bench.placement import Mode


def test_modes_ask_for_gpus_and_count_them():
    own = placement.own_drafter(3)
    assert own.gpus == 4 and placement.colocated(3).gpus == 3 and placement.SHARED.gpus == 1
    o = own.overrides()
    assert o["placement"] == "disaggregated"
    assert o["verifier"] == {"num_replicas": 3, "ray_actor_options": {"num_gpus": 1.0, "num_cpus": 1}}
    assert o["drafter"]["ray_actor_options"]["num_gpus"] == 1.0
    assert "drafter" not in placement.colocated().overrides()


@pytest.mark.parametrize("mode, gmap, ok", [
    (placement.own_drafter(2), {"verifiers": {"a": ["1"], "b": ["2"]}, "drafter": ["0"]}, True),
    (placement.own_drafter(2), {"verifiers": {"a": ["1"], "b": ["1"]}, "drafter": ["0"]}, False),
    (placement.own_drafter(2), {"verifiers": {"a": ["1"], "b": ["0"]}, "drafter": ["0"]}, False),
    (placement.own_drafter(2), {"verifiers": {"a": ["1"]}, "drafter": ["0"]}, False),  # one never reported
    (placement.SHARED, {"verifiers": {"a": ["0"]}, "drafter": ["0"]}, True),
    (placement.SHARED, {"verifiers": {"a": ["0"]}, "drafter": ["1"]}, False),
    (placement.colocated(), {"verifiers": {"a": []}, "drafter": None}, False),  # no GPU at all
    (Mode("two", "colocated", 2), {"verifiers": {"a": ["0"], "b": ["1"]}, "drafter": None}, True),
])
def test_check_names_every_misplacement(mode, gmap, ok):
    assert (placement.check(mode, gmap) == []) is ok


def deploy_on_fake_gpus() -> None:
    """Two verifiers and one Drafter replica on a Ray told of 3 GPUs (a CPU machine): each
    holds a GPU id of its own, and both verifiers draft through the one drafter."""
    import ray
    from ray import serve

    from cluster.bench.load import run_grpc
    from cluster.config import parse_config
    from cluster.serve.launch import run_app, shutdown, start_serve
    from tests.conftest import DEMO, REPO, free_port

    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    mode, port, app = placement.own_drafter(2), free_port(), "placement-test"
    ray.init(address="local", num_cpus=8, num_gpus=3, include_dashboard=False, log_to_driver=False)
    try:
        start_serve(parse_config({"network": {"grpc_port": port, "http_port": free_port()}}), "HeadOnly")
        run_app(parse_config({"models": {"device": "cpu", "target": str(DEMO / "target"), "draft": str(DEMO / "draft")},
                              "engine": {"max_num_seqs": 4}, "kvdir": {"url": None, "routing": "power_of_two"},
                              "network": {"grpc_port": port, "app_name": app, "route_prefix": f"/{app}"}},
                             mode.overrides()))
        gmap = placement.gpu_map(app, mode)
        assert placement.check(mode, gmap) == [], gmap
        ids = [g for v in gmap["verifiers"].values() for g in v] + gmap["drafter"]
        assert sorted(ids) == ["0", "1", "2"], gmap
        res, _ = run_grpc(f"localhost:{port}", app, ["def add(a, b):"] * 8, 4, 8, 4)
        assert len(res) == 8
        board = serve.get_deployment_handle("StatsBoard", app)
        for _ in range(20):  # replicas report twice a second
            reps = board.snapshot.remote().result()["replicas"]
            if len(reps) == 2 and all(s["drafted"] > 0 for s in reps.values()):
                break
            time.sleep(0.5)
        assert len(reps) == 2 and all(s["drafted"] > 0 for s in reps.values()), reps
        print("placement", gmap)
    finally:
        shutdown()


@pytest.mark.slow
def test_one_drafter_gpu_for_two_verifiers_on_fake_gpus(demo_pair):
    """In a process of its own: its Ray has fake GPUs, the session's shared cluster has none."""
    from tests.conftest import REPO

    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)}
    r = subprocess.run([sys.executable, "-c", "from tests.bench.test_placement import deploy_on_fake_gpus as f; f()"],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    assert "placement" in r.stdout
