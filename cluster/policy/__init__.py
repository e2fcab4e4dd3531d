"""Speculation controller (gamma per step) and autoscaling policies for the two pools."""

from cluster.policy.autoscaling import (
    DRAFT_TOKENS_METRIC,
    VERIFY_TOKENS_METRIC,
    DraftDemandMeter,
    DrafterPolicy,
    VerifierPolicy,
    VerifyLoadMeter,
    desired_replicas,
    drafter_policy,
    total_load,
    verifier_policy,
)
from cluster.policy.config import (
    AutoscalingPolicyConfig,
    DrafterScaling,
    PolicyConfigError,
    SpeculationPolicyConfig,
    TableRow,
    VerifierScaling,
    load_autoscaling,
    load_policy,
)
from cluster.policy.controller import GoodputController, StepObservation, make_controller
from cluster.policy.static import Controller, StaticController, TableController

__all__ = [
    "AutoscalingPolicyConfig", "Controller", "DRAFT_TOKENS_METRIC", "DraftDemandMeter",
    "DrafterPolicy", "DrafterScaling", "GoodputController", "PolicyConfigError",
    "SpeculationPolicyConfig", "StaticController", "StepObservation", "TableController",
    "TableRow", "VERIFY_TOKENS_METRIC", "VerifierPolicy", "VerifierScaling",
    "VerifyLoadMeter", "desired_replicas", "drafter_policy", "load_autoscaling",
    "load_policy", "make_controller", "total_load", "verifier_policy",
]
