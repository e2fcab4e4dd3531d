#!/usr/bin/env bash
# On the GPU machine: unpack the engine bundle and run one engine-only GPU script, its output
# also in $OUT/<script>.log. Usage: bash scripts/gpu_py.sh gpu_scale.py   (or gpu_paged_attn.py)
set -eo pipefail
export BUNDLE=${BUNDLE:-.device-bundle-engine}
bash "$BUNDLE/unpack.sh" || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total --format=csv
python3 "scripts/$1" 2>&1 | tee "${OUT:-.}/${1%.py}.log"
