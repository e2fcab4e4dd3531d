"""Composes the application from one ClusterConfig: Router -> Verifier -> Drafter.

`serve run cluster.serve.app:app_builder config=configs/cluster.yaml` and
`spec-cluster up` build the same graph.
"""

from __future__ import annotations

from ray.serve import Application

from cluster.config import ClusterConfig, load_config, parse_config
from cluster.serve.drafter import DrafterDeployment
from cluster.serve.router import Router
from cluster.serve.verifier import StatsBoard, Verifier

SERVICERS = ["cluster.proto.generation_pb2_grpc.add_GenerationServicer_to_server",
             "grpc_health.v1.health_pb2_grpc.add_HealthServicer_to_server"]


def _options(section, autoscaling: dict | None) -> dict:
    opts = {"ray_actor_options": section.ray_actor_options, "max_ongoing_requests": section.max_ongoing_requests}
    if section.autoscaling and autoscaling:
        opts["autoscaling_config"] = autoscaling
    else:
        opts["num_replicas"] = section.num_replicas
    return opts


def build_app(cfg: ClusterConfig) -> Application:
    scaling = {"verifier": None, "drafter": None}
    if cfg.autoscaling_file:
        from cluster.policy.config import load_autoscaling

        a = load_autoscaling(cfg.autoscaling_file)
        scaling = {"verifier": a.verifier.serve_autoscaling_config(), "drafter": a.drafter.serve_autoscaling_config()}
    data = cfg.model_dump()
    board = StatsBoard.bind()
    drafter = None
    if cfg.placement == "disaggregated" and cfg.models.draft:
        drafter = DrafterDeployment.options(**_options(cfg.drafter, scaling["drafter"])).bind(data)
    verifier = Verifier.options(**_options(cfg.verifier, scaling["verifier"])).bind(data, drafter, board)
    return Router.options(max_ongoing_requests=cfg.router.max_inflight * 2).bind(data, verifier, board)


def app_builder(args: dict) -> Application:
    """Serve's typed-args entry point: args {config: path} and/or {overrides: {...}}."""
    overrides = args.get("overrides") or {}
    if "config" in args:
        return build_app(load_config(args["config"], overrides))
    return build_app(parse_config(args.get("cluster", {}), overrides))
