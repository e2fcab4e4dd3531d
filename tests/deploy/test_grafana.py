"""deploy/grafana/spec-cluster.json: valid dashboard JSON whose every query reads a metric the
code defines (under Ray's Prometheus names), and that shows every metric the code defines."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana" / "spec-cluster.json"
# How Ray (2.60, OpenTelemetry export) names a metric in Prometheus: "ray_" + name, counters
# with "_total", histograms as _bucket/_sum/_count series.
SUFFIXES = {"Counter": ("_total",), "Gauge": ("",), "Histogram": ("_bucket", "_sum", "_count")}
DEFINED = re.compile(r"\b(Counter|Gauge|Histogram)\(\s*\"([a-zA-Z_:][a-zA-Z0-9_:]*)\"")
QUERIED = re.compile(r"\bray_[a-zA-Z0-9_:]+")


def code_metrics() -> dict[str, str]:
    """name -> kind for every ray.util.metrics Counter/Gauge/Histogram in the package."""
    out = {}
    for path in (REPO / "cluster").rglob("*.py"):
        for kind, name in DEFINED.findall(path.read_text()):
            out[name] = kind
    return out


def prometheus_names(metrics: dict[str, str]) -> dict[str, str]:
    return {f"ray_{name}{suffix}": name for name, kind in metrics.items() for suffix in SUFFIXES[kind]}


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def _exprs(dashboard) -> list[str]:
    return [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]


def test_code_defines_the_issue_metrics():
    names = code_metrics()
    for m in ("spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
              "spec_decode_num_draft_tokens_per_pos", "spec_decode_num_accepted_tokens_per_pos",
              "spec_gamma", "spec_speculation_on", "spec_verify_batch_tokens", "spec_ttft_ms", "spec_itl_ms",
              "spec_prefix_hit_ratio", "spec_running_sequences", "kvdir_available",
              "spec_kv_blocks_total", "spec_kv_blocks_used", "spec_kv_blocks_cached", "spec_preemptions",
              "spec_draft_ahead_hits", "spec_draft_ahead_misses", "spec_draft_failures"):
        assert m in names, m


def test_speculation_counters_carry_vllms_names():
    """vLLM v1's spec_decode counters (vllm/v1/spec_decode/metrics.py) under Ray's prefix:
    a vLLM query works here with `vllm:` replaced by `ray_`."""
    vllm = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
            "vllm:spec_decode_num_accepted_tokens", "vllm:spec_decode_num_accepted_tokens_per_pos")
    names = code_metrics()
    for name in vllm:
        assert names.get(name.replace("vllm:", "")) == "Counter", name
    source = (REPO / "cluster" / "serve" / "metrics.py").read_text()
    assert '"model_name"' in source and '("position",)' in source  # vLLM's labels


def test_kv_pool_panel(dashboard):
    """The paged KV pool's blocks (total, used, cached) share one panel; preemptions show as a rate."""
    panels = {p["title"]: p for p in dashboard["panels"] if p["type"] != "row"}
    by_metric = {n: t for t, p in panels.items() for e in (x["expr"] for x in p["targets"]) for n in QUERIED.findall(e)}
    kv = {by_metric[f"ray_spec_kv_blocks_{k}"] for k in ("total", "used", "cached")}
    assert len(kv) == 1, kv
    preemptions = panels[by_metric["ray_spec_preemptions_total"]]
    assert any("rate(ray_spec_preemptions_total[" in t["expr"] for t in preemptions["targets"])


def test_every_query_reads_a_defined_metric(dashboard):
    known = prometheus_names(code_metrics())
    for expr in _exprs(dashboard):
        used = QUERIED.findall(expr)
        assert used, expr
        for name in used:
            assert name in known, f"{name} in {expr!r} is not a metric the code defines (as Prometheus names it)"


def test_every_defined_metric_is_shown(dashboard):
    shown = {prometheus_names(code_metrics())[n] for e in _exprs(dashboard) for n in QUERIED.findall(e)}
    assert shown == set(code_metrics()), set(code_metrics()) - shown


def test_dashboard_structure(dashboard):
    assert dashboard["title"] and dashboard["uid"] and dashboard["schemaVersion"] >= 30
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    assert {v["name"] for v in dashboard["templating"]["list"]} == {"datasource"}
    for p in dashboard["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(refs) == len(set(refs)), p["title"]
        for e in (t["expr"] for t in p["targets"]):
            assert e.count("(") == e.count(")"), e
