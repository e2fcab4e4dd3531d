"""Ray Serve config files generated from the typed cluster config, so they never drift.

    python -m cluster.deploy_config                      # rewrite every file in TARGETS
    python -m cluster.deploy_config --check              # exit 1 if a committed one differs
    python -m cluster.deploy_config --config configs/cluster.yaml --out deploy/serve_config.yaml

A Serve config (`serve run` / `serve deploy`, ServeDeploySchema) carries the proxies'
options and one application: `cluster.serve.app:app_builder` with the cluster config inline
in `args.cluster` (so no config file has to exist where the app is built: a KubeRay head
pod only needs the package), plus a `deployments:` entry per sized deployment. The entries
come from building the application and reading back each deployment's options, as
`serve build` does, so they are what the code sets, not a second copy of its rules.
The autoscaling file is folded into those entries and dropped from the inline config.

The KubeRay form is a JSON6902 patch that sets a RayService's `spec.serveConfigV2` to the
same document (k8s/base, k8s/overlays/hopper and hopper-70b apply them with kustomize).
"""

from __future__ import annotations

import argparse
import difflib
import sys
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from cluster.config import ClusterConfig, ConfigError, load_config, parse_config

REPO = Path(__file__).resolve().parents[1]
IMPORT_PATH = "cluster.serve.app:app_builder"
SIZED = ("Router", "Verifier", "Drafter")
"""Deployments a serve config sizes; StatsBoard is a zero-CPU singleton left to the code."""
K8S_KVDIR_URL = "redis://redis:6379/0"
"""The Redis Service of k8s/base; REDIS_PASSWORD comes from a Secret."""


@dataclass(frozen=True)
class Target:
    out: str
    config: str
    kind: str = "serve"             # "serve": a Serve config file; "kuberay": a serveConfigV2 patch
    overrides: dict = field(default_factory=dict)


# In a pod the proxies bind every interface (the Service reaches them from outside it), so
# clients need keys: from the Secret spec-cluster-api-keys, as env (k8s/base/rayservice.yaml).
# Drafters advertise the pod IP: verifier pods join later.
K8S_OPEN = {"network": {"host": "0.0.0.0", "drafter_host": "node"},
            "router": {"api_keys_env": "SPEC_CLUSTER_API_KEYS"}}

TARGETS = (
    Target("deploy/serve_config.yaml", "configs/cluster.yaml"),
    Target("k8s/base/serve-config-v2.yaml", "configs/cluster.yaml", "kuberay",
           {"kvdir": {"url": K8S_KVDIR_URL}, **K8S_OPEN}),
    # configs/hopper.yaml names its Redis itself (in-cluster or external).
    Target("k8s/overlays/hopper/serve-config-v2.yaml", "configs/hopper.yaml", "kuberay",
           K8S_OPEN),
    Target("k8s/overlays/hopper-70b/serve-config-v2.yaml", "configs/hopper-70b.yaml", "kuberay",
           K8S_OPEN),
)


def inline_args(cfg: ClusterConfig) -> dict:
    """The cluster config as written (fields left unset keep the code's defaults), minus what
    only a local process can use: the autoscaling file (folded into deployment entries) and
    the 'embedded' directory, which only `spec-cluster up` starts."""
    data = cfg.model_dump(mode="json", exclude_unset=True)
    data.pop("autoscaling_file", None)
    if cfg.kvdir.url == "embedded":
        data.setdefault("kvdir", {})["url"] = None
    return data


def _tidy(value):
    # Serve stores resource counts as floats; 1 reads better than 1.0 in a config file.
    if isinstance(value, dict):
        return {k: _tidy(v) for k, v in value.items()}
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def deployment_entries(cfg: ClusterConfig) -> list[dict]:
    """Replicas or autoscaling, max_ongoing_requests, ray_actor_options and any placement
    group (tensor-parallel verifiers) of each sized deployment, read back from the
    application the code builds for `cfg`."""
    from ray.serve._private.build_app import build_app as serve_build
    from ray.serve.deployment import deployment_to_schema

    from cluster.serve.app import build_app

    built = serve_build(build_app(cfg), name=cfg.network.app_name)
    by_name = {d.name: d for d in built.deployments}
    entries = []
    for name in SIZED:
        if name not in by_name:  # colocated placement has no Drafter
            continue
        d = by_name[name]
        entry: dict = {"name": name}
        schema = deployment_to_schema(d).model_dump(exclude_unset=True)
        autoscaling = schema.get("autoscaling_config")
        if autoscaling:
            entry["autoscaling_config"] = autoscaling
        else:
            entry["num_replicas"] = d.num_replicas
        entry["max_ongoing_requests"] = d.max_ongoing_requests
        entry["ray_actor_options"] = dict(d.ray_actor_options or {})
        for key in ("placement_group_bundles", "placement_group_strategy"):  # tensor-parallel verifiers
            if schema.get(key):
                entry[key] = schema[key]
        entries.append(_tidy(entry))
    return entries


def serve_config(cfg: ClusterConfig) -> dict:
    """The Serve config document (ray.serve.schema.ServeDeploySchema) for `cfg`."""
    from cluster.serve.app import SERVICERS
    from cluster.serve.launch import controller_options

    net, args = cfg.network, inline_args(cfg)
    # Entries from the app the cluster will build (the inline config) with the autoscaling
    # that the file adds: exactly what the deployments run with.
    deployed = parse_config({**args, "autoscaling_file": cfg.autoscaling_file})
    return {
        "proxy_location": "EveryNode",
        "http_options": {"host": net.host, "port": net.http_port},
        "grpc_options": {"port": net.grpc_port, "grpc_servicer_functions": list(SERVICERS)},
        "controller_options": controller_options(cfg),
        "applications": [{
            "name": net.app_name,
            "route_prefix": net.route_prefix,
            "import_path": IMPORT_PATH,
            "args": {"cluster": args},
            "deployments": deployment_entries(deployed),
        }],
    }


class _Dumper(yaml.SafeDumper):
    pass


def _str(dumper, s: str):  # multi-line strings (serveConfigV2) as readable `|` blocks
    return dumper.represent_scalar("tag:yaml.org,2002:str", s, style="|" if "\n" in s else None)


_Dumper.add_representer(str, _str)


def _dump(doc) -> str:
    return yaml.dump(doc, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=100)


def _flat(d: dict, prefix: str = "") -> list[str]:
    return [x for k, v in d.items()
            for x in (_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else [f"{prefix}{k}={v}"])]


def render(config: str, kind: str = "serve", overrides: dict | None = None) -> str:
    """The file text for one target: a header saying where it comes from, then the document.
    Relative paths (the config, its autoscaling_file) are tried from the working directory,
    then from the repository root, so the result does not depend on where this runs."""
    cfg = load_config(_find(config), overrides)
    if cfg.autoscaling_file:
        cfg.autoscaling_file = str(_find(cfg.autoscaling_file))
    from ray.serve.schema import ServeDeploySchema

    doc = serve_config(cfg)
    ServeDeploySchema.model_validate(doc)  # a bad file is never written
    how = " ".join([f"--config {config}"] + _flat(overrides or {}))
    header = (f"# Generated by `python -m cluster.deploy_config` from {how}. Do not edit:\n"
              f"# change the config and regenerate; tests fail while this file differs.\n")
    if kind == "serve":
        return header + "\n" + _dump(doc)
    if kind == "kuberay":
        patch = [{"op": "add", "path": "/spec/serveConfigV2", "value": _dump(doc)}]
        return header + "# A JSON6902 patch setting a RayService's serveConfigV2.\n" + _dump(patch)
    raise ValueError(f"unknown kind {kind!r} (serve, kuberay)")


def _find(path: str) -> Path:
    p = Path(path)
    return p if p.is_absolute() or p.exists() else REPO / p


def _write_or_check(text: str, out: Path, check: bool) -> bool:
    """Returns True when `out` already holds `text` (check) or was written."""
    if not check:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(text)
        print(f"wrote {out}")
        return True
    old = out.read_text() if out.exists() else ""
    if old == text:
        return True
    diff = difflib.unified_diff(old.splitlines(True), text.splitlines(True), str(out), "generated")
    sys.stderr.write(f"{out} is stale; run `python -m cluster.deploy_config`\n" + "".join(list(diff)[:60]))
    return False


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cluster.deploy_config", description=__doc__.split("\n")[0])
    p.add_argument("--config", help="cluster YAML (default: every file in TARGETS)")
    p.add_argument("--out", help="output path (with --config; default stdout)")
    p.add_argument("--kind", choices=["serve", "kuberay"], default="serve")
    p.add_argument("--check", action="store_true", help="compare instead of writing; exit 1 on a difference")
    a = p.parse_args(argv)
    try:
        if a.config:
            text = render(a.config, a.kind)
            if not a.out:
                sys.stdout.write(text)
                return 0
            return 0 if _write_or_check(text, Path(a.out), a.check) else 1
        ok = [_write_or_check(render(t.config, t.kind, t.overrides), REPO / t.out, a.check) for t in TARGETS]
    except ConfigError as e:
        sys.stderr.write(f"{e}\n")
        return 2
    return 0 if all(ok) else 1


if __name__ == "__main__":
    sys.exit(main())
