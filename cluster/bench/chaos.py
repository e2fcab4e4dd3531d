"""Fault injection and leak checks for a running app: the fault tests, scripts/soak.py and
scripts/faults_bench.py.

Serve names each replica actor `SERVE_REPLICA::<app>#<deployment>#<replica id>` in the
`serve` namespace (ray.serve._private.common.ReplicaID.to_full_id_str), so a replica can be
found and killed with plain Ray calls; the Serve controller then starts a replacement.
"""

from __future__ import annotations

import time

import ray
from ray import serve

PREFIX, NAMESPACE = "SERVE_REPLICA::", "serve"


def replica_ids(app: str, deployment: str) -> list[str]:
    head = f"{PREFIX}{app}#{deployment}#"
    return sorted(a["name"][len(head):] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["namespace"] == NAMESPACE and a["name"].startswith(head))


def kill_replica(app: str, deployment: str, replica_id: str | None = None) -> str:
    """Kill one replica's actor (the given one, else the first); returns its id."""
    ids = replica_ids(app, deployment)
    rid = replica_id or (ids[0] if ids else None)
    if rid is None or rid not in ids:
        raise LookupError(f"no replica {replica_id or ''} of {app}/{deployment} (have {ids})")
    ray.kill(ray.get_actor(f"{PREFIX}{app}#{deployment}#{rid}", namespace=NAMESPACE), no_restart=True)
    return rid


def serve_state(app: str) -> dict:
    """Each deployment's status and live replica ids: what a failing fault test prints."""
    try:
        deps = serve.status().applications[app].deployments
        return {name: (d.status, replica_ids(app, name)) for name, d in deps.items()}
    except Exception as e:  # noqa: BLE001 - a diagnostic never hides the assertion it serves
        return {"unknown": repr(e)}


def wait_until(check, timeout_s: float, what: str, period_s: float = 0.2):
    """Poll `check` until it returns something truthy; raise naming `what` on timeout.
    Exceptions count as 'not yet' (a replica may be restarting)."""
    deadline, last = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        try:
            got = check()
            if got:
                return got
            last = got
        except Exception as e:  # noqa: BLE001 - retried until the deadline
            last = e
        time.sleep(period_s)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what} (last: {last!r})")


def verifier_stats(app: str, timeout_s: float = 10.0) -> dict:
    return serve.get_deployment_handle("Verifier", app).stats.remote().result(timeout_s=timeout_s)


def drafter_sequences(app: str, timeout_s: float = 10.0) -> int:
    return serve.get_deployment_handle("Drafter", app).info.remote().result(timeout_s=timeout_s)["sequences"]


def wait_idle(app: str, timeout_s: float = 30.0, drafter: bool = False) -> dict:
    """No sequence running or waiting and no KV held on the (single) verifier: no slot and
    no block (cached prefix blocks are free, not held); with `drafter`, no draft state
    either (it goes with the verifier's idle flush)."""
    def idle():
        s = verifier_stats(app)
        done = s["kv_slots_used"] == 0 and s["kv_blocks_used"] == 0 and s["running"] == 0 and s["waiting"] == 0
        return s if done and (not drafter or drafter_sequences(app) == 0) else None
    return wait_until(idle, timeout_s, f"{app} to be idle")


def wait_healthy(app: str, timeout_s: float = 120.0) -> None:
    wait_until(lambda: serve.status().applications[app].status == "RUNNING" and all(
        d.status == "HEALTHY" for d in serve.status().applications[app].deployments.values()),
        timeout_s, f"{app} healthy")


def run_concurrently(fn, n: int, timeout_s: float) -> tuple[dict, list]:
    """fn(i) for i in 0..n-1 on n threads at once: ({i: result}, [exceptions])."""
    import threading

    results, errors = {}, []

    def run(i):
        try:
            results[i] = fn(i)
        except Exception as e:  # noqa: BLE001 - handed back to be asserted
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout_s)
    return results, errors


def plain_tokens(prompts: list[str], max_tokens: int, engine: dict) -> list[list[int]]:
    """What the in-process engine (the demo pair, speculation off) emits for each prompt:
    the tokens a fault must not change."""
    from cluster.config import parse_config
    from cluster.engine.sampling import SamplingParams
    from cluster.engine.scheduling.sequence import SpecParams
    from cluster.serve.build import build_engine

    out = build_engine(parse_config({"engine": engine})).generate(prompts, SamplingParams(max_tokens=max_tokens),
                                                                 SpecParams("off"))
    return [r["token_ids"] for r in out]
