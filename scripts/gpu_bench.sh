#!/usr/bin/env bash
# On the GPU machine (device tool): unpack the bundle, then run the checks into $OUT.
set -eo pipefail
bash "${BUNDLE:-.device-bundle}/unpack.sh" || exit 1  # BUNDLE=.device-bundle-engine: scripts/make_small_bundles.sh
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv
# dynamo recompiles and Triton autotuning runs go to the log: either can stall a step for seconds
TORCH_LOGS=recompiles TRITON_PRINT_AUTOTUNING=1 python3 scripts/gpu_bench.py 2>&1 | tee "${OUT:-.}/gpu_bench.log"
