"""Serve's gRPC proxy binds network.host, as its HTTP proxy does.

Ray 2.60's gRPC proxy binds `[::]:<port>` whatever the HTTP options' host says
(`grpc_util.start_grpc_server`) and Serve has no option for it. `apply`, run in every worker
of the job that starts Serve (the worker setup hook `launch.RUNTIME_ENV`; the proxies are
such workers), makes it bind `SPEC_CLUSTER_GRPC_HOST`, which the controller's env hands the
proxies (`launch.controller_options`). So a default `spec-cluster up` serves generation on
loopback only. Written against Ray 2.60 (pyproject pins it); under any other version it
patches nothing and says so, rather than patch code it has not read (tests/serve/test_listen.py
pins the version too).
"""

from __future__ import annotations

import logging
import os

RAY_VERSION = "2.60.0"
HOST_ENV = "SPEC_CLUSTER_GRPC_HOST"


def apply() -> None:
    """The worker setup hook: patch when this process is (or may become) a Serve proxy."""
    import ray

    if ray.__version__ != RAY_VERSION:
        logging.getLogger(__name__).warning("Ray %s, not %s: Serve's gRPC proxy left as it is (it binds [::])",
                                            ray.__version__, RAY_VERSION)
        return
    _bind_host()


def _bind_host() -> None:
    from ray.serve._private import default_impl

    host = os.environ.get(HOST_ENV)
    if not host or getattr(default_impl.add_grpc_address, "patched", False):
        return
    original = default_impl.add_grpc_address

    def add_grpc_address(server, address: str):
        port = address.rpartition(":")[2]
        return original(server, f"[{host}]:{port}" if ":" in host else f"{host}:{port}")

    add_grpc_address.patched = True
    default_impl.add_grpc_address = add_grpc_address
