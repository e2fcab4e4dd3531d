"""VerifierMetrics counts what vLLM's spec_decode counters count, from the engine's step
observations (the metric objects are recorded, not exported: Ray's export is Ray's)."""

from __future__ import annotations

from collections import Counter as Tally

import pytest

from cluster.engine.observation import observation
from cluster.serve import metrics as metrics_module


class _Metric:
    def __init__(self, name, description="", boundaries=None, tag_keys=()):
        self.name, self.tag_keys, self.defaults, self.values = name, tag_keys, {}, Tally()

    def set_default_tags(self, tags):
        self.defaults = tags

    def _key(self, tags):
        tags = {**self.defaults, **(tags or {})}
        assert set(tags) == set(self.tag_keys), (self.name, tags)
        return tuple(sorted(tags.items()))

    def inc(self, value=1.0, tags=None):
        self.values[self._key(tags)] += value

    set = observe = inc


@pytest.fixture
def recorded(monkeypatch):
    class Fake:
        Counter = Gauge = Histogram = _Metric

    monkeypatch.setattr(metrics_module, "metrics", Fake)
    m = metrics_module.VerifierMetrics("r1", "demo-target")
    return m, {x.name: x for x in vars(m).values() if isinstance(x, _Metric)}


def _total(metric, **tags) -> float:
    return sum(v for k, v in metric.values.items() if all((t, tags[t]) in k for t in tags))


def test_counts_follow_vllms_spec_decode_counters(recorded):
    m, recorded = recorded
    # rows drafting 4, 2 and 0 tokens, accepting 3, 2 and 0; then a plain step
    m.step(observation(3, 9, 0.01, 0.0, [4, 2, 0], [3, 2, 0]))
    m.step(observation(2, 2, 0.01, 0.0, [0, 0], [0, 0]))
    assert _total(recorded["spec_decode_num_drafts"]) == 2  # a sequence drafting in a step
    assert _total(recorded["spec_decode_num_draft_tokens"]) == 6
    assert _total(recorded["spec_decode_num_accepted_tokens"]) == 5
    per_pos = recorded["spec_decode_num_accepted_tokens_per_pos"]
    assert [_total(per_pos, position=str(j)) for j in range(4)] == [2, 2, 1, 0]
    drafted = recorded["spec_decode_num_draft_tokens_per_pos"]
    assert [_total(drafted, position=str(j)) for j in range(4)] == [2, 2, 1, 1]
    assert _total(per_pos, model_name="demo-target", replica="r1") == 5  # vLLM's model_name label


def test_names_and_labels(recorded):
    _, recorded = recorded
    for name in ("spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens"):
        assert set(recorded[name].tag_keys) == {"model_name", "replica"}
    assert set(recorded["spec_decode_num_accepted_tokens_per_pos"].tag_keys) == {"model_name", "replica", "position"}
    assert not any(":" in n for n in recorded)  # Ray refuses ':' in metric names


def test_engine_counts_grow_their_counters_by_what_each_report_adds(recorded):
    """Preemptions, look-ahead drafts used and dropped, and failed draft calls reach their
    counters as the growth of the engine's own counts between stats reports, and a report that
    adds nothing (idle) adds nothing."""
    m, recorded = recorded
    pool = {"kv_blocks_total": 100, "kv_blocks_used": 10, "kv_blocks_cached": 5}
    counts = [{"preemptions": 0, "ahead_hits": 3, "ahead_misses": 1, "draft_failures": 0},
              {"preemptions": 2, "ahead_hits": 10, "ahead_misses": 4, "draft_failures": 1},
              {"preemptions": 2, "ahead_hits": 10, "ahead_misses": 4, "draft_failures": 1}]
    for c in counts:
        m.report({**pool, **c})
    assert _total(recorded["spec_preemptions"]) == 2
    assert _total(recorded["spec_draft_ahead_hits"]) == 10
    assert _total(recorded["spec_draft_ahead_misses"]) == 4
    assert _total(recorded["spec_draft_failures"], replica="r1", model_name="demo-target") == 1
