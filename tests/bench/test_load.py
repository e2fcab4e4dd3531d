"""The load benchmark's workloads and bookkeeping (the numbers themselves live in benchmarks/)."""

import json

from cluster.bench.cli import main as bench_main
from cluster.bench.load import load_workload, run_engine, summarise


def test_trace_masking_keeps_shape_not_words(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(json.dumps({"prompt": p}) for p in ["secret plan\n  x = 1", "hello"]))
    plain = load_workload(f"trace:{trace}", 10, mask=False)
    masked = load_workload(f"trace:{trace}", 10, mask=True)
    assert plain == ["secret plan\n  x = 1", "hello"]
    assert [len(p) for p in masked] == [len(p) for p in plain] and masked[0] != plain[0]
    assert [i for i, c in enumerate(masked[0]) if c.isspace()] == [i for i, c in enumerate(plain[0]) if c.isspace()]


def test_run_engine_keeps_concurrency_and_summarises(demo_pair):
    from cluster.config import parse_config
    from cluster.engine.scheduling.sequence import SpecParams
    from cluster.serve.build import build_engine

    engine = build_engine(parse_config({"engine": {"max_num_seqs": 4}}))
    res, wall = run_engine(engine, load_workload("code", 3, False), 2, 12, SpecParams("fixed", 3))
    s = summarise(res, wall)
    assert s["requests"] == 3 and all(len(r["token_ids"]) == 12 for r in res)
    assert s["tokens_per_s"] > 0 and 0 <= s["acceptance_rate"] <= 1 and s["mean_accepted_len"] >= 1
    assert engine.kv.held() == (0, 0)


def test_bench_cli_lists_benchmarks_and_refuses_unknown(capsys):
    assert bench_main([]) == 0
    assert "load" in capsys.readouterr().out
    assert bench_main(["nope"]) == 2


def test_load_sweep_through_the_openai_endpoint(serve_ports, demo_pair, tmp_path):
    """`bench load --api openai` against a running cluster: every request of every level
    completes over the SSE stream, and the JSON holds the client-side timings."""
    from ray import serve

    from cluster.bench.load import main
    from cluster.config import parse_config
    from cluster.serve.launch import run_app
    from cluster.bench.chaos import wait_idle

    app = "bench-oai"
    run_app(parse_config({
        "placement": "colocated",
        "network": {"grpc_port": serve_ports[0], "http_port": serve_ports[1], "app_name": app,
                    "route_prefix": f"/{app}"},
        "engine": {"max_num_seqs": 4, "max_model_len": 512},
        "verifier": {"ray_actor_options": {"num_cpus": 1}},
    }))
    try:
        assert main(["--api", "openai", "--base-url", f"http://127.0.0.1:{serve_ports[1]}/{app}/v1",
                     "--requests", "3", "--concurrency", "1,2", "--max-tokens", "12", "--speculation", "4",
                     "--out", str(tmp_path)]) == 0
        data = json.loads(next(tmp_path.glob("load_code*.json")).read_text())
        assert data["mode"] == "openai" and data["speculation"] == "4"
        assert [p["concurrency"] for p in data["points"]] == [1, 2]
        for p in data["points"]:
            assert p["requests"] == 3 and p["tokens_per_s"] > 0
            assert 0 < p["ttft_ms_p50"] <= p["ttft_ms_p99"] and p["itl_ms_p50"] > 0 and p["tpot_ms_p50"] > 0
            assert 0 < p["acceptance_rate"] <= 1 and p["mean_accepted_len"] > 1  # the demo pair accepts
        assert list(tmp_path.glob("load_code*.png"))
        assert wait_idle(app)["running"] == 0
    finally:
        serve.delete(app)


def test_closed_loop_roofline_counts_the_clients_part_empty_steps():
    """Two requests in flight over three: A (3 tokens) and B (2) take their first tokens from
    their prompts' passes; B ends after one decode step and C takes its place; then A and C
    decode their last tokens. Two steps, reading 4 then 5 cached tokens beside the weights
    (10 bytes), where `roofline` counts 3.5 steps of two rows."""
    from cluster.bench.harness import closed_loop_roofline, roofline

    R = {"param_count": 0, "matmul_flops": 1.0, "param_bytes": 10, "kv_bytes_per_token": 1, "copy_bandwidth": 1.0}
    rate, steps = closed_loop_roofline([1, 1, 1], [3, 2, 2], 2, R)
    assert steps == 2 and rate == 7 / ((10 + 4) + (10 + 5))
    assert rate > roofline([1, 1, 1], [3, 2, 2], 2, R)
    # equal lengths: each wave of c requests decodes its tokens after the first in lockstep
    rate, steps = closed_loop_roofline([5] * 6, [4] * 6, 3, R)
    assert steps == 2 * 3
    # a one-token request is all prefill: 2 FLOPs a parameter a prompt token
    assert closed_loop_roofline([5], [1], 1, {**R, "param_count": 1}) == (1 / 10, 0)
