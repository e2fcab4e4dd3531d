"""`spec-cluster bench NAME [args]`: one entry point for the benchmarks (each writes JSON + PNG)."""

from __future__ import annotations

import importlib
import sys

BENCHES = {
    "load": ("cluster.bench.load", "concurrency sweep: in-process, via gRPC or the OpenAI API; --baseline hf"),
    "engine": ("cluster.bench.engine_bench", "single-stream engine speed: off / n-gram / draft model x gamma"),
    "medusa": ("cluster.bench.medusa_bench", "Medusa heads (tree sizes) against the n-gram and draft-model drafters"),
    "eagle3": ("cluster.bench.eagle3_bench", "EAGLE-3 against the draft model and Medusa: acceptance at T=0 and 0.7"),
    "serve": ("cluster.bench.serve_bench", "through Ray Serve + gRPC: colocated vs disaggregated drafting"),
    "policy": ("cluster.bench.policy_bench", "speculation policies against concurrency"),
    "routing": ("cluster.bench.routing_bench", "cache-aware vs default routing on shared prefixes"),
    "kvdir": ("cluster.bench.kvdir_bench", "KV block directory throughput and overlap latency"),
    "serve-scale": ("cluster.bench.serve_scale", "the served endpoint against the in-process engine, off/gamma/auto"),
    "hop": ("cluster.bench.hop_bench", "verifier -> drafter round trip: Serve handle, gRPC, ZeroMQ"),
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in BENCHES:
        print("usage: spec-cluster bench NAME [--help | args]\n")
        for name, (_, doc) in BENCHES.items():
            print(f"  {name:8s} {doc}")
        return 0 if not argv or argv[0] in ("-h", "--help") else 2
    module = importlib.import_module(BENCHES[argv[0]][0])
    sys.argv = [f"spec-cluster bench {argv[0]}", *argv[1:]]  # for benches that parse sys.argv
    try:
        return module.main(argv[1:]) or 0
    except TypeError:  # a bench whose main() takes no arguments
        return module.main() or 0
