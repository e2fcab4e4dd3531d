"""A tensor-parallel verifier replica under Serve: one placement group, follower ranks in it.

A replica of `engine.tensor_parallel_size` N declares N bundles through Serve's deployment
options (`placement_group_bundles`, STRICT_PACK: one node), so Serve reserves, places,
restarts and scales the replica's N devices as one unit. The replica actor is rank 0 and
sits in bundle 0 (Serve's rule: bundle 0 holds the replica's own resources); ranks 1..N-1
are Ray actors in bundles 1..N-1, as vLLM's Ray executor places its workers. They are
owned by the replica, so Ray ends them when the replica goes, however it goes; without
Ray (`generate --local`) cluster.engine.distributed.ranks spawns child processes instead.
"""

from __future__ import annotations

import os

import ray
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

START_TIMEOUT_S = 300.0  # a follower's actor starting (its process, imports); loading comes after
# The ranks of a GPU replica see every GPU of the node, each driving the one Ray gave it (its
# index in DEVICE_ENV), as vLLM's Ray executor does: NVLink peer access, which NCCL's P2P
# transport and the one-shot all-reduce's symmetric memory need, works only between devices
# a process sees, and Ray's per-actor CUDA_VISIBLE_DEVICES shows each rank its own GPU alone.
NOSET = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"
SHARED_GPUS = {NOSET: "1"}


def device_index(assigned: str, visible: str | None) -> str:
    """Ray's GPU id as an index among the devices this process sees: its place in
    CUDA_VISIBLE_DEVICES where the node sets that (ids or UUIDs), else the id itself."""
    if not visible:
        return str(int(assigned))
    ids = [x.strip() for x in visible.split(",")]
    if str(assigned) not in ids:
        raise RuntimeError(f"Ray's GPU {assigned} is not among CUDA_VISIBLE_DEVICES {visible}")
    return str(ids.index(str(assigned)))


def shares_gpus(cfg) -> bool:
    return cfg.engine.tensor_parallel_size > 1 and bool(cfg.verifier.ray_actor_options.get("num_gpus"))


def verifier_actor_options(cfg) -> dict:
    """The Verifier's ray_actor_options; a tensor-parallel GPU replica's (rank 0's) see every GPU."""
    opts = dict(cfg.verifier.ray_actor_options)
    if shares_gpus(cfg):
        env = dict(opts.get("runtime_env") or {})
        env["env_vars"] = {**env.get("env_vars", {}), **SHARED_GPUS}
        opts["runtime_env"] = env
    return opts


def own_device_env() -> dict:
    """{DEVICE_ENV: index} for a process of a tensor-parallel GPU replica that sees every GPU
    (SHARED_GPUS): the GPU Ray gave it; {} elsewhere."""
    from cluster.engine.distributed.parallel import DEVICE_ENV

    if os.environ.get(NOSET) != "1" or not ray.get_gpu_ids():
        return {}
    return {DEVICE_ENV: device_index(str(ray.get_gpu_ids()[0]), os.environ.get("CUDA_VISIBLE_DEVICES"))}


def placement_options(cfg) -> dict:
    """Serve deployment options that reserve a tensor-parallel verifier's devices: bundle 0
    is the replica's own ray_actor_options (rank 0); each follower bundle is one GPU (with
    the replica's accelerator type) on a GPU config, one CPU otherwise. Empty for N = 1."""
    n = cfg.engine.tensor_parallel_size
    if n == 1:
        return {}
    opts = cfg.verifier.ray_actor_options
    gpus = opts.get("num_gpus", 0)
    first = {"CPU": opts.get("num_cpus", 1), **({"GPU": gpus} if gpus else {}), **opts.get("resources", {})}
    # a follower drives its GPU from one CPU of its own; on a CPU config that CPU is its device
    follower = {"CPU": 1, "GPU": 1} if gpus else {"CPU": 1}
    if opts.get("accelerator_type"):  # Ray's resource for it, as Serve LLM puts it in every bundle
        key = f"accelerator_type:{opts['accelerator_type']}"
        first[key] = follower[key] = 0.001
    if "memory" in opts:
        first["memory"] = opts["memory"]
    return {"placement_group_bundles": [first] + [dict(follower) for _ in range(n - 1)],
            "placement_group_strategy": "STRICT_PACK"}


@ray.remote(max_concurrency=2)  # where() answers while follow() runs
class Follower:
    """One follower rank's process: cluster.engine.distributed.ranks.follow for its whole life."""

    def where(self) -> dict:
        """Its process, node and placement group (for operators and tests)."""
        pg = get_current_placement_group()
        return {"pid": os.getpid(), "node_id": ray.get_runtime_context().get_node_id(),
                "placement_group_id": pg.id.hex() if pg else None}

    def follow(self, rank: int, size: int, addr: str, port: int, target: str, cfg, step_timeout_s: float) -> None:
        from cluster.engine.distributed.ranks import follow

        os.environ.update(own_device_env())  # before CUDA starts in this process
        follow(rank, size, port, target, cfg, step_timeout_s, addr)


class FollowerHandle:
    """A follower actor seen as cluster.engine.distributed.ranks expects a rank's process."""

    def __init__(self, actor, rank: int):
        self.actor, self.rank = actor, rank
        self.pid = ray.get(actor.where.remote(), timeout=START_TIMEOUT_S)["pid"]  # placed and started
        self.done = None

    def start(self, *args) -> None:
        self.done = self.actor.follow.remote(*args)

    def is_alive(self) -> bool:
        return not ray.wait([self.done], timeout=0)[0]

    @property
    def exitcode(self) -> int | None:
        """None while it runs; 0 after STOP; 1 after an error or the actor's death."""
        if self.is_alive():
            return None
        try:
            ray.get(self.done, timeout=0)
            return 0
        except Exception:  # noqa: BLE001 - the rank's error or death, told apart in the log only
            return 1

    def join(self, timeout: float | None = None) -> None:
        ray.wait([self.done], timeout=timeout)

    def terminate(self) -> None:
        ray.kill(self.actor, no_restart=True)


def launch(rank: int, size: int, addr: str, port: int, target: str, cfg, step_timeout_s: float) -> FollowerHandle:
    """cluster.engine.distributed.ranks launcher: rank `rank` as a Follower actor in bundle `rank` of this
    replica's placement group (or, outside one, wherever Ray places one device's worth)."""
    pg = get_current_placement_group()
    opts = {"num_gpus": 1, "num_cpus": 1, "runtime_env": {"env_vars": SHARED_GPUS}} if cfg.device == "cuda" \
        else {"num_cpus": 1}
    if pg is not None:
        opts["scheduling_strategy"] = PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=rank)
        name = ray.util.placement_group_table(pg)["name"]  # Serve names it after the replica actor
        if name:
            opts["name"] = f"{name}::rank-{rank}"
    h = FollowerHandle(Follower.options(**opts).remote(), rank)
    h.start(rank, size, addr, port, target, cfg, step_timeout_s)
    return h


def start_followers(target: str, cfg):
    """Rank 0's group for this replica: the followers in its placement group, the rendezvous
    on the node's IP as Ray reports it (STRICT_PACK keeps every rank on this node)."""
    from cluster.engine.distributed.ranks import start_ranks

    return start_ranks(target, cfg, launch=launch, addr=ray.util.get_node_ip_address())
