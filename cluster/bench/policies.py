"""The speculation policies the load ramps compare and the requests they run (shared by the
engine-level ramp, cluster.bench.policy_bench, and its Ray version, policy_bench_ray)."""

from __future__ import annotations

import random
import re
from pathlib import Path

from cluster.bench.workloads import code_prompts
from cluster.policy.config import SpeculationPolicyConfig, load_policy

POLICY_DIR = Path(__file__).resolve().parents[2] / "configs" / "policy"
POLICIES = {"off": "off.yaml", "fixed4": "fixed4.yaml", "table": "table.yaml", "goodput": "goodput.yaml"}
BASELINES = ("off", "fixed4", "table")


def requests(n: int, min_tokens: int, max_tokens: int, seed: int = 0) -> list[tuple[str, int]]:
    """(prompt, max_tokens): lengths vary so finishes (and refills) spread over the run."""
    rng = random.Random(seed)
    return [(p, rng.randint(min_tokens, max_tokens)) for p in code_prompts(n, seed=seed)]


def policy_config(name: str) -> dict:
    """A shipped policy file, or `fixedK` (any K: an oracle sweep to compare against)."""
    if name in POLICIES:
        return load_policy(POLICY_DIR / POLICIES[name]).model_dump()
    if re.fullmatch(r"fixed\d+", name):
        return SpeculationPolicyConfig(mode="fixed", gamma=int(name[5:])).model_dump()
    raise SystemExit(f"unknown policy {name!r}: {', '.join(POLICIES)} or fixedK")
