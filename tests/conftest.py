"""Shared fixtures: one Ray cluster for the whole session (two simulated nodes), the demo pair."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DEMO = REPO / "cluster" / "models" / "demo"
HOPPER = "accelerator_type:H100"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def demo_pair() -> tuple[Path, Path]:
    if not (DEMO / "target" / "config.json").exists():
        pytest.skip("demo models not present (spec-cluster models train-demo)")
    return DEMO / "target", DEMO / "draft"


@pytest.fixture(scope="session")
def ray_cluster():
    """A head node (CPU, runs router and drafters) and a worker node that advertises the
    Hopper accelerator resource (runs verifiers): `ray.cluster_utils.Cluster`, one per session."""
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    # workers import `cluster` from the checkout even when it is not pip-installed
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 6, "resources": {"head": 1}})
    cluster.add_node(num_cpus=6, resources={HOPPER: 1, "hopper_node": 1})
    from cluster.serve.launch import RUNTIME_ENV  # the proxies' patches (cluster.serve.proxy_patch)

    ray.init(address=cluster.address, namespace="spec-cluster-tests", log_to_driver=False, runtime_env=RUNTIME_ENV)
    yield cluster
    from ray import serve

    try:
        serve.shutdown()
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture(scope="session")
def serve_ports(ray_cluster) -> tuple[int, int]:
    """Serve with its gRPC and HTTP proxies on one port each for the session: (grpc, http).
    Tests deploy named apps on them; gRPC calls send `application` metadata, HTTP ones use
    the app's route prefix (several apps share the proxies)."""
    from cluster.config import parse_config
    from cluster.serve.launch import start_serve

    ports = free_port(), free_port()
    start_serve(parse_config({"network": {"grpc_port": ports[0], "http_port": ports[1]}}), proxy_location="HeadOnly")
    return ports


@pytest.fixture(scope="session")
def serve_grpc(serve_ports) -> int:
    return serve_ports[0]
