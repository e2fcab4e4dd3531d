"""Controllers that do not learn: off and fixed (StaticController), and a gamma looked up by
concurrency (TableController); the protocol every controller keeps, and the concurrency
signal they share (see cluster.policy.controller for the goodput controller)."""

from __future__ import annotations

import math
from typing import Protocol

from cluster.engine.observation import StepObservation
from cluster.policy.config import SpeculationPolicyConfig


class Controller(Protocol):
    def gamma(self, batch_size: int, cluster_inflight: int = 0) -> int: ...
    def observe(self, obs: StepObservation) -> None: ...
    def snapshot(self) -> dict: ...
    def set_num_verifier_replicas(self, n: int) -> None: ...


class BaseController:
    """Shared concurrency signal; observe is a no-op for modes that do not learn."""

    # True after a gamma() whose step is the last speculative one before plain decoding (a
    # probe's): an engine that launches a speculative step ahead need not launch one after it
    ends_speculation = False

    def __init__(self, cfg: SpeculationPolicyConfig):
        self.cfg = cfg
        self.num_verifier_replicas = 1
        self._last = 0

    def set_num_verifier_replicas(self, n: int) -> None:
        """Called by the verifier when it learns the pool size (e.g. from routing stats)."""
        self.num_verifier_replicas = max(1, int(n))

    def concurrency(self, batch_size: int, cluster_inflight: int) -> float:
        return max(float(batch_size), cluster_inflight / self.num_verifier_replicas)

    def observe(self, obs: StepObservation) -> None:
        pass

    def snapshot(self) -> dict:
        return {"mode": self.cfg.mode, "gamma": self._last}


class StaticController(BaseController):
    """off -> 0, fixed -> cfg.gamma."""

    def gamma(self, batch_size: int, cluster_inflight: int = 0) -> int:
        self._last = self.cfg.gamma if self.cfg.mode == "fixed" else 0
        return self._last


class TableController(BaseController):
    """Looks gamma up by concurrency; below the first row or above the last, the nearest row."""

    def __init__(self, cfg: SpeculationPolicyConfig):
        super().__init__(cfg)
        self._rows = sorted((r.min_concurrency, r.max_concurrency, r.gamma) for r in cfg.table)

    def gamma(self, batch_size: int, cluster_inflight: int = 0) -> int:
        # Ceil: a fractional cluster average counts as the next whole sequence (conservative).
        c = math.ceil(self.concurrency(batch_size, cluster_inflight))
        g = self._rows[0][2] if c < self._rows[0][0] else self._rows[-1][2]
        for lo, hi, rg in self._rows:
            if lo <= c <= hi:
                g = rg
                break
        self._last = g
        return g
