"""k8s/: each kustomization renders, its RayService passes the KubeRay CRD's v1 schema (with
the API server's strict unknown-field check), its serveConfigV2 is deploy/serve_config.yaml's
application up to the intended overlay differences, verifiers land on Hopper GPUs in the
hopper overlay, a tensor-parallel verifier's GPUs are one pod of hopper-70b's verifier group,
and the Redis password only ever comes from a Secret.

Rendering: the real `kubectl kustomize <dir>` (kubectl's built-in kustomize); without kubectl
on the PATH every test here is skipped.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "k8s"
KUSTOMIZATIONS = ["base", "overlays/dev", "overlays/hopper", "overlays/hopper-70b"]
SECRET = {"name": "spec-cluster-redis", "key": "password"}
KUBECTL = shutil.which("kubectl")
# what cluster.deploy_config's k8s targets set: proxies on every interface, drafters on the node
# IP, API keys from the env a Secret fills
K8S_NETWORK = {"network": {"host": "0.0.0.0", "drafter_host": "node"},
               "router": {"api_keys_env": "SPEC_CLUSTER_API_KEYS"}}
KEYS_SECRET = {"name": "spec-cluster-api-keys", "key": "keys"}

pytestmark = pytest.mark.skipif(KUBECTL is None, reason="kubectl is needed to render the KubeRay overlays")


def _strict(schema):
    """Unknown fields are errors, as for `kubectl apply` (strict field validation); the CRD
    leaves that to the API server, so jsonschema alone would accept typos."""
    if isinstance(schema, dict):
        schema = {k: _strict(v) for k, v in schema.items()}
        if ("properties" in schema and "additionalProperties" not in schema
                and not schema.get("x-kubernetes-preserve-unknown-fields")):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [_strict(x) for x in schema]
    return schema


@pytest.fixture(scope="module")
def validator():
    jsonschema = pytest.importorskip("jsonschema")
    raw = json.loads((Path(__file__).parent / "schemas" / "rayservice-v1.json").read_text())
    return jsonschema.Draft7Validator(_strict(raw["openAPIV3Schema"]))


class KustomizeError(RuntimeError):
    pass


def kustomize(path: Path) -> list[dict]:
    """`kubectl kustomize path`: the documents it renders (multi-document YAML)."""
    r = subprocess.run([KUBECTL, "kustomize", str(path)], capture_output=True, text=True, timeout=120)
    if r.returncode != 0:
        raise KustomizeError(f"kubectl kustomize {path} failed ({r.returncode}): {r.stderr.strip()}")
    return [d for d in yaml.safe_load_all(r.stdout) if d]


_cache: dict[str, list[dict]] = {}


def render(name: str) -> list[dict]:
    if name not in _cache:
        _cache[name] = kustomize(K8S / name)
    return copy.deepcopy(_cache[name])


def one(docs: list[dict], kind: str) -> dict:
    [doc] = [d for d in docs if d["kind"] == kind]
    return doc


def groups(rs: dict) -> dict[str, dict]:
    return {g["groupName"]: g for g in rs["spec"]["rayClusterConfig"]["workerGroupSpecs"]}


def ray_pods(rs: dict) -> list[dict]:
    rc = rs["spec"]["rayClusterConfig"]
    return [rc["headGroupSpec"]] + rc["workerGroupSpecs"]


def serve_config_v2(rs: dict) -> dict:
    return yaml.safe_load(rs["spec"]["serveConfigV2"])


def deploy_serve_config() -> dict:
    return yaml.safe_load((REPO / "deploy" / "serve_config.yaml").read_text())


def leaves(doc, path: str = "") -> dict[str, object]:
    if isinstance(doc, dict):
        return {k: v for key, val in doc.items() for k, v in leaves(val, f"{path}/{key}").items()}
    if isinstance(doc, list) and doc:
        return {k: v for i, val in enumerate(doc) for k, v in leaves(val, f"{path}/{i}").items()}
    return {path: doc}


def differing(a: dict, b: dict) -> set[str]:
    la, lb = leaves(a), leaves(b)
    return {k for k in la.keys() | lb.keys() if la.get(k, KeyError) != lb.get(k, KeyError)}


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_rayservice_matches_the_crd(name, validator):
    rs = one(render(name), "RayService")
    errors = [f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(rs)]
    assert not errors, "\n".join(errors)


def test_strict_schema_rejects_a_misspelled_field(validator):
    rs = one(render("overlays/dev"), "RayService")
    rs["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["maxReplica"] = 3
    assert any("maxReplica" in e.message for e in validator.iter_errors(rs))


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_serve_config_v2_is_a_valid_serve_config(name):
    from ray.serve.schema import ServeDeploySchema

    ServeDeploySchema.model_validate(serve_config_v2(one(render(name), "RayService")))


@pytest.mark.parametrize("name", ["base", "overlays/dev"])
def test_cpu_serve_config_v2_is_deploy_serve_config_with_redis(name):
    v2 = serve_config_v2(one(render(name), "RayService"))
    # the in-cluster Redis, and proxies bound to every interface (a VM's serve config keeps loopback)
    assert differing(v2, deploy_serve_config()) == {"/applications/0/args/cluster/kvdir/url", "/http_options/host",
                                                    "/controller_options/runtime_env/env_vars/SPEC_CLUSTER_GRPC_HOST",
                                                    "/applications/0/args/cluster/network/host",
                                                    "/applications/0/args/cluster/network/drafter_host",
                                                    "/applications/0/args/cluster/router/api_keys_env"}
    assert v2["applications"][0]["args"]["cluster"]["kvdir"]["url"] == "redis://redis:6379/0"
    assert v2["http_options"]["host"] == "0.0.0.0" and deploy_serve_config()["http_options"]["host"] == "127.0.0.1"


def test_hopper_serve_config_v2_differs_only_in_cluster_and_sizes():
    from cluster.deploy_config import render as generate

    v2 = serve_config_v2(one(render("overlays/hopper"), "RayService"))
    assert v2 == yaml.safe_load(generate("configs/hopper.yaml", overrides=K8S_NETWORK))
    allowed = ("/applications/0/args/cluster/", "/applications/0/deployments/", "/http_options/host",
               "/controller_options/runtime_env/env_vars/SPEC_CLUSTER_GRPC_HOST")
    assert all(p.startswith(allowed) for p in differing(v2, deploy_serve_config()))
    app = v2["applications"][0]
    assert [d["name"] for d in app["deployments"]] == ["Router", "Verifier", "Drafter"]
    assert app["args"]["cluster"]["models"]["target"].startswith("/models/")


def ray_resources(group: dict, head: bool = False) -> dict:
    """The group's resources as Ray's KubeRay autoscaler reads them."""
    from ray.autoscaler._private.kuberay.autoscaling_config import _get_ray_resources_from_group_spec

    return _get_ray_resources_from_group_spec(group, is_head=head)


def demand(ray_actor_options: dict) -> dict:
    """Ray resources one replica asks for (accelerator_type becomes a tiny custom resource)."""
    need = {"CPU": ray_actor_options.get("num_cpus", 1), "GPU": ray_actor_options.get("num_gpus", 0)}
    if "accelerator_type" in ray_actor_options:
        need[f"accelerator_type:{ray_actor_options['accelerator_type']}"] = 0.001
    return {k: v for k, v in need.items() if v}


def fits(need: dict, have: dict) -> bool:
    return all(have.get(k, 0) >= v for k, v in need.items())


def per_pod(need: dict, have: dict) -> int:
    """How many replicas asking `need` one pod with `have` holds."""
    return int(min(have.get(k, 0) // v for k, v in need.items()))


def test_hopper_verifiers_only_fit_the_hopper_group():
    from ray.util.accelerators import NVIDIA_H100

    from cluster.policy.config import load_autoscaling

    rs = one(render("overlays/hopper"), "RayService")
    g = groups(rs)
    verifier, drafter = g["verifier"], g["drafter"]
    for group in (verifier, drafter):  # both groups: one Hopper GPU per pod
        pod = group["template"]["spec"]
        assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == "1"
        assert re.fullmatch(r"NVIDIA-H(100|200).*", pod["nodeSelector"]["nvidia.com/gpu.product"])
        assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]

    entries = {d["name"]: d for d in serve_config_v2(rs)["applications"][0]["deployments"]}
    need = demand(entries["Verifier"]["ray_actor_options"])
    assert need.get("GPU") == 1 and f"accelerator_type:{NVIDIA_H100}" in need
    assert fits(need, ray_resources(verifier))
    assert not fits(need, ray_resources(drafter))
    assert not fits(need, ray_resources(rs["spec"]["rayClusterConfig"]["headGroupSpec"], head=True))
    # drafters draft on a GPU of their own (a 1B draft step on CPU is many verify steps)
    draft_need = demand(entries["Drafter"]["ray_actor_options"])
    assert draft_need.get("GPU") == 1 and f"accelerator_type:{NVIDIA_H100}" in draft_need
    for name in ("Router", "Drafter"):
        assert fits(demand(entries[name]["ray_actor_options"]), ray_resources(drafter))
    router_need = demand(entries["Router"]["ray_actor_options"])
    assert fits({k: draft_need.get(k, 0) + router_need.get(k, 0) for k in draft_need | router_need},
                ray_resources(drafter))  # a drafter pod also holds the Router

    # the groups can hold what Serve autoscaling may ask for (one verifier per GPU pod)
    scaling = load_autoscaling(REPO / "configs" / "autoscaling.yaml")
    assert verifier["maxReplicas"] * ray_resources(verifier)["GPU"] >= scaling.verifier.max_replicas
    assert drafter["maxReplicas"] * per_pod(draft_need, ray_resources(drafter)) >= scaling.drafter.max_replicas
    for group in (verifier, drafter):
        volumes = group["template"]["spec"]["volumes"]
        claims = [v["persistentVolumeClaim"]["claimName"] for v in volumes if "persistentVolumeClaim" in v]
        # the weights, and the compile cache (configs/hopper.yaml engine.compile_cache_dir) for warm starts
        assert claims == ["spec-cluster-models", "spec-cluster-compile-cache"]
    pvcs = [d for d in render("overlays/hopper") if d["kind"] == "PersistentVolumeClaim"]
    assert sorted(p["metadata"]["name"] for p in pvcs) == ["spec-cluster-compile-cache", "spec-cluster-models"]
    mounts = {m["name"]: m["mountPath"] for m in groups(one(render("overlays/hopper"), "RayService"))["verifier"]
              ["template"]["spec"]["containers"][0]["volumeMounts"]}
    cache = yaml.safe_load((REPO / "configs" / "hopper.yaml").read_text())["engine"]["compile_cache_dir"]
    assert cache.startswith(mounts["compile-cache"] + "/")


def test_hopper_70b_pods_hold_the_gpus_of_one_verifier_replica():
    """configs/hopper-70b.yaml's verifier is 8 ranks: its placement group (STRICT_PACK, so one
    node) fits one pod of the verifier group, a pod holds no second one, and no other group
    holds one at all; drafters and the Router are placed as in the hopper overlay."""
    from cluster.deploy_config import render as generate

    rs = one(render("overlays/hopper-70b"), "RayService")
    v2 = serve_config_v2(rs)
    assert v2 == yaml.safe_load(generate("configs/hopper-70b.yaml", overrides=K8S_NETWORK))
    cluster = v2["applications"][0]["args"]["cluster"]
    tp = cluster["engine"]["tensor_parallel_size"]
    assert tp == 8 and cluster["engine"]["kv_cache_gb"]  # required per rank on GPUs (cluster/engine/worker/memory.py)
    entries = {d["name"]: d for d in v2["applications"][0]["deployments"]}
    verifier = entries["Verifier"]
    bundles = verifier["placement_group_bundles"]
    assert verifier["placement_group_strategy"] == "STRICT_PACK" and len(bundles) == tp
    assert all(b["GPU"] == 1 and b["accelerator_type:H100"] for b in bundles)
    assert fits(demand(verifier["ray_actor_options"]), bundles[0])  # Serve's rule: rank 0 sits in bundle 0
    replica = {k: sum(b.get(k, 0) for b in bundles) for k in set().union(*bundles)}
    g = groups(rs)
    pod = ray_resources(g["verifier"])
    assert fits(replica, pod) and per_pod(replica, pod) == 1
    assert g["verifier"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == str(tp)
    assert g["verifier"]["maxReplicas"] >= verifier["num_replicas"]
    assert not fits(replica, ray_resources(g["drafter"]))
    assert fits(demand(entries["Drafter"]["ray_actor_options"]), ray_resources(g["drafter"]))
    assert fits(demand(entries["Router"]["ray_actor_options"]), ray_resources(g["drafter"]))
    def models_pvc(overlay: str) -> dict:
        return next(d for d in render(overlay)
                    if d["kind"] == "PersistentVolumeClaim" and d["metadata"]["name"] == "spec-cluster-models")

    size = models_pvc("overlays/hopper-70b")["spec"]["resources"]["requests"]["storage"]
    assert int(size.removesuffix("Gi")) >= 150  # 141 GB of 70B weights
    assert models_pvc("overlays/hopper")["spec"]["resources"]["requests"]["storage"] == "100Gi"


@pytest.mark.parametrize("name", ["base", "overlays/dev"])
def test_cpu_overlays_request_no_gpus(name):
    rc = one(render(name), "RayService")["spec"]["rayClusterConfig"]
    assert "nvidia.com/gpu" not in json.dumps(rc)
    assert not ray_resources(rc["headGroupSpec"], head=True).get("GPU")
    assert not any(ray_resources(g).get("GPU") for g in rc["workerGroupSpecs"])


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_head_runs_no_replicas_and_exposes_dashboard_grpc_http(name):
    rs = one(render(name), "RayService")
    rc = rs["spec"]["rayClusterConfig"]
    head = rc["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"
    container = head["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in json.dumps(container["resources"])
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}  # the head Service's ports
    assert ports["dashboard"] == 8265
    # the HTTP (OpenAI API) and gRPC proxies' ports, from the serve config the cluster runs,
    # agree with the app's own network section, every pod's container ports (proxies run on
    # every node) and the Service clients use
    v2 = serve_config_v2(rs)
    network = v2["applications"][0]["args"]["cluster"]["network"]
    http, grpc = v2["http_options"]["port"], v2["grpc_options"]["port"]
    assert (http, grpc) == (network["http_port"], network["grpc_port"]) == (8000, 9000)
    assert v2["http_options"]["host"] == "0.0.0.0"  # reachable from the Service, not only the pod
    for pod in ray_pods(rs):
        declared = {p["name"]: p["containerPort"] for p in pod["template"]["spec"]["containers"][0]["ports"]}
        assert declared["serve"] == http and declared["grpc"] == grpc, pod.get("groupName", "head")
    service = {p["name"]: p for p in rs["spec"]["serveService"]["spec"]["ports"]}
    assert {k: (p["port"], p["targetPort"]) for k, p in service.items()} == {"grpc": (grpc, grpc),
                                                                            "serve": (http, http)}
    env = {e["name"] for e in container["env"]}
    assert {"RAY_GRAFANA_HOST", "RAY_PROMETHEUS_HOST"} <= env
    assert rc["enableInTreeAutoscaling"] is True and rc["autoscalerOptions"]
    for group in rc["workerGroupSpecs"]:
        assert group["minReplicas"] <= group.get("replicas", group["minReplicas"]) <= group["maxReplicas"]


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_api_keys_come_from_a_secret(name):
    """The proxies bind every interface in a pod, so the router asks for keys, read from
    the env that the Secret spec-cluster-api-keys fills on every Ray container."""
    docs = render(name)
    rs = one(docs, "RayService")
    router = serve_config_v2(rs)["applications"][0]["args"]["cluster"]["router"]
    assert router["api_keys_env"] == "SPEC_CLUSTER_API_KEYS" and not router.get("api_keys")
    for c in (c for g in ray_pods(rs) for c in g["template"]["spec"]["containers"]):
        [env] = [e for e in c["env"] if e["name"] == "SPEC_CLUSTER_API_KEYS"]
        assert env == {"name": "SPEC_CLUSTER_API_KEYS", "valueFrom": {"secretKeyRef": KEYS_SECRET}}


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_redis_password_comes_from_a_secret(name):
    docs = render(name)
    rs = one(docs, "RayService")
    containers = [c for g in ray_pods(rs) for c in g["template"]["spec"]["containers"]]
    if name != "base":
        redis = one(docs, "StatefulSet")
        assert "$(REDIS_PASSWORD)" in redis["spec"]["template"]["spec"]["containers"][0]["args"]
        containers += redis["spec"]["template"]["spec"]["containers"]
        assert one(docs, "Service")["metadata"]["name"] == "redis"
    for c in containers:
        [env] = [e for e in c["env"] if e["name"] == "REDIS_PASSWORD"]
        assert env == {"name": "REDIS_PASSWORD", "valueFrom": {"secretKeyRef": SECRET}}
    url = serve_config_v2(rs)["applications"][0]["args"]["cluster"]["kvdir"]["url"]
    assert url == "redis://redis:6379/0"  # no password in the config
    secrets = [d for d in docs if d["kind"] == "Secret"]
    if name == "overlays/dev":  # throwaway values for a laptop
        assert sorted(s["metadata"]["name"] for s in secrets) == sorted([SECRET["name"], KEYS_SECRET["name"]])
    else:  # created out of band (docs/deploy.md), never committed
        assert not secrets


def test_images_and_ray_version_agree():
    import ray

    for name in KUSTOMIZATIONS:
        rs = one(render(name), "RayService")
        assert rs["spec"]["rayClusterConfig"]["rayVersion"] == ray.__version__
        images = {c["image"] for g in ray_pods(rs) for c in g["template"]["spec"]["containers"]}
        assert len(images) == 1, images
    assert images == {"registry.example.com/spec-cluster:0.1.0-hopper"}
    dockerfile = (REPO / "Dockerfile").read_text()
    assert f"ARG RAY_TAG={ray.__version__}-py311" in dockerfile


def test_overlay_patches_check_which_group_they_patch(tmp_path):
    """Overlays patch worker groups by index; a `test` op on groupName guards each, so
    reordering the base's groups fails the render instead of sizing the wrong group."""
    base = one(render("base"), "RayService")
    patch = (K8S / "overlays" / "hopper" / "rayservice-hopper.yaml").read_text()

    def patched(rs: dict) -> list[dict]:
        (tmp_path / "rayservice.yaml").write_text(yaml.safe_dump(rs))
        (tmp_path / "patch.yaml").write_text(patch)  # kustomize loads files from under its root only
        (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
            "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
            "resources": ["rayservice.yaml"],
            "patches": [{"path": "patch.yaml", "target": {"kind": "RayService", "name": "spec-cluster"}}]}))
        return kustomize(tmp_path)

    wg = base["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    wg.reverse()
    with pytest.raises(KustomizeError, match="groupName"):
        patched(base)
    wg.reverse()
    assert groups(one(patched(base), "RayService"))["verifier"]["maxReplicas"] == 8
