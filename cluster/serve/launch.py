"""Start (or join) Ray, start Serve with the gRPC proxy, and deploy the application."""

from __future__ import annotations

import contextlib
import io
import logging
import os

import ray
from ray import serve
from ray.serve.config import gRPCOptions, HTTPOptions

from cluster.config import ClusterConfig
from cluster.serve import proxy_patch
from cluster.serve.app import SERVICERS, build_app

log = logging.getLogger(__name__)
_stop_kvdir = None  # stops the server start_embedded_kvdir started, if any


def grpc_options(cfg: ClusterConfig) -> gRPCOptions:
    return gRPCOptions(port=cfg.network.grpc_port, grpc_servicer_functions=SERVICERS)


def deploy(cfg: ClusterConfig, address: str | None = None, num_cpus: int | None = None,
           blocking: bool = False, proxy_location: str = "EveryNode") -> dict:
    """Returns {grpc, http, dashboard}; the app stays up until `shutdown()`. Without an address
    it joins $RAY_ADDRESS where that is set, else starts a Ray of its own (not one it happens to
    find running on this machine, whose resources and Serve apps are someone else's)."""
    if not ray.is_initialized():
        address = address or os.environ.get("RAY_ADDRESS") or "local"
        if address == "local" and num_cpus is None:
            # Router, Verifier and Drafter take a logical CPU each; a laptop-sized local Ray
            # must still place all three (they mostly wait on each other, not on the cores).
            num_cpus = max(4, os.cpu_count() or 1)
        ray.init(address=address, num_cpus=num_cpus, include_dashboard=None, namespace="spec-cluster",
                 runtime_env=RUNTIME_ENV, log_to_driver=False)
    cfg = start_embedded_kvdir(cfg)
    warn_if_open(cfg)
    start_serve(cfg, proxy_location)
    run_app(cfg, blocking)
    ctx = ray.get_runtime_context()
    dashboard = getattr(ctx, "dashboard_url", None) or ray._private.worker.get_dashboard_url()
    return {"grpc": f"localhost:{cfg.network.grpc_port}", "http": http_base_url(cfg),
            "dashboard": f"http://{dashboard}" if dashboard else ""}


def http_base_url(cfg: ClusterConfig) -> str:
    """The OpenAI API's base URL: Serve's HTTP proxy routes the app's prefix to the Router."""
    prefix = cfg.network.route_prefix.rstrip("/")
    return f"http://localhost:{cfg.network.http_port}{prefix}/v1"


def start_embedded_kvdir(cfg: ClusterConfig) -> ClusterConfig:
    """kvdir.url 'embedded': start one local Redis-protocol server (until `shutdown()`) and
    return the config pointing at it. It listens on 127.0.0.1, so it serves a one-machine
    cluster; a multi-node cluster needs a shared redis:// URL."""
    global _stop_kvdir
    if cfg.kvdir.url != "embedded":
        return cfg
    from cluster.kvdir.embedded import start_local_server

    if _stop_kvdir is not None:
        _stop_kvdir()
    url, _stop_kvdir = start_local_server()
    log.info("kv directory: embedded server at %s", url)
    return cfg.model_copy(update={"kvdir": cfg.kvdir.model_copy(update={"url": url})})


def controller_options(cfg: ClusterConfig) -> dict:
    """The proxies' message size limit is an env var Serve reads at import, and the gRPC
    bind address one that cluster.serve.proxy_patch reads: proxies are started by the
    controller and inherit its env."""
    return {"runtime_env": {"env_vars": {"RAY_SERVE_GRPC_MAX_MESSAGE_SIZE": str(cfg.network.max_message_bytes),
                                         proxy_patch.HOST_ENV: cfg.network.host}}}


# The job's runtime env for a driver that starts Serve: every worker of the job, the Serve
# proxies included, runs cluster.serve.proxy_patch first (Serve's controller options take
# env_vars only)
RUNTIME_ENV = {"worker_process_setup_hook": "cluster.serve.proxy_patch.apply"}


LOOPBACK = ("127.0.0.1", "localhost", "::1")


def open_to_network(cfg: ClusterConfig) -> bool:
    """The proxies (gRPC and HTTP, both on network.host) reach other hosts and take no key."""
    from cluster.serve.admission import api_keys

    return cfg.network.host not in LOOPBACK and not api_keys(cfg.router)


def warn_if_open(cfg: ClusterConfig) -> None:
    """Loudly, where anyone who reaches a port can use the cluster without a key."""
    if open_to_network(cfg):
        log.warning("gRPC and HTTP on %s (ports %d, %d) with no API keys: anyone who reaches them can generate "
                    "(set router.api_keys or router.api_keys_env)", cfg.network.host, cfg.network.grpc_port,
                    cfg.network.http_port)


class _Misleading(logging.Filter):
    """Serve's notice, at serve.run after our serve.start, that options "will not be applied":
    there are none to apply (start_serve gave them already), but it reads as if ours were lost."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "will not be applied" not in record.getMessage()


logging.getLogger("ray.serve").addFilter(_Misleading())


def start_serve(cfg: ClusterConfig, proxy_location: str = "EveryNode") -> None:
    """Serve's proxies take their ports once, when Serve first starts on a Ray cluster."""
    serve.start(grpc_options=grpc_options(cfg), proxy_location=proxy_location,
                http_options=HTTPOptions(host=cfg.network.host, port=cfg.network.http_port),
                controller_options=controller_options(cfg))


def run_app(cfg: ClusterConfig, blocking: bool = False) -> None:
    """Deploy the app; a failed deployment raises with each failed deployment's own error in
    the first line (Serve's names only the deployments, and the CLI shows one line)."""
    try:
        serve.run(build_app(cfg), name=cfg.network.app_name, route_prefix=cfg.network.route_prefix, blocking=blocking)
    except RuntimeError as e:
        causes = deploy_errors(cfg.network.app_name)
        if not causes:
            raise
        raise RuntimeError(f"{str(e).splitlines()[0].rstrip('.')}: {'; '.join(causes)}") from e


def deploy_errors(app: str) -> list[str]:
    """'Deployment: the exception' for each deployment of `app` that failed: the last line of
    the message Serve keeps for it, which ends with its replica's traceback."""
    try:
        status = serve.status().applications.get(app)
    except Exception:  # noqa: BLE001 - the deploy's own error is raised anyway
        return []
    out = []
    for name, d in (status.deployments.items() if status else ()):
        lines = [line.strip() for line in (d.message or "").splitlines() if line.strip()]
        if d.status in ("DEPLOY_FAILED", "UNHEALTHY") and lines:
            out.append(f"{name}: {lines[-1]}")
    return out


def shutdown() -> None:
    global _stop_kvdir
    try:
        # Serve's controller ends itself; the raylet then reports its pending long-poll and
        # graceful_shutdown calls as failed ("killed by ray.kill ... infinite retries"), on this
        # driver's stdout: the expected end of a clean shutdown, not news for the user
        with contextlib.redirect_stdout(io.StringIO()):
            serve.shutdown()  # first, so verifiers remove their directory entries cleanly
    finally:
        if ray.is_initialized():
            ray.shutdown()
        if _stop_kvdir is not None:
            _stop_kvdir()
            _stop_kvdir = None
