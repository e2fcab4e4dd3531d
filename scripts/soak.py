"""Soak: a bounded mixed load on local Ray with faults injected, then a leak check.

    python scripts/soak.py                 # 10 minutes
    python scripts/soak.py --minutes 2 --out /tmp/soak.json

A few client threads send, in a seeded mix: greedy unary requests on fixed prompts (their
tokens must equal the in-process engine's with speculation off), sampled streams, streams
the client cancels after a few chunks, and unary requests with a deadline too short to
finish. Two verifier replicas: at a quarter one is killed (its requests fail over to the
other, so their tokens must still be right); midway the drafter replica is killed; at three
quarters the KV directory server is killed and restarted. Intended outcomes (a cancelled stream, an expired deadline) are not
errors; every other failure and every wrong greedy answer is.

Reports: unintended errors (must be 0); RSS of the app's Ray worker processes (Serve
replicas, proxy, controller) from minute 1 to the end (growth must be < 10%); that all KV
slots, sequences and draft state are free at the end. Writes benchmarks/soak/soak.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import threading
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)

import grpc  # noqa: E402
import ray  # noqa: E402,F401 - puts its bundled psutil (ray/thirdparty_files) on the path
import psutil  # noqa: E402

APP = "soak"
FIXED = ["import os\nimport sys\n\ndef main(", "class Config:\n    def __init__(self", "for i in range(",
         "def parse_args(argv):", "with open(path) as f:", "    return self._"]
WORDS = "value items result config parser buffer index node token stream handler".split()
ENGINE = {"max_num_seqs": 8, "max_model_len": 512}
GREEDY_TOKENS = 32


def reference() -> list[list[int]]:
    from cluster.config import parse_config
    from cluster.engine.sampling import SamplingParams
    from cluster.engine.scheduling.sequence import SpecParams
    from cluster.serve.build import build_engine

    engine = build_engine(parse_config({"engine": ENGINE}))
    return [r["token_ids"] for r in engine.generate(FIXED, SamplingParams(max_tokens=GREEDY_TOKENS), SpecParams("off"))]


def rss_by_role() -> dict[str, int]:
    """RSS of this app's replicas, the proxies and the controller, summed per role."""
    out: Counter[str] = Counter()
    for p in psutil.process_iter(["cmdline", "memory_info"]):
        title = (p.info["cmdline"] or [""])[0]  # "ray::<actor>[.<method running now>]"
        if title.startswith(f"ray::ServeReplica:{APP}:"):
            out[title.rsplit(":", 1)[1].split(".")[0]] += p.info["memory_info"].rss
        elif title.startswith(("ray::ProxyActor", "ray::ServeController")):
            out[title[5:].split(".")[0]] += p.info["memory_info"].rss
    return dict(out)


class Load:
    def __init__(self, address: str, refs: list[list[int]], seed: int):
        from cluster.client import Client

        self.client = Client(address, application=APP, timeout=120)
        self.hasty = Client(address, application=APP, timeout=0.3)  # deadlines meant to expire
        self.refs, self.seed = refs, seed
        self.stop = threading.Event()
        self.counts: Counter[str] = Counter()
        self.errors: list[dict] = []
        self.drafted_at: list[tuple[float, int]] = []  # (time, drafted) of greedy unary replies
        self.lock = threading.Lock()

    def worker(self, i: int) -> None:
        rng = random.Random(self.seed * 1000 + i)
        while not self.stop.is_set():
            kind = rng.choices(["greedy", "stream", "cancel", "deadline"], [4, 3, 2, 1])[0]
            try:
                self._one(kind, rng)
                outcome = kind
            except grpc.RpcError as e:
                intended = (kind == "deadline" and e.code() == grpc.StatusCode.DEADLINE_EXCEEDED)
                outcome = f"{kind}:{e.code().name}"
                if not intended:
                    self._error(kind, f"{e.code().name}: {e.details()}")
            except AssertionError as e:
                outcome = f"{kind}:wrong"
                self._error(kind, str(e))
            with self.lock:
                self.counts[outcome] += 1

    def _one(self, kind: str, rng: random.Random) -> None:
        c = self.client
        if kind == "greedy":
            k = rng.randrange(len(FIXED))
            r = c.generate(FIXED[k], max_tokens=GREEDY_TOKENS, speculation=rng.choice(["auto", 4, "off"]))
            assert list(r.token_ids) == self.refs[k], f"greedy output differs for prompt {k}"
            with self.lock:
                self.drafted_at.append((time.monotonic(), r.spec.drafted))
            return
        prompt = rng.choice(FIXED) + " ".join(rng.choices(WORDS, k=rng.randrange(1, 40)))
        if kind == "deadline":
            self.hasty.generate(prompt, max_tokens=400, temperature=1.0)
            return
        stream = c.generate_stream(prompt, max_tokens=rng.randrange(16, 128), temperature=0.8,
                                   seed=rng.randrange(2**31), speculation=rng.choice(["auto", 3]))
        for n, _ in enumerate(stream):
            if kind == "cancel" and n >= rng.randrange(1, 6):
                stream.close()  # the client cancels the call
                break

    def _error(self, kind: str, what: str) -> None:
        with self.lock:
            if len(self.errors) < 50:
                self.errors.append({"t": round(time.monotonic(), 1), "kind": kind, "error": what[:300]})


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--clients", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "soak" / "soak.json"))
    a = ap.parse_args()

    from ray import serve

    from cluster.config import parse_config
    from cluster.kvdir.embedded import free_port, start_local_server
    from cluster.bench import chaos
    from cluster.serve.launch import run_app, start_serve

    refs = reference()
    kv_port, grpc_port = free_port(), free_port()
    kv_url, kv_stop = start_local_server(port=kv_port)
    ray.init(num_cpus=5, namespace="spec-cluster-soak", log_to_driver=False, include_dashboard=False)
    cfg = parse_config({
        "name": APP, "placement": "disaggregated", "engine": ENGINE,
        "router": {"drafter_state_ttl_s": 20.0},
        "verifier": {"num_replicas": 2, "ray_actor_options": {"num_cpus": 1}},
        "drafter": {"ray_actor_options": {"num_cpus": 1}},
        "kvdir": {"url": kv_url, "ttl_s": 5.0},
        "network": {"grpc_port": grpc_port, "http_port": free_port(), "app_name": APP, "route_prefix": f"/{APP}"},
    })
    report: dict = {"minutes": a.minutes, "clients": a.clients, "seed": a.seed, "config": cfg.model_dump(),
                    "events": [], "rss": []}
    t0 = time.monotonic()
    event = lambda what: report["events"].append({"t": round(time.monotonic() - t0, 1), "event": what})  # noqa: E731
    try:
        start_serve(cfg, proxy_location="HeadOnly")
        run_app(cfg)
        load = Load(f"localhost:{grpc_port}", refs, a.seed)
        t0 = time.monotonic()
        threads = [threading.Thread(target=load.worker, args=(i,), daemon=True) for i in range(a.clients)]
        for t in threads:
            t.start()
        end, faults = t0 + 60 * a.minutes, {"verifier": 0.25, "drafter": 0.5, "kvdir": 0.75}
        while time.monotonic() < end:
            now = time.monotonic() - t0
            report["rss"].append({"t": round(now, 1), **rss_by_role()})
            if "verifier" in faults and now >= faults["verifier"] * 60 * a.minutes:
                del faults["verifier"]
                event(f"killed verifier replica {chaos.kill_replica(APP, 'Verifier')}")
            if "drafter" in faults and now >= faults["drafter"] * 60 * a.minutes:
                del faults["drafter"]
                event(f"killed drafter replica {chaos.kill_replica(APP, 'Drafter')}")
            if "kvdir" in faults and now >= faults["kvdir"] * 60 * a.minutes:
                del faults["kvdir"]
                kv_stop(hard=True)
                event("killed the KV directory server")
                time.sleep(5)
                _, kv_stop = start_local_server(port=kv_port)
                event("restarted the KV directory server")
            time.sleep(min(10.0, max(0.0, end - time.monotonic())))
        load.stop.set()
        for t in threads:
            t.join(120)
        event("load stopped")
        def all_idle():  # both verifier replicas (GetStats), and the drafter
            reps = load.client.stats().replicas
            free = len(reps) == 2 and all(r.running == r.waiting == r.kv_slots_used == 0 for r in reps)
            return free and chaos.drafter_sequences(APP) == 0 and {
                "kv_slots_used": 0, "running": 0, "waiting": 0, **{k: sum(getattr(r, k) for r in reps) for k in
                                                                  ("verify_tokens",)}}
        idle = chaos.wait_until(all_idle, 90, "both verifiers and the drafter idle")
        event("idle")
        report["rss"].append({"t": round(time.monotonic() - t0, 1), **rss_by_role()})
        report.update(_summary(report, load, idle, t0))
    finally:
        serve.shutdown()
        ray.shutdown()
        kv_stop()
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(report, indent=1, default=str) + "\n")
    s = report.get("summary", {})
    print(json.dumps(s, indent=1))
    return 0 if s.get("pass") else 1


def _summary(report: dict, load: Load, idle: dict, t0: float) -> dict:
    total = lambda row: sum(v for k, v in row.items() if k != "t")  # noqa: E731
    base = next((r for r in report["rss"] if r["t"] >= 60), report["rss"][0])
    last = report["rss"][-1]
    growth = total(last) / total(base) - 1
    kill_t = next((e["t"] for e in report["events"] if e["event"].startswith("killed drafter")), None)
    resumed = next((round(t - t0 - kill_t, 1) for t, d in load.drafted_at if kill_t is not None
                    and t - t0 > kill_t and d > 0), None)
    requests = sum(load.counts.values())
    free = idle["kv_slots_used"] == 0 and idle["running"] == 0 and idle["waiting"] == 0
    return {"summary": {
        "requests": requests, "outcomes": dict(sorted(load.counts.items())),
        "unintended_errors": len(load.errors) if len(load.errors) < 50 else ">=50",
        "rss_mb_minute1": round(total(base) / 2**20, 1), "rss_mb_end": round(total(last) / 2**20, 1),
        "rss_growth_pct": round(100 * growth, 2),
        "rss_mb_by_role_minute1": {k: round(v / 2**20, 1) for k, v in base.items() if k != "t"},
        "rss_mb_by_role_end": {k: round(v / 2**20, 1) for k, v in last.items() if k != "t"},
        "speculation_resumed_s_after_drafter_kill": resumed,
        "end_state": idle,
        "all_free": free,
        "pass": not load.errors and growth < 0.10 and free and requests > 0},
        "errors": load.errors}


if __name__ == "__main__":
    sys.exit(main())
