"""The engine core as a Ray actor beside its verifier replica (cluster.serve.core).

The replica starts it with `start_core`: on the replica's node (in the replica's placement
group when it has one, so tensor-parallel followers still land in their bundles), with no
resources of its own and the replica's GPUs visible: the replica holds the devices in Ray's
books, the core drives them. The replica owns the actor, so Ray ends it with the replica.
"""

from __future__ import annotations

import os
import uuid

import ray
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy, PlacementGroupSchedulingStrategy

from cluster.serve.followers import own_device_env

CORE_PREFIX = "spec-cluster-core::"  # + the replica's id: the core actor's name ...
CORE_NAMESPACE = "serve"  # ... in Serve's namespace, beside its replica (a child would take the job's)
START_TIMEOUT_S = 1800.0  # a cold GPU start compiles and captures for minutes


@ray.remote(num_cpus=0, max_concurrency=1)
class EngineCore:
    def __init__(self, config: dict, drafter, replica_id: str, inbox_addr: str, outbox_addr: str):
        import zmq

        from cluster.config import ClusterConfig
        from cluster.serve.build import build_engine, remote_drafters
        from cluster.serve.core import CoreLoop, bind_pair, engine_info
        from cluster.serve.drafter import RemoteDrafter

        cfg = ClusterConfig.model_validate(config)
        # one client per drafter the Drafter replicas host, each call naming its drafter
        self.remotes = {name: RemoteDrafter(drafter, cfg.router.drafter_timeout_s, replica_id,
                                            cfg.router.drafter_transport, name)
                        for name in (remote_drafters(cfg) if drafter else [])}
        for r in self.remotes.values():
            if not cfg.engine.draft_look_ahead:
                r.look_ahead = None
        if cfg.engine.tensor_parallel_size > 1:  # ranks 1..N-1 in the replica's placement group
            from cluster.serve.followers import start_followers

            self.engine = build_engine(cfg, self.remotes, start=start_followers)
        else:
            self.engine = build_engine(cfg, self.remotes)
        self.ctx = zmq.Context()
        inbox, outbox = bind_pair(self.ctx, inbox_addr, outbox_addr)
        self.loop = CoreLoop(self.engine, inbox, outbox, on_idle=self._flush if self.remotes else None)
        self.info = {**engine_info(self.engine), "pid": os.getpid()}

    def _flush(self) -> None:
        for r in self.remotes.values():
            r.flush()

    def ready(self) -> dict:
        return self.info

    def run(self) -> None:
        try:
            self.loop.run()
        finally:
            self.engine.close()  # tensor-parallel followers: STOP
            self.ctx.destroy(linger=0)


def socket_pair() -> tuple[str, str]:
    """Two fresh Unix-socket addresses on this node (the core is pinned to it)."""
    base = f"ipc:///tmp/spec-cluster-core-{uuid.uuid4().hex[:12]}"
    return f"{base}-in", f"{base}-out"


def start_core(config: dict, drafter, replica_id: str, inbox_addr: str, outbox_addr: str):
    """The core actor for this replica, started (its engine built; blocks until then)."""
    opts: dict = {"num_cpus": 0, "num_gpus": 0}
    pg = get_current_placement_group()
    if pg is not None:  # bundle 0 is the replica's: the core adds nothing to it
        opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=0)
    else:
        opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)
    # the replica's devices (Ray leaves an actor of no GPUs as it is given) and its CPU threads
    # (Ray sets them from the replica's num_cpus; an actor of no CPUs would get one)
    env = {k: os.environ[k] for k in ("CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS") if k in os.environ}
    env.update(own_device_env())  # a tensor-parallel replica's rank 0 drives the replica's GPU
    if env:
        opts["runtime_env"] = {"env_vars": env}
    # named for operators and fault tests (the dashboard lists it beside its replica)
    core = EngineCore.options(name=f"{CORE_PREFIX}{replica_id}", namespace=CORE_NAMESPACE, **opts).remote(
        config, drafter, replica_id, inbox_addr, outbox_addr)
    info = ray.get(core.ready.remote(), timeout=START_TIMEOUT_S)
    return core, info
