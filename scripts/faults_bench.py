"""Faults under load on local Ray, through the real gRPC path (issue 27's two speed figures).

    python scripts/faults_bench.py                       # writes benchmarks/faults/faults.json + .png
    python scripts/faults_bench.py --parts outage --seconds 20

outage: one verifier, one drafter replica (disaggregated), 16 closed-loop client streams.
Tokens/s with speculation off, then with the draft model at gamma 4, then with gamma 4 through
two drafter outages, then plain again; each outage is set against plain decoding's tokens/s
(the mean of the two plain phases, as the host's load drifts):
- `stop`: the drafter process is frozen (SIGSTOP) for --seconds, a hung drafter: no socket
  closes, draft calls just go unanswered; then it is thawed and answers again;
- `kill`: the drafter replica is killed; the outage lasts until the verifier drafts again
  (Serve's replacement answers a probe). On one host the replacement's start (a process, torch,
  the draft model) takes CPU from the verifier too.

stats: a burst of 300 concurrent requests while one client calls GetStats back to back;
the latency of each GetStats call during the burst (p50, p99, max).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)

from tqdm.auto import tqdm  # noqa: E402

APP = "faults-bench"
ENGINE = {"max_num_seqs": 32, "max_model_len": 512, "max_waiting": 512}  # the burst queues, not refused


class Load:
    """`streams` client threads, each sending one request after another, every emitted token
    time-stamped; `spec` is read at each request, so a phase change takes effect at once."""

    def __init__(self, client, prompts: list[str], streams: int, max_tokens: int):
        self.client, self.prompts, self.max_tokens = client, prompts, max_tokens
        self.spec, self.stamps, self.errors = "off", [], []
        self.stop, self.lock = threading.Event(), threading.Lock()
        self.threads = [threading.Thread(target=self._run, args=(i,), daemon=True) for i in range(streams)]

    def _run(self, i: int) -> None:
        import grpc

        k = i
        while not self.stop.is_set():
            try:
                for chunk in self.client.generate_stream(self.prompts[k % len(self.prompts)],
                                                         max_tokens=self.max_tokens, speculation=self.spec):
                    now = time.monotonic()
                    with self.lock:
                        self.stamps += [now] * len(chunk.token_ids)
            except grpc.RpcError as e:
                self.errors.append(f"{e.code().name}: {e.details()}")
            k += len(self.threads)

    def rate(self, t0: float, t1: float) -> float:
        with self.lock:
            return sum(t0 <= t < t1 for t in self.stamps) / (t1 - t0)


def outage(client, args, bar) -> dict:
    from ray import serve

    from cluster.bench.workloads import code_prompts
    from cluster.bench.chaos import kill_replica

    verifier = serve.get_deployment_handle("Verifier", APP)
    load = Load(client, code_prompts(32, seed=3), args.streams, args.max_tokens)
    for t in load.threads:
        t.start()
    time.sleep(args.warmup)
    phases, drafted = {}, []

    def sample(until: float) -> None:  # the verifier's draft count, to see when drafting resumes
        while time.monotonic() < until:
            drafted.append((time.monotonic(), verifier.stats.remote().result()["drafted"]))
            time.sleep(0.25)

    for name, spec in (("plain", "off"), ("speculating", args.gamma)):
        load.spec = spec
        time.sleep(args.settle)
        t0 = time.monotonic()
        sample(t0 + args.seconds)
        phases[name] = {"t0": t0, "t1": time.monotonic()}
        bar.update()
    resumed_s = {}
    for fault in args.faults.split(","):
        at = time.monotonic()
        if fault == "stop":
            proc = drafter_process()
            proc.suspend()
            sample(at + args.seconds)
            proc.resume()
        else:
            kill_replica(APP, "Drafter")
        settled = time.monotonic() + args.drain_s  # calls in flight when it failed time out first
        sample(settled)
        base = drafted[-1][1]
        # until the verifier drafts again (a probe reached the thawed or replacement drafter)
        while drafted[-1][1] <= base and time.monotonic() < at + args.seconds + 60:
            sample(time.monotonic() + 0.25)
        resumed = next((t for t, d in drafted if t > settled and d > base), None)
        phases[f"outage_{fault}"] = {"t0": at, "t1": resumed or time.monotonic()}
        resumed_s[fault] = None if resumed is None else resumed - at
        sample(time.monotonic() + args.settle)  # speculating again before the next fault
        bar.update()
    load.spec = "off"  # plain again: the baseline is the mean of before and after (drift)
    time.sleep(args.settle)
    t0 = time.monotonic()
    sample(t0 + args.seconds)
    phases["plain_after"] = {"t0": t0, "t1": time.monotonic()}
    bar.update()
    end = time.monotonic()
    load.stop.set()
    for t in load.threads:
        t.join(args.max_tokens)
    out = {name: {**p, "tokens_per_s": load.rate(p["t0"], p["t1"]), "seconds": p["t1"] - p["t0"]}
           for name, p in phases.items()}
    plain = (out["plain"]["tokens_per_s"] + out["plain_after"]["tokens_per_s"]) / 2
    for fault, r in resumed_s.items():
        out[f"outage_{fault}_over_plain"] = out[f"outage_{fault}"]["tokens_per_s"] / plain
        out[f"speculation_resumed_s_{fault}"] = r
    out["errors"] = load.errors
    t_first = phases["plain"]["t0"]
    out["timeline"] = [(round(t - t_first, 2), load.rate(t, t + 1.0)) for t in
                       (t_first + 0.5 * i for i in range(int((end - t_first - 1) / 0.5)))]
    out["drafted"] = [(round(t - t_first, 2), d) for t, d in drafted]
    return out


def drafter_process():
    """The drafter replica's worker process (Ray titles it ray::ServeReplica:<app>:Drafter)."""
    import ray  # noqa: F401 - puts its bundled psutil on the path
    import psutil

    found = [p for p in psutil.process_iter(["cmdline"]) if any(f"ServeReplica:{APP}:Drafter" in c
                                                                  for c in p.info["cmdline"] or [])]
    if len(found) != 1:
        raise RuntimeError(f"expected one drafter process, found {len(found)}")
    return found[0]


def stats_burst(client, args, bar) -> dict:
    from concurrent.futures import ThreadPoolExecutor

    import grpc

    from cluster.bench.workloads import code_prompts

    prompts, latencies, errors = code_prompts(64, seed=5), [], []
    done = threading.Event()

    def poll():
        while not done.is_set():
            t0 = time.monotonic()
            client.stats()
            latencies.append(time.monotonic() - t0)

    def one(i):
        try:
            client.generate(prompts[i % len(prompts)], max_tokens=args.burst_tokens)
        except grpc.RpcError as e:
            errors.append(f"{e.code().name}: {e.details()}")

    poller = threading.Thread(target=poll, daemon=True)
    t0 = time.monotonic()
    poller.start()
    with ThreadPoolExecutor(args.burst) as pool:
        list(pool.map(one, range(args.burst)))
    done.set()
    poller.join(30)
    bar.update()
    xs = sorted(latencies)
    q = lambda p: xs[min(len(xs) - 1, int(p * len(xs)))]  # noqa: E731
    return {"requests": args.burst, "burst_s": time.monotonic() - t0, "errors": errors, "calls": len(xs),
            "p50_s": q(0.5), "p99_s": q(0.99), "max_s": xs[-1], "mean_s": statistics.mean(xs)}


def plot(result: dict, path: Path) -> None:
    from cluster.bench.report import figure

    plt = figure()
    parts = [p for p in ("outage", "stats") if p in result]
    fig, axes = plt.subplots(1, len(parts), figsize=(6 * len(parts), 4), squeeze=False)
    for ax, part in zip(axes[0], parts):
        r = result[part]
        if part == "outage":
            t, rate = zip(*r["timeline"])
            ax.plot(t, rate, lw=1, color="black", label="tokens/s (1 s window)")
            t_first = r["plain"]["t0"]
            names = [k for k in r if k in ("plain", "speculating", "plain_after")
                     or k.startswith("outage_") and "_over_" not in k]
            colors = {"plain": "tab:blue", "plain_after": "tab:blue", "speculating": "tab:green"}
            for name in names:
                color = colors.get(name, "tab:red" if "stop" in name else "tab:orange")
                ax.axvspan(r[name]["t0"] - t_first, r[name]["t1"] - t_first, color=color, alpha=0.15,
                           label=f"{name}: {r[name]['tokens_per_s']:.0f} tok/s")
            ratios = ", ".join(f"{k[7:-11]} {v:.2f}" for k, v in r.items() if k.endswith("_over_plain"))
            ax.set(xlabel="seconds", ylabel="tokens/s, 16 streams", title=f"drafter outages, of plain: {ratios}")
            ax.legend(fontsize=8)
        else:
            ax.bar(["p50", "p99", "max"], [1e3 * r[k] for k in ("p50_s", "p99_s", "max_s")])
            ax.axhline(1000, color="tab:red", ls="--", label="aim: p99 < 1 s")
            ax.set(ylabel="GetStats latency (ms)", title=f"GetStats during a {r['requests']}-request burst")
            ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/faults")
    ap.add_argument("--parts", default="outage,stats")
    ap.add_argument("--faults", default="stop,kill", help="drafter outages, in order: stop (hung), kill")
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=15.0, help="length of the plain and speculating phases")
    ap.add_argument("--warmup", type=float, default=20.0)
    ap.add_argument("--settle", type=float, default=3.0, help="after a phase change, before measuring")
    ap.add_argument("--drain-s", type=float, default=1.0, help="router.drafter_timeout_s: calls in flight at the kill")
    ap.add_argument("--burst", type=int, default=300)
    ap.add_argument("--burst-tokens", type=int, default=32)
    ap.add_argument("--port", type=int, default=9350)
    args = ap.parse_args()
    import ray

    from cluster.bench.report import write_json
    from cluster.client import Client
    from cluster.config import parse_config
    from cluster.serve.launch import run_app, shutdown, start_serve

    parts = args.parts.split(",")
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)  # never a running one
    start_serve(parse_config({"network": {"grpc_port": args.port, "http_port": args.port + 1}}), "HeadOnly")
    run_app(parse_config({
        "name": APP, "placement": "disaggregated", "engine": ENGINE,
        "router": {"drafter_timeout_s": args.drain_s, "per_client_concurrency": 512, "max_inflight": 512},
        "verifier": {"ray_actor_options": {"num_cpus": 1}}, "drafter": {"ray_actor_options": {"num_cpus": 1}},
        "network": {"grpc_port": args.port, "app_name": APP, "route_prefix": f"/{APP}"}}))
    result = {"streams": args.streams, "max_tokens": args.max_tokens, "gamma": args.gamma, "engine": ENGINE}
    bar = tqdm(total=(3 + len(args.faults.split(","))) * ("outage" in parts) + ("stats" in parts), desc="faults bench")
    try:
        with Client(f"localhost:{args.port}", application=APP, timeout=300) as client:
            if "outage" in parts:
                result["outage"] = outage(client, args, bar)
            if "stats" in parts:
                result["stats"] = stats_burst(client, args, bar)
    finally:
        shutdown()
    path = write_json(args.out, "faults", result)
    plot(result, path.with_suffix(".png"))
    summary = {k: v for k, v in (result.get("outage") or {}).items() if "_over_plain" in k or "resumed" in k}
    summary.update({f"stats_{k}": v for k, v in (result.get("stats") or {}).items() if k in ("p50_s", "p99_s", "max_s")})
    print(summary)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
