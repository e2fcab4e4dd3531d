"""Where a multi-GPU run's replicas go, and proof that they went there.

A `Mode` is one deployment shape: how many verifier replicas, where the drafter runs (inside
each verifier process, or one Drafter replica) and how much of a GPU each replica asks Ray for.
Ray hands a whole-GPU ask a GPU id no other replica holds, and packs fractional asks onto
one GPU (best fit), so `num_gpus: 1` per replica is the whole placement story on one host.
Every replica reports the ids Ray gave it (`gpu_ids` in Verifier.stats and Drafter.info);
`check` compares them with what the mode meant, so a run never reports "the drafter on its
own GPU" for a deployment where it was not.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class Mode:
    name: str
    placement: str  # "colocated": the draft model in each verifier; "disaggregated": one Drafter replica
    verifiers: int = 1
    verifier_gpus: float = 1.0  # each verifier replica's num_gpus
    drafter_gpus: float = 0.0  # the Drafter replica's num_gpus (disaggregated only)

    @property
    def gpus(self) -> int:
        """GPUs the mode occupies (the denominator of tokens/s per GPU)."""
        return math.ceil(self.verifiers * self.verifier_gpus + self.drafter_gpus - 1e-9)

    def overrides(self) -> dict:
        """The ClusterConfig sections that place it (one logical CPU per replica)."""
        out = {"placement": self.placement,
               "verifier": {"num_replicas": self.verifiers,
                            "ray_actor_options": {"num_gpus": self.verifier_gpus, "num_cpus": 1}}}
        if self.placement == "disaggregated":
            out["drafter"] = {"num_replicas": 1, "ray_actor_options": {"num_gpus": self.drafter_gpus, "num_cpus": 1}}
        return out


def colocated(k: int = 1) -> Mode:
    """k verifier replicas on a GPU each, each drafting in its own process."""
    return Mode("colocated" if k == 1 else f"colocated_x{k}", "colocated", k)


def own_drafter(k: int = 1) -> Mode:
    """k verifier replicas on a GPU each and one Drafter replica on a GPU of its own."""
    return Mode("own" if k == 1 else f"own_x{k}", "disaggregated", k, 1.0, 1.0)


# one verifier and its Drafter replica on one GPU, as every disaggregated figure before issue 28
SHARED = Mode("shared", "disaggregated", 1, 0.5, 0.5)


def gpu_map(app: str, mode: Mode, timeout_s: float = 30.0) -> dict:
    """{"verifiers": {replica: [gpu ids]}, "drafter": [gpu ids] | None}, once every verifier
    replica has reported to the StatsBoard (twice a second)."""
    from ray import serve

    board = serve.get_deployment_handle("StatsBoard", app)
    deadline = time.monotonic() + timeout_s
    while True:
        reps = board.snapshot.remote().result()["replicas"]
        if len(reps) >= mode.verifiers or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    drafter = None
    if mode.placement == "disaggregated":
        drafter = serve.get_deployment_handle("Drafter", app).info.remote().result(timeout_s=timeout_s)["gpu_ids"]
    return {"verifiers": {r: s.get("gpu_ids", []) for r, s in reps.items()}, "drafter": drafter}


def check(mode: Mode, gmap: dict) -> list[str]:
    """What differs between the mode's meaning and where Ray put the replicas (empty: none)."""
    problems = []
    ver = gmap["verifiers"]
    if len(ver) != mode.verifiers:
        problems.append(f"{len(ver)} verifier replicas reported, {mode.verifiers} deployed")
    for r, ids in ver.items():
        if len(ids) != max(1, math.floor(mode.verifier_gpus)):
            problems.append(f"verifier {r} holds GPUs {ids}, asked for {mode.verifier_gpus}")
    held = [g for ids in ver.values() for g in ids]
    if mode.verifier_gpus >= 1 and len(set(held)) != len(held):
        problems.append(f"verifiers share GPUs: {ver}")
    d = gmap["drafter"]
    if mode.placement == "disaggregated":
        if not d:
            problems.append("the Drafter replica holds no GPU")
        elif mode.drafter_gpus >= 1 and set(d) & set(held):
            problems.append(f"the drafter's GPU {d} is a verifier's too: {ver}")
        elif mode.drafter_gpus < 1 and set(d) != set(held):
            problems.append(f"the drafter's GPU {d} is not the verifier's: {ver}")
    return problems
