"""Typed configs for the speculation controller and the autoscaling policies.

Both are checked once, when loaded; every error names the file and the field so a bad
YAML file fails at startup with a message that says what to fix.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Optional, Type, TypeVar

import yaml
from pydantic import (BaseModel, ConfigDict, Field, ValidationError, field_validator,
                      model_validator)


class PolicyConfigError(ValueError):
    """A policy file that cannot be used; the message names the file and the field."""


class TableRow(BaseModel):
    """One row of the concurrency -> gamma table."""

    model_config = ConfigDict(extra="forbid")

    min_concurrency: int = Field(ge=0)
    """Lowest concurrency (sequences per verifier replica) this row covers, inclusive."""
    max_concurrency: int = Field(ge=0)
    """Highest concurrency this row covers, inclusive."""
    gamma: int = Field(ge=0)
    """Draft tokens per sequence for this range; 0 means plain decoding."""

    @model_validator(mode="after")
    def _range_ordered(self) -> "TableRow":
        if self.max_concurrency < self.min_concurrency:
            raise ValueError(
                f"max_concurrency ({self.max_concurrency}) must be >= "
                f"min_concurrency ({self.min_concurrency})"
            )
        return self


class SpeculationPolicyConfig(BaseModel):
    """How the speculation controller picks gamma for requests that ask for "auto"."""

    model_config = ConfigDict(extra="forbid")

    mode: Literal["off", "fixed", "table", "goodput"] = "goodput"
    """off: always 0; fixed: always `gamma`; table: look up by concurrency;
    goodput: maximise measured tokens per second."""
    gamma: int = Field(default=4, ge=0)
    """The fixed mode's gamma; goodput mode starts here before it has measurements, and its
    probes up from plain decoding draft at most this many."""
    gamma_max: int = Field(default=8, ge=0)
    """Largest gamma any mode may choose (bounds the drafter's per-call work)."""
    table: list[TableRow] = Field(default_factory=list)
    """Table mode's rows: contiguous, non-overlapping concurrency ranges."""
    alpha: float = Field(default=0.05, gt=0.0, le=1.0)
    """EWMA weight of one step in the per-position acceptance estimate."""
    cost_alpha: float = Field(default=0.02, gt=0.0, le=1.0)
    """Forgetting weight of one step in the online step-cost fits."""
    cost_clip: float = Field(default=3.0, ge=0.0)
    """A step time more than this factor off the fit's prediction is clipped to it
    (a stall from elsewhere on the machine); 0 disables clipping."""
    cost_ridge: float = Field(default=1e-3, ge=0.0)
    """Ridge weight, relative to each cost term's own data, that reads a term the steps
    cannot resolve yet as free (cluster.policy.fit)."""
    hysteresis: float = Field(default=0.05, ge=0.0)
    """Switch gamma only if the new one's expected goodput is this fraction better."""
    min_observations: int = Field(default=8, ge=1)
    """Steps needed before a fitted cost model replaces the prior."""
    prior_acceptance: float = Field(default=0.6, ge=0.0, le=1.0)
    """Per-position acceptance assumed before measurements (pseudo-counts, fades out)."""
    prior_weight: float = Field(default=16.0, gt=0.0)
    """How many proposed tokens the prior acceptance is worth."""
    prior_draft_cost_ratio: float = Field(default=0.05, ge=0.0)
    """Before the draft cost is measured: one draft token of one sequence costs this
    fraction of a target pass over the batch."""
    explore_every: int = Field(default=64, ge=0)
    """If every step so far had the same verify size (slope unknowable), probe another
    gamma once per this many steps; 0 disables probing."""
    explore_budget: float = Field(default=0.02, ge=0.0, le=1.0)
    """Probes may cost at most this fraction of the time run: what probe steps (and the
    steps they slow down after them) took beyond steps at the chosen gamma. Where a probe is
    dear (speculating at 256 rows costs several plain steps) probes come that much rarer."""

    @field_validator("mode", mode="before")
    @classmethod
    def _yaml_off(cls, v):
        # YAML 1.1 reads a bare `mode: off` as False; that can only have meant "off".
        return "off" if v is False else v

    @model_validator(mode="after")
    def _consistent(self) -> "SpeculationPolicyConfig":
        if self.gamma > self.gamma_max:
            raise ValueError(f"gamma ({self.gamma}) must be <= gamma_max ({self.gamma_max})")
        if 0.0 < self.cost_clip <= 1.0:
            raise ValueError(f"cost_clip ({self.cost_clip}) must be 0 (off) or greater than 1")
        if self.mode == "table" and not self.table:
            raise ValueError("table must have at least one row when mode is 'table'")
        rows = sorted(enumerate(self.table), key=lambda r: r[1].min_concurrency)
        for i, row in rows:
            if row.gamma > self.gamma_max:
                raise ValueError(
                    f"table[{i}].gamma ({row.gamma}) must be <= gamma_max ({self.gamma_max})"
                )
        for (i, prev), (j, row) in zip(rows, rows[1:]):
            if row.min_concurrency <= prev.max_concurrency:
                raise ValueError(
                    f"table[{j}].min_concurrency ({row.min_concurrency}) overlaps table[{i}] "
                    f"({prev.min_concurrency}..{prev.max_concurrency})"
                )
            if row.min_concurrency > prev.max_concurrency + 1:
                raise ValueError(
                    f"table[{j}].min_concurrency ({row.min_concurrency}) leaves a gap after "
                    f"table[{i}].max_concurrency ({prev.max_concurrency})"
                )
        return self


class DeploymentScaling(BaseModel):
    """Replica bounds and reaction delays shared by the verifier and drafter pools."""

    model_config = ConfigDict(extra="forbid")

    min_replicas: int = Field(default=1, ge=0)
    """Fewest replicas kept running."""
    max_replicas: int = Field(default=4, ge=1)
    """Most replicas ever started."""
    upscale_delay_s: float = Field(default=10.0, ge=0.0)
    """Load must stay high this long before Serve adds replicas (Serve applies it)."""
    downscale_delay_s: float = Field(default=60.0, ge=0.0)
    """Load must stay low this long before Serve removes replicas (Serve applies it)."""
    initial_replicas: Optional[int] = Field(default=None, ge=0)
    """Replicas to start with (between min and max); None starts at min_replicas."""
    look_back_period_s: float = Field(default=15.0, gt=0.0)
    """Window over which Serve averages the reported metric; must exceed
    metrics_interval_s (replicas report once per interval, so a shorter window can
    hold no fresh report; Serve 2.60 only warns, and says a future release will refuse)."""
    metrics_interval_s: float = Field(default=10.0, gt=0.0)
    """How often replicas push their metric to Serve's controller (Serve's own default,
    10 s; deprecated in Serve in favour of an environment variable it does not read yet).
    Lower it, with look_back_period_s, for faster reactions."""
    tolerance: float = Field(default=0.1, ge=0.0, lt=1.0)
    """Dead band: hold the replica count while load is within this fraction of target."""

    @model_validator(mode="after")
    def _bounds(self):
        if self.max_replicas < self.min_replicas:
            raise ValueError(
                f"max_replicas ({self.max_replicas}) must be >= min_replicas ({self.min_replicas})"
            )
        n = self.initial_replicas
        if n is not None and not self.min_replicas <= n <= self.max_replicas:
            raise ValueError(f"initial_replicas ({n}) must be between min_replicas ({self.min_replicas}) "
                             f"and max_replicas ({self.max_replicas})")
        if self.look_back_period_s <= self.metrics_interval_s:
            raise ValueError(f"look_back_period_s ({self.look_back_period_s}) must be greater than "
                             f"metrics_interval_s ({self.metrics_interval_s})")
        return self

    def _serve_dict(self, policy: str, kwargs: dict) -> dict:
        out = {
            "min_replicas": self.min_replicas,
            "max_replicas": self.max_replicas,
            "upscale_delay_s": self.upscale_delay_s,
            "downscale_delay_s": self.downscale_delay_s,
            "look_back_period_s": self.look_back_period_s,
            "policy": {
                "policy_function": f"cluster.policy.autoscaling:{policy}",
                "policy_kwargs": {"tolerance": self.tolerance, **kwargs},
            },
        }
        if self.initial_replicas is not None:
            out["initial_replicas"] = self.initial_replicas
        if self.metrics_interval_s != 10.0:  # Serve warns (deprecated) whenever it is set
            out["metrics_interval_s"] = self.metrics_interval_s
        return out


class VerifierScaling(DeploymentScaling):
    """Verifier pool: scaled on verify tokens per pass."""

    target_verify_tokens: float = Field(default=512.0, gt=0.0)
    """Verify tokens per pass one replica should carry; set near the knee where the
    target pass stops being memory-bound (the controller also turns gamma down there)."""
    target_sequences: Optional[float] = Field(default=None, gt=0.0)
    """Optional floor: also keep ongoing requests per replica under this (catches a
    batch that is capped, so its token count cannot show the queue behind it)."""

    def serve_autoscaling_config(self) -> dict:
        """The `autoscaling_config` dict for the Verifier deployment."""
        kwargs = {"target_verify_tokens": self.target_verify_tokens,
                  "target_sequences": self.target_sequences}
        return self._serve_dict("VerifierPolicy", kwargs)


class DrafterScaling(DeploymentScaling):
    """Drafter pool: scaled on draft demand (sum of gamma over active sequences)."""

    target_draft_tokens: float = Field(default=256.0, gt=0.0)
    """Draft tokens per step (summed over the sequences it serves) one replica handles."""

    def serve_autoscaling_config(self) -> dict:
        """The `autoscaling_config` dict for the Drafter deployment."""
        return self._serve_dict("DrafterPolicy", {"target_draft_tokens": self.target_draft_tokens})


class AutoscalingPolicyConfig(BaseModel):
    """Autoscaling for both pools, as loaded from configs/autoscaling.yaml."""

    model_config = ConfigDict(extra="forbid")

    verifier: VerifierScaling = Field(default_factory=VerifierScaling)
    """The verifier pool."""
    drafter: DrafterScaling = Field(default_factory=DrafterScaling)
    """The drafter pool."""


M = TypeVar("M", bound=BaseModel)


def _load(path: str | Path, model: Type[M]) -> M:
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except OSError as e:
        raise PolicyConfigError(f"{path}: cannot read: {e.strerror}") from e
    except yaml.YAMLError as e:
        raise PolicyConfigError(f"{path}: not valid YAML: {e}") from e
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise PolicyConfigError(
            f"{path}: expected a mapping at top level, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise PolicyConfigError("\n".join(describe_error(path, err) for err in e.errors())) from None


def describe_error(path: str | Path, err: dict) -> str:
    """One pydantic error as `path: field 'a.b[2].c': message (got value)`."""
    # Cross-field checks have no location; their messages start with the field's name.
    msg = err["msg"].removeprefix("Value error, ")
    if not err["loc"]:
        return f"{path}: {msg}"
    field = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in err["loc"]).lstrip(".")
    got = err.get("input")
    if not isinstance(got, (dict, list)) and err["type"] != "missing" and str(got) not in msg:
        msg += f" (got {got!r})"
    return f"{path}: field '{field}': {msg}"


def load_policy(path: str | Path) -> SpeculationPolicyConfig:
    """Read a speculation policy YAML file; raises PolicyConfigError naming file and field."""
    return _load(path, SpeculationPolicyConfig)


def load_autoscaling(path: str | Path) -> AutoscalingPolicyConfig:
    """Read configs/autoscaling.yaml; raises PolicyConfigError naming file and field."""
    return _load(path, AutoscalingPolicyConfig)
