"""Render k8s/ like `kubectl kustomize`, for machines without kubectl or kustomize.

Covers only what k8s/ uses: `resources` (files and directories), `components`, JSON6902
`patches` from a file with a kind/name target, and `images`. Anything else raises, so a new
kustomize feature in k8s/ fails loudly here instead of rendering wrongly. When kubectl is
present, test_k8s.py checks that both renderers agree.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import copy

import yaml

KNOWN = {"apiVersion", "kind", "resources", "components", "patches", "images"}


def render(path: Path) -> list[dict]:
    path = Path(path)
    k = yaml.safe_load((path / "kustomization.yaml").read_text())
    unknown = set(k) - KNOWN
    if unknown:
        raise NotImplementedError(f"{path}: kustomize_lite does not handle {sorted(unknown)}")
    docs: list[dict] = []
    for entry in k.get("resources", []) + k.get("components", []):
        target = path / entry
        if target.is_dir():
            docs += render(target)
        else:
            docs += [d for d in yaml.safe_load_all(target.read_text()) if d]
    for p in k.get("patches", []):
        ops = yaml.safe_load((path / p["path"]).read_text())
        if not isinstance(ops, list) or set(p) - {"path", "target"}:
            raise NotImplementedError(f"{path}: only JSON6902 patches from a file with a target")
        hits = [i for i, d in enumerate(docs) if _matches(d, p["target"])]
        if not hits:
            raise ValueError(f"{path}: patch {p['path']} matches nothing")
        for i in hits:
            docs[i] = apply_json6902(docs[i], ops)
    for image in k.get("images", []):
        for d in docs:
            _set_image(d, image)
    return docs


def apply_json6902(doc: dict, ops: list[dict]) -> dict:
    """RFC 6902 add / replace / remove / test (what k8s/ uses)."""
    doc = copy.deepcopy(doc)
    for op in ops:
        *parents, last = [p.replace("~1", "/").replace("~0", "~") for p in op["path"].split("/")[1:]]
        node = doc
        for p in parents:
            node = node[int(p)] if isinstance(node, list) else node[p]
        key = (len(node) if last == "-" else int(last)) if isinstance(node, list) else last
        kind, value = op["op"], copy.deepcopy(op.get("value"))
        if kind == "test":
            if node[key] != value:
                raise ValueError(f"test failed at {op['path']}: {node[key]!r} != {value!r}")
        elif kind == "remove":
            del node[key]
        elif kind == "add" and isinstance(node, list):
            node.insert(key, value)
        elif kind == "add" or (kind == "replace" and (isinstance(node, list) or key in node)):
            node[key] = value
        else:
            raise ValueError(f"cannot {kind} {op['path']}")
    return doc


def _matches(doc: dict, target: dict) -> bool:
    return all(doc.get("kind") == v if key == "kind" else doc["metadata"].get("name") == v
               for key, v in target.items() if key in ("kind", "name"))


def _set_image(node, image: dict) -> None:
    if isinstance(node, list):
        for x in node:
            _set_image(x, image)
        return
    if not isinstance(node, dict):
        return
    for key, value in node.items():
        if key in ("containers", "initContainers") and isinstance(value, list):
            for c in value:
                name, _, tag = c.get("image", "").partition(":")
                if name == image["name"]:
                    c["image"] = f"{image.get('newName', name)}:{image.get('newTag', tag)}"
        else:
            _set_image(value, image)


def kubectl_render(path: Path) -> list[dict] | None:
    """`kubectl kustomize` (or a kustomize binary) output, or None when neither exists."""
    for cmd in (["kustomize", "build"], ["kubectl", "kustomize"]):
        if shutil.which(cmd[0]):
            out = subprocess.run(cmd + [str(path)], check=True, capture_output=True, text=True).stdout
            return [d for d in yaml.safe_load_all(out) if d]
    return None
