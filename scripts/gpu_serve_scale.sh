#!/usr/bin/env bash
# The served endpoint against the in-process engine on one GPU (cluster/bench/serve_scale.py).
#   run: bash scripts/gpu_serve_scale.sh     carry: [".device-bundle-multi"]
set -o pipefail
export BUNDLE=${BUNDLE:-.device-bundle-multi}
bash "$BUNDLE/unpack.sh" || exit 1
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
mkdir -p /tmp/site/ray/dashboard/client/build/static  # see scripts/gpu_smoke.sh
nvidia-smi --query-gpu=name --format=csv,noheader
mkdir -p "${OUT:-.}"
python3 -m cluster.bench.serve_scale 2>&1 | grep -v "^\s*$" | tee "${OUT:-.}/serve_scale.log"
