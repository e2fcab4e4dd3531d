"""GetStats' cluster figures (cluster.serve.stats) from verifier snapshots: the same
quantities the Prometheus metrics and the Grafana dashboard show."""

from __future__ import annotations

import pytest

from cluster.policy.controller import StepObservation
from cluster.serve.stats import VerifierFigures, cluster_metrics


def _replica(gamma, drafted, accepted, obs, ttft, itl, **extra):
    f = VerifierFigures()
    for o in obs:
        f.step(o)
    f.finished(ttft, itl)
    return {"gamma": gamma, "drafted": drafted, "accepted": accepted, "running": 4, "waiting": 1,
            "verify_tokens": 20, "prefix_queries": 10, "prefix_hits": 5, "kv_blocks_total": 100,
            "kv_blocks_used": 30, "kv_blocks_cached": 20, "preemptions": 2, "prefix_hit_tokens": 80,
            **f.snapshot(), **extra}


def test_cluster_metrics_pool_replicas():
    a = _replica(4, 40, 30, [StepObservation(4, 2, 12, 0.01, 0.0, 8, [4, 2], [4, 4])], 10.0, [1.0, 2.0],
                 kvdir_available=1)
    b = _replica(0, 0, 0, [StepObservation(4, 0, 4, 0.01, 0.0, 0, [], [])], 30.0, [3.0], kvdir_available=0)
    m = cluster_metrics({"a": a, "b": b}, inflight=7)
    assert m["inflight"] == 7 and m["verifier_replicas"] == 2
    assert m["acceptance_rate"] == pytest.approx(0.75)
    assert m["mean_gamma"] == 2.0 and m["speculating_replicas"] == 1
    assert m["acceptance_position_0"] == 1.0 and m["acceptance_position_1"] == 0.5
    assert m["running"] == 8 and m["waiting"] == 2 and m["verify_tokens"] == 40
    assert m["prefix_hit_rate"] == 0.5
    assert m["ttft_ms_p50"] == 30.0 and m["itl_ms_p99"] == 3.0
    assert m["kvdir_available"] == 0.0  # one replica cannot reach the directory
    assert m["kv_blocks_total"] == 200 and m["kv_blocks_used"] == 60 and m["kv_blocks_cached"] == 40
    assert m["kv_blocks_used_fraction"] == pytest.approx(0.3)
    assert m["preemptions"] == 4 and m["prefix_hit_tokens"] == 160


def test_empty_cluster():
    m = cluster_metrics({}, inflight=0)
    assert m["acceptance_rate"] == 0.0 and m["mean_gamma"] == 0.0 and "kvdir_available" not in m
    assert m["kv_blocks_total"] == 0 and m["kv_blocks_used_fraction"] == 0.0
