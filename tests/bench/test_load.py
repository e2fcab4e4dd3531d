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
    from cluster.engine.sequence import SpecParams
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
