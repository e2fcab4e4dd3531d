import time

import pytest

from cluster.policy import (
    DrafterPolicy,
    DrafterScaling,
    DraftDemandMeter,
    VerifierPolicy,
    VerifierScaling,
    VerifyLoadMeter,
    desired_replicas,
    drafter_policy,
    total_load,
    verifier_policy,
)


# --- pure helpers ---------------------------------------------------------------------
def test_zero_demand_goes_to_min_replicas():
    assert desired_replicas(0.0, 256, current=5, min_replicas=1, max_replicas=8) == 1
    assert desired_replicas(0.0, 256, current=5, min_replicas=0, max_replicas=8) == 0


def test_high_verify_load_adds_verifiers():
    # 3 replicas each carrying 2x the target -> 6.
    assert desired_replicas(3 * 1024, 512, current=3, min_replicas=1, max_replicas=8) == 6


@pytest.mark.parametrize("load, want", [(1e9, 8), (1.0, 2), (0.0, 2)])
def test_bounds_respected(load, want):
    assert desired_replicas(load, 512, current=4, min_replicas=2, max_replicas=8) == want


def test_dead_band_holds_count():
    # 4 replicas at target 100: 380..440 is within 10% of 400, so hold.
    for load in (380, 400, 440):
        assert desired_replicas(load, 100, current=4, min_replicas=1, max_replicas=8) == 4
    assert desired_replicas(441, 100, current=4, min_replicas=1, max_replicas=8) == 5
    assert desired_replicas(359, 100, current=4, min_replicas=1, max_replicas=8) == 4  # ceil(3.59)
    assert desired_replicas(299, 100, current=4, min_replicas=1, max_replicas=8) == 3


def test_total_load_extrapolates_unreported_replicas():
    assert total_load({}, 3) is None
    assert total_load({"a": 100.0, "b": 300.0}, 2) == 400.0
    assert total_load({"a": 100.0, "b": 300.0}, 4) == 800.0  # two new replicas: mean each


def test_meters():
    m = VerifyLoadMeter()
    assert m.report() == {"verify_tokens": 0.0}
    for t in (100, 200, 300):
        m.note_step(t)
    assert m.report() == {"verify_tokens": 200.0}
    assert m.report() == {"verify_tokens": 0.0}  # idle since the last report

    # Each reader has its own window: the routing stats' read does not empty autoscaling's.
    m = VerifyLoadMeter(readers=("autoscaling", "routing"))
    m.note_step(64)
    assert m.report("routing") == {"verify_tokens": 64.0}
    assert m.report("autoscaling") == {"verify_tokens": 64.0}
    assert m.report("routing") == {"verify_tokens": 0.0}

    d = DraftDemandMeter(expire_s=2.0)
    d.note_call("v1", 40, now=0.0)
    d.note_call("v1", 64, now=1.0)  # latest per caller, not a sum over calls
    d.note_call("v2", 16, now=1.5)
    assert d.report(now=2.0) == {"draft_tokens": 80.0}
    assert d.report(now=3.2) == {"draft_tokens": 16.0}  # v1 silent > 2 s: speculation off
    assert d.report(now=10.0) == {"draft_tokens": 0.0}


# --- the real Serve context and wrapper -----------------------------------------------
serve_config = pytest.importorskip("ray.serve.config")
from ray.serve._private.common import DeploymentID, ReplicaID  # noqa: E402


def make_ctx(name, metric, per_replica, target, lo=1, hi=8, total_requests=0.0,
             delays=0.0, policy=None):
    """An AutoscalingContext built the way AutoscalingState.get_autoscaling_context does."""
    dep = DeploymentID(name=name, app_name="app")
    replicas = [ReplicaID(unique_id=f"r{i}", deployment_id=dep) for i in range(len(per_replica))]
    config = serve_config.AutoscalingConfig(
        min_replicas=lo, max_replicas=hi, upscale_delay_s=delays, downscale_delay_s=delays,
        look_back_period_s=15, policy=policy or {})
    metrics = {metric: dict(zip(replicas, per_replica))} if per_replica else {}
    return serve_config.AutoscalingContext(
        deployment_id=dep, deployment_name=name, app_name="app",
        current_num_replicas=len(replicas), target_num_replicas=target,
        running_replicas=replicas, total_num_requests=lambda: total_requests,
        total_queued_requests=lambda: 0.0, aggregated_metrics=lambda: metrics,
        raw_metrics=lambda: {}, capacity_adjusted_min_replicas=lo,
        capacity_adjusted_max_replicas=hi, policy_state={}, last_scale_up_time=None,
        last_scale_down_time=None, current_time=time.time(), config=config)


def test_verifier_policy_on_real_context():
    ctx = make_ctx("Verifier", "verify_tokens", [1024.0, 1024.0], target=2)
    n, state = verifier_policy(ctx)
    assert n == 4 and state["load"] == 2048.0


def test_verifier_sequence_floor():
    ctx = make_ctx("Verifier", "verify_tokens", [100.0], target=1, total_requests=700.0)
    assert VerifierPolicy(target_verify_tokens=512, target_sequences=256)(ctx)[0] == 3


def test_drafter_policy_speculation_off_shrinks_to_min():
    ctx = make_ctx("Drafter", "draft_tokens", [0.0, 0.0, 0.0], target=3, lo=1)
    assert drafter_policy(ctx)[0] == 1


def test_no_reports_holds_current_target():
    ctx = make_ctx("Drafter", "draft_tokens", [], target=2)
    assert DrafterPolicy()(ctx)[0] == 2


def test_through_serves_own_wrapper():
    """Resolve the policy from our config dict and run it the way the Serve controller does."""
    auto_state = pytest.importorskip("ray.serve._private.autoscaling_state")
    auto_policy = pytest.importorskip("ray.serve.autoscaling_policy")
    cfg = VerifierScaling(min_replicas=1, max_replicas=6, upscale_delay_s=0.0,
                          downscale_delay_s=0.0, target_verify_tokens=512)
    serve_cfg = serve_config.AutoscalingConfig(**cfg.serve_autoscaling_config())
    policy = auto_policy._apply_autoscaling_config(
        auto_state._resolve_policy_callable(serve_cfg.policy))
    ctx = make_ctx("Verifier", "verify_tokens", [2048.0, 2048.0], target=2, hi=6,
                   policy=serve_cfg.policy)
    n, state = policy(ctx)
    assert n == 6  # 4096 / 512 = 8 wanted, capped at max_replicas
    assert state["load"] == 4096.0

    dcfg = DrafterScaling(min_replicas=1, downscale_delay_s=0.0, target_draft_tokens=256)
    dserve = serve_config.AutoscalingConfig(**dcfg.serve_autoscaling_config())
    dpolicy = auto_policy._apply_autoscaling_config(
        auto_state._resolve_policy_callable(dserve.policy))
    ctx = make_ctx("Drafter", "draft_tokens", [0.0, 0.0], target=2, policy=dserve.policy)
    assert dpolicy(ctx)[0] == 1
