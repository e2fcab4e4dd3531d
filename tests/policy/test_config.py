from pathlib import Path

import pytest

from cluster.policy import (
    PolicyConfigError,
    SpeculationPolicyConfig,
    load_autoscaling,
    load_policy,
)

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


@pytest.mark.parametrize("name", ["goodput", "table", "fixed4", "off"])
def test_shipped_policies_load(name):
    cfg = load_policy(CONFIGS / "policy" / f"{name}.yaml")
    assert cfg.mode == {"fixed4": "fixed"}.get(name, name)


def test_shipped_autoscaling_loads_into_serve():
    from ray.serve.config import AutoscalingConfig

    cfg = load_autoscaling(CONFIGS / "autoscaling.yaml")
    for pool in (cfg.verifier, cfg.drafter):
        serve_cfg = AutoscalingConfig(**pool.serve_autoscaling_config())
        assert serve_cfg.min_replicas == pool.min_replicas
        assert not serve_cfg.policy.is_default_policy_function()


def _write(tmp_path, text):
    p = tmp_path / "policy.yaml"
    p.write_text(text)
    return p


@pytest.mark.parametrize(
    "text, field",
    [
        ("mode: turbo\n", "mode"),
        ("mode: fixed\ngamma: -1\n", "gamma"),
        ("mode: fixed\ngamma: 9\ngamma_max: 8\n", "gamma"),
        ("mode: goodput\nalpah: 0.1\n", "alpah"),
        ("mode: table\ntable:\n"
         "  - {min_concurrency: 0, max_concurrency: 8, gamma: 4}\n"
         "  - {min_concurrency: 8, max_concurrency: 16, gamma: 2}\n", "table[1].min_concurrency"),
        ("mode: table\ntable:\n"
         "  - {min_concurrency: 0, max_concurrency: 8, gamma: 4}\n"
         "  - {min_concurrency: 10, max_concurrency: 16, gamma: 2}\n", "table[1].min_concurrency"),
        ("mode: table\ntable:\n"
         "  - {min_concurrency: 0, max_concurrency: 8, gamma: -2}\n", "table[0].gamma"),
        ("mode: table\ntable:\n"
         "  - {min_concurrency: 9, max_concurrency: 8, gamma: 2}\n", "table[0]"),
        ("mode: table\n", "table"),
        ("mode: goodput\ncost_clip: 0.5\n", "cost_clip"),
    ],
    ids=["unknown-mode", "negative-gamma", "gamma-over-max", "unknown-key", "overlap", "gap",
         "negative-row-gamma", "reversed-range", "empty-table", "clip-below-one"],
)
def test_bad_policy_names_file_and_field(tmp_path, text, field):
    path = _write(tmp_path, text)
    with pytest.raises(PolicyConfigError) as e:
        load_policy(path)
    msg = str(e.value)
    assert str(path) in msg
    assert field in msg


def test_overlap_message_says_overlap(tmp_path):
    path = _write(tmp_path, "mode: table\ntable:\n"
                  "  - {min_concurrency: 5, max_concurrency: 9, gamma: 2}\n"
                  "  - {min_concurrency: 0, max_concurrency: 5, gamma: 4}\n")
    with pytest.raises(PolicyConfigError, match="overlaps"):
        load_policy(path)


def test_missing_file_and_bad_yaml_name_the_file(tmp_path):
    with pytest.raises(PolicyConfigError, match="nope.yaml"):
        load_policy(tmp_path / "nope.yaml")
    path = _write(tmp_path, "mode: [unclosed\n")
    with pytest.raises(PolicyConfigError, match="policy.yaml"):
        load_policy(path)


def test_bare_yaml_off_means_off(tmp_path):
    assert load_policy(_write(tmp_path, "mode: off\n")).mode == "off"


def test_table_rows_may_be_unordered():
    cfg = SpeculationPolicyConfig(mode="table", table=[
        {"min_concurrency": 5, "max_concurrency": 9, "gamma": 2},
        {"min_concurrency": 0, "max_concurrency": 4, "gamma": 4},
    ])
    assert len(cfg.table) == 2


def test_bad_autoscaling_names_field(tmp_path):
    p = tmp_path / "autoscaling.yaml"
    p.write_text("verifier:\n  min_replicas: 5\n  max_replicas: 2\n")
    with pytest.raises(PolicyConfigError, match=r"autoscaling.yaml.*max_replicas"):
        load_autoscaling(p)
    p.write_text("drafter:\n  target_draft_tokens: 0\n")
    with pytest.raises(PolicyConfigError, match="drafter.target_draft_tokens"):
        load_autoscaling(p)


def test_look_back_must_exceed_metrics_interval(tmp_path):
    # Serve 2.60 only warns; replicas report once per metrics_interval_s, so a shorter
    # window holds no fresh report. The bound is relative, not Serve's default 10 s.
    p = tmp_path / "autoscaling.yaml"
    p.write_text("drafter:\n  look_back_period_s: 5\n")
    with pytest.raises(PolicyConfigError, match=r"look_back_period_s \(5.0\) must be greater than metrics_interval_s"):
        load_autoscaling(p)
    p.write_text("drafter:\n  look_back_period_s: 3\n  metrics_interval_s: 1\n  min_replicas: 1\n"
                 "  max_replicas: 2\n  initial_replicas: 2\n")
    d = load_autoscaling(p).drafter.serve_autoscaling_config()
    assert (d["look_back_period_s"], d["metrics_interval_s"], d["initial_replicas"]) == (3, 1, 2)
    p.write_text("drafter:\n  min_replicas: 1\n  max_replicas: 2\n  initial_replicas: 3\n")
    with pytest.raises(PolicyConfigError, match="initial_replicas"):
        load_autoscaling(p)
