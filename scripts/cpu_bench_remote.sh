#!/usr/bin/env bash
# CPU benchmarks on a quiet machine (the GPU host's CPUs, GPUs unused): engine and serve.
set -eo pipefail
bash .device-bundle/unpack.sh || exit 1
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1 CUDA_VISIBLE_DEVICES=""
nproc
python3 -m cluster.bench.engine_bench --out "$OUT/engine" --device cpu --threads 2 2>&1 | grep -v "engine bench:" | tee "$OUT/engine.log"
python3 -m cluster.bench.serve_bench --out "$OUT/serve" --device cpu --repeats 2 2>&1 | grep -v "INFO\|WARN\|serve bench:" | tee "$OUT/serve.log"
