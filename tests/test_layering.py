"""The package's layering, read from its import graph (every import, module level or inside a
function): no cycles; the engine imports nothing above it; drafters hold no engine."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "cluster"
# what each package may import besides itself (and cluster.proto, generated code)
ALLOWED = {
    "engine": set(),
    "policy": {"engine"},
    "kvdir": {"engine"},
    "training": {"engine"},
    "serve": {"engine", "policy", "kvdir", "config", "proto"},
}


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    modules = {_module(p): p for p in PKG.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.ImportFrom) and node.module:
                targets = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            deps |= {t for t in targets if t in modules and t != name}
        graph[name] = deps
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        stack.append(n)
        for d in sorted(graph[n]):
            if state.get(d) == 1:
                return stack[stack.index(d):] + [d]
            if d not in state and (found := visit(d)):
                return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(graph):
        if n not in state and (found := visit(n)):
            return found
    return None


def _without_packages(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """A package's __init__ re-exporting its modules is not a cycle of theirs."""
    packages = {n for n in graph if (ROOT / n.replace(".", "/") / "__init__.py").exists()}
    return {n: {d for d in deps if d not in packages} for n, deps in graph.items()}


def test_no_import_cycles():
    assert _cycle(_without_packages(import_graph())) is None


def test_the_cycle_finder_finds_one():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_layers_import_only_below(package):
    bad = []
    for name, deps in import_graph().items():
        if name.startswith(f"cluster.{package}.") or name == f"cluster.{package}":
            for d in deps:
                top = d.split(".")[1]
                if top != package and top not in ALLOWED[package] | {"proto"}:
                    bad.append(f"{name} -> {d}")
    assert not bad


# The engine's rooms (cluster/engine/__init__.py), lowest first: a room imports only rooms
# before it and the shared modules at the top; the entry modules are imported by none of them.
ROOMS = ["scheduling", "worker", "drafters", "spec", "distributed"]
SHARED = {"config", "sampling", "logprobs", "observation", "stopping"}
ENTRY = {"engine", "generate", "requests"}


def _engine_part(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if parts[:2] == ["cluster", "engine"] and len(parts) > 2 else None


def test_engine_rooms_import_downwards():
    assert {p.name for p in (PKG / "engine").iterdir() if p.is_dir() and p.name != "__pycache__"} == set(ROOMS)
    assert {p.stem for p in (PKG / "engine").glob("*.py")} == SHARED | ENTRY | {"__init__"}
    bad = []
    for name, deps in import_graph().items():
        part = _engine_part(name)
        if part is None or part in ENTRY:
            continue
        allowed = SHARED | ({part} | set(ROOMS[:ROOMS.index(part)]) if part in ROOMS else set())
        bad += [f"{name} -> {d}" for d in deps if (p := _engine_part(d)) is not None and p not in allowed]
    assert not bad


def test_no_file_over_400_lines():
    long = [str(p.relative_to(ROOT)) for p in PKG.rglob("*.py")
            if "proto" not in p.parts and len(p.read_text().splitlines()) > 400]
    assert not long


def test_drafters_import_no_engine_state():
    """A drafter is fed its inputs (DraftRequest), so it never needs the engine, its
    scheduler or its sequences: that is what lets one run in another process."""
    banned = {"cluster.engine.engine", "cluster.engine.scheduling.scheduler", "cluster.engine.scheduling.sequence", "cluster.engine.spec.drafting"}
    graph = import_graph()
    bad = [f"{n} -> {d}" for n, deps in graph.items() if n.startswith("cluster.engine.drafters") for d in deps & banned]
    assert not bad


def test_built_drafters_hold_no_engine():
    from cluster.config import parse_config
    from cluster.engine.engine import Engine
    from cluster.serve.build import build_engine

    engine = build_engine(parse_config({"engine": {"max_num_seqs": 2, "max_model_len": 128}}))
    assert {"model", "ngram", "early-exit", "medusa"} <= set(engine.drafters)
    for name, d in engine.drafters.items():
        held = [k for k, v in vars(d).items() if isinstance(v, Engine)]
        assert not held, f"drafter {name} holds the engine in {held}"


def test_every_registered_drafter_is_documented_in_the_proto():
    from cluster.engine.drafters.registry import DRAFTERS

    proto = (ROOT / "protos" / "speccluster" / "v1" / "generation.proto").read_text()
    line = next(x for x in proto.splitlines() if "string drafter" in x)
    assert all(f'"{name}"' in line for name in DRAFTERS)
