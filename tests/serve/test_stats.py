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
                 kvdir_available=1, drafting=1)
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


def test_speculating_replicas_count_only_replicas_that_drafted_lately():
    obs = [StepObservation(4, 0, 4, 0.01, 0.0, 0, [], [])]
    # both run with gamma 4; b's drafter is down, so it decodes plainly
    a = _replica(4, 40, 30, obs, 10.0, [1.0], drafting=1)
    b = _replica(4, 40, 30, obs, 10.0, [1.0], drafting=0)
    assert cluster_metrics({"a": a, "b": b}, inflight=0)["speculating_replicas"] == 1


def test_stats_board_drops_a_silent_replica_from_get_stats_within_fresh_s(monkeypatch):
    import time

    from cluster.serve.stats import FRESH_S, KEEP_S
    from cluster.serve.verifier import StatsBoard

    now = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    board = StatsBoard.func_or_class()
    board.report("a", {"running": 1})
    board.report("b", {"running": 2})
    now[0] += FRESH_S - 0.5
    board.report("b", {"running": 3})  # b still reports; a died
    now[0] += 0.6
    assert board.snapshot()["replicas"] == {"b": {"running": 3}}
    # readiness and the replica count keep a for KEEP_S (a loaded host may delay a report)
    assert set(board.snapshot(KEEP_S)["replicas"]) == {"a", "b"}
    now[0] += KEEP_S
    assert board.snapshot(KEEP_S)["replicas"] == {} and board.report("b", {}) == (0, 1)


def test_board_exchange_takes_a_routers_count_and_gives_ages(monkeypatch):
    import time

    from cluster.serve.verifier import StatsBoard

    now = [50.0]
    monkeypatch.setattr(time, "monotonic", lambda: now[0])
    board = StatsBoard.func_or_class()
    board.report("v1", {"running": 1})
    now[0] += 1.5
    assert board.exchange("r1", 7) == {"replicas": {"v1": (1.5, {"running": 1})}, "inflight": 7}
    assert board.exchange("r2", 3)["inflight"] == 10


def test_board_view_answers_from_its_copy_and_ages_it():
    import asyncio
    import time

    from cluster.serve.stats import FRESH_S, BoardView

    calls = []

    class Board:  # a Serve handle's shape: board.exchange.remote(...) is awaitable
        class exchange:  # noqa: N801
            @staticmethod
            async def remote(router, n):
                calls.append((router, n))
                return {"replicas": {"fresh": (0.5, {"running": 1}), "stale": (FRESH_S + 1, {"running": 2})},
                        "inflight": 12}

    async def run():
        view = BoardView(Board, "r1", lambda: 4)
        snap = await view.snapshot()
        assert snap == {"replicas": {"fresh": {"running": 1}}, "inflight": 12}
        assert set((await view.snapshot(FRESH_S + 5))["replicas"]) == {"fresh", "stale"}
        n = len(calls)
        t0 = time.monotonic()
        for _ in range(100):  # reads never call the board
            await view.snapshot()
        assert len(calls) == n and time.monotonic() - t0 < 0.5
        view.task.cancel()

    asyncio.run(run())
    assert calls[0] == ("r1", 4)
