#!/usr/bin/env bash
# On a GPU machine: the serve benchmark end to end through Ray Serve + gRPC (demo pair),
# colocated vs disaggregated drafting; with 2 GPUs the drafter gets its own GPU.
set -eo pipefail
bash .device-bundle/unpack.sh || exit 1
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv
n=$(nvidia-smi -L | wc -l)
python3 -m cluster.bench.serve_bench --out "${OUT:-.}" --gpus "$n" --repeats 2 --new-tokens 128 2>&1 | grep -v "INFO\|WARN" | tee "${OUT:-.}/serve_bench.log"
