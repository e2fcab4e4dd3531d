"""Composes the application from one ClusterConfig: Router -> Verifier -> Drafter.

`serve run cluster.serve.app:app_builder config=configs/cluster.yaml` and
`spec-cluster up` build the same graph.
"""

from __future__ import annotations

import logging

from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from cluster.config import ClusterConfig, load_config, parse_config
from cluster.serve.drafter import DrafterDeployment
from cluster.serve.followers import placement_options, verifier_actor_options
from cluster.serve.router import Router
from cluster.serve.verifier import StatsBoard, Verifier

log = logging.getLogger(__name__)

SERVICERS = ["cluster.serve.wire.add_GenerationServicer_to_server",  # generated one, lenient decoding
             "grpc_health.v1.health_pb2_grpc.add_HealthServicer_to_server"]


def _options(section, autoscaling: dict | None) -> dict:
    opts = {"ray_actor_options": section.ray_actor_options, "max_ongoing_requests": section.max_ongoing_requests}
    if section.autoscaling and autoscaling:
        opts["autoscaling_config"] = autoscaling
    else:
        opts["num_replicas"] = section.num_replicas
    return opts


def request_router_config(cfg: ClusterConfig) -> RequestRouterConfig:
    """How the Router's handle picks a Verifier replica (kwargs must be JSON)."""
    k, e = cfg.kvdir, cfg.engine
    if k.routing == "power_of_two":
        return RequestRouterConfig(request_routing_stats_period_s=k.routing_stats_period_s)
    return RequestRouterConfig(
        request_router_class="cluster.serve.routing:PrefixLoadRouter",
        request_router_kwargs={
            "cluster": cfg.name, "model": cfg.models.target, "url": k.url, "ttl_s": k.ttl_s,
            "block_size": e.block_size, "overlap_weight": k.overlap_weight, "load_weight": k.load_weight,
            "max_imbalance": k.max_imbalance, "imbalance_abs": k.imbalance_abs, "max_num_seqs": e.max_num_seqs,
            "max_batch_tokens": e.max_batch_tokens},
        request_routing_stats_period_s=k.routing_stats_period_s)


def build_app(cfg: ClusterConfig) -> Application:
    scaling = {"verifier": None, "drafter": None}
    if cfg.autoscaling_file:
        from cluster.policy.config import load_autoscaling

        a = load_autoscaling(cfg.autoscaling_file)
        scaling = {"verifier": a.verifier.serve_autoscaling_config(), "drafter": a.drafter.serve_autoscaling_config()}
    if cfg.kvdir.url == "embedded":  # only launch.deploy starts that server
        log.warning("kvdir.url 'embedded' is started by `spec-cluster up` only; without a redis:// URL "
                    "verifier routing uses load only")
        cfg = cfg.model_copy(update={"kvdir": cfg.kvdir.model_copy(update={"url": None})})
    data = cfg.model_dump()
    board = StatsBoard.bind()
    drafter = None
    from cluster.serve.build import remote_drafters

    if cfg.placement == "disaggregated" and remote_drafters(cfg):
        drafter = DrafterDeployment.options(**_options(cfg.drafter, scaling["drafter"])).bind(data)
    # a tensor-parallel replica reserves all its devices as one placement group (cluster.serve.followers)
    opts = {**_options(cfg.verifier, scaling["verifier"]), "ray_actor_options": verifier_actor_options(cfg)}
    verifier = Verifier.options(**opts, **placement_options(cfg),
                                request_router_config=request_router_config(cfg)).bind(data, drafter, board)
    # the Router refuses past max_inflight itself; max_queued_requests bounds what waits in
    # the proxies for a Router slot (RESOURCE_EXHAUSTED beyond), which is unbounded by default
    return Router.options(num_replicas=cfg.router.num_replicas, max_ongoing_requests=cfg.router.max_inflight * 2,
                          max_queued_requests=cfg.router.max_inflight).bind(data, verifier, board)


def app_builder(args: dict) -> Application:
    """Serve's typed-args entry point: args {config: path} and/or {overrides: {...}}."""
    overrides = args.get("overrides") or {}
    if "config" in args:
        return build_app(load_config(args["config"], overrides))
    return build_app(parse_config(args.get("cluster", {}), overrides))
