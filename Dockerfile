# spec-cluster on Ray's image: the package (with the demo pair as package data) installed
# into Ray's Python, so KubeRay pods and `serve run` workers import `cluster` directly.
#
#   CPU (k8s/overlays/dev):  docker build -t spec-cluster:0.1.0 .
#   Hopper (overlays/hopper): docker build --build-arg RAY_TAG=2.60.0-py311-gpu \
#       --build-arg TORCH_INDEX= --build-arg EXTRAS=[hopper] \
#       -t registry.example.com/spec-cluster:0.1.0-hopper .
#
# RAY_TAG must match the rayVersion in k8s/base/rayservice.yaml (and the Ray of the
# machine that generates deploy/serve_config.yaml); -gpu tags carry CUDA.
ARG RAY_TAG=2.60.0-py311
FROM rayproject/ray:${RAY_TAG}

# The CPU torch wheel keeps the dev image small; empty TORCH_INDEX = PyPI's CUDA wheels.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG EXTRAS=""

WORKDIR /home/ray/spec-cluster
COPY --chown=ray:users pyproject.toml README.md ./
COPY --chown=ray:users cluster ./cluster
RUN pip install --no-cache-dir ${TORCH_INDEX:+--index-url ${TORCH_INDEX}} torch==2.13.0 \
 && pip install --no-cache-dir ".${EXTRAS}" \
 && python -c "import cluster.serve.app, cluster.deploy_config"
# Configs and generated Serve configs, for `serve deploy` from inside the image.
COPY --chown=ray:users configs ./configs
COPY --chown=ray:users deploy ./deploy
WORKDIR /home/ray
