"""GetStats figures: the same quantities the Prometheus metrics show (cluster/serve/metrics.py,
deploy/grafana/spec-cluster.json), over gRPC without a Prometheus.

Each verifier keeps a `VerifierFigures` (fed from the same hooks as its metrics) and sends
`snapshot()` with its stats to the StatsBoard twice a second; the Router turns the board's
latest snapshot of every replica into the cluster-wide map with `cluster_metrics`.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Callable

RECENT = 256  # latency samples kept per replica: GetStats percentiles cover recent requests
REPORT_S = 0.5      # a verifier pushes its stats this often
FRESH_S = 2.0       # GetStats shows replicas heard from within this: a dead one leaves it in 2 s
KEEP_S = 10.0       # readiness and the replica count wait longer: a loaded host delays reports
DRAFTING_S = 5.0    # a replica "speculates" while its draft count rose within this

log = logging.getLogger(__name__)


class VerifierFigures:
    """Per-position acceptance counts and recent TTFT/ITL samples of one verifier replica.

    Fed from the engine thread (step) and the event loop (finished), read from the stats
    reporter's thread: a lock, since copying a deque that another thread appends to raises.
    """

    def __init__(self):
        self.lock = threading.Lock()
        self.proposed: list[int] = []
        self.accepted: list[int] = []
        self.ttft_ms: deque[float] = deque(maxlen=RECENT)
        self.itl_ms: deque[float] = deque(maxlen=RECENT)

    def step(self, obs) -> None:
        """After each verify pass, with the StepObservation the metrics get."""
        with self.lock:
            n = len(obs.proposed_per_position)
            if n > len(self.proposed):
                self.proposed += [0] * (n - len(self.proposed))
                self.accepted += [0] * (n - len(self.accepted))
            for j, (p, a) in enumerate(zip(obs.proposed_per_position, obs.accepted_per_position)):
                self.proposed[j] += p
                self.accepted[j] += a

    def finished(self, ttft_ms: float, itl_ms: list[float]) -> None:
        with self.lock:
            self.ttft_ms.append(ttft_ms)
            self.itl_ms.extend(itl_ms[-RECENT:])

    def snapshot(self) -> dict:
        with self.lock:
            return {"proposed_per_position": list(self.proposed), "accepted_per_position": list(self.accepted),
                    "recent_ttft_ms": list(self.ttft_ms), "recent_itl_ms": list(self.itl_ms)}


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


def cluster_metrics(replicas: dict[str, dict], inflight: int) -> dict[str, float]:
    """Cluster-wide figures from each verifier replica's latest stats."""
    reps = list(replicas.values())
    total = lambda key: sum(s.get(key, 0) for s in reps)  # noqa: E731
    drafted, accepted = total("drafted"), total("accepted")
    queries, hits = total("prefix_queries"), total("prefix_hits")
    out = {"inflight": inflight, "verifier_replicas": len(reps), "drafted": drafted, "accepted": accepted,
           "acceptance_rate": accepted / drafted if drafted else 0.0,
           "mean_gamma": sum(s.get("gamma", 0) for s in reps) / len(reps) if reps else 0.0,
           "speculating_replicas": sum(1 for s in reps if s.get("drafting", 0)),  # drafted lately
           "running": total("running"), "waiting": total("waiting"), "verify_tokens": total("verify_tokens"),
           "prefix_hit_rate": hits / queries if queries else 0.0,
           # the replicas' paged KV pools, in blocks (each replica's own block_size), and the
           # counts since each replica started; a replacement replica starts its counts at 0
           "kv_blocks_total": total("kv_blocks_total"), "kv_blocks_used": total("kv_blocks_used"),
           "kv_blocks_cached": total("kv_blocks_cached"), "preemptions": total("preemptions"),
           "prefix_hit_tokens": total("prefix_hit_tokens"),
           # engine steps since each replica started: prefill-only ones, seconds inside steps,
           # and the engine core's own work between them (cluster.serve.core)
           "steps": total("steps"), "prefill_steps": total("prefill_steps"), "step_busy_s": total("step_busy_s"),
           "core_host_s": total("core_host_s"), "step_messages": total("step_messages"),
           "step_lag_s": total("step_lag_s")}  # summed over messages: from the core's send to the fan-out
    blocks = out["kv_blocks_total"]
    out["kv_blocks_used_fraction"] = out["kv_blocks_used"] / blocks if blocks else 0.0
    width = max((len(s.get("proposed_per_position", [])) for s in reps), default=0)
    for j in range(width):
        p = sum(s["proposed_per_position"][j] for s in reps if j < len(s.get("proposed_per_position", [])))
        a = sum(s["accepted_per_position"][j] for s in reps if j < len(s.get("accepted_per_position", [])))
        out[f"acceptance_position_{j}"] = a / p if p else 0.0
    for name in ("ttft_ms", "itl_ms"):
        xs = [x for s in reps for x in s.get(f"recent_{name}", [])]
        for q in (50, 95, 99):
            out[f"{name}_p{q}"] = _percentile(xs, q / 100)
    up = [s["kvdir_available"] for s in reps if "kvdir_available" in s]
    if up:  # absent when no replica publishes to a directory
        out["kvdir_available"] = float(min(up))
    return out


class BoardView:
    """A router's copy of the StatsBoard, refreshed every REPORT_S by one call that also
    pushes the router's in-flight count. GetStats and health checks read the copy: under a
    burst they never wait on the board, nor the board on one push per request."""

    def __init__(self, board, router_id: str, inflight: Callable[[], int]):
        self.board, self.router_id, self.inflight = board, router_id, inflight
        self.replicas: dict[str, tuple[float, dict]] = {}  # id -> (when last reported, local clock)
        self.total_inflight = 0
        self.task: asyncio.Task | None = None
        self.first = asyncio.Event()

    async def _refresh(self) -> None:
        while True:
            try:
                view = await self.board.exchange.remote(self.router_id, self.inflight())
                now = time.monotonic()
                self.replicas = {k: (now - age, s) for k, (age, s) in view["replicas"].items()}
                self.total_inflight = view["inflight"]
                self.first.set()
            except Exception as e:  # noqa: BLE001 - the board is advice; keep the last copy
                log.debug("stats board exchange failed: %s", e)
            await asyncio.sleep(REPORT_S)

    async def snapshot(self, max_age_s: float = FRESH_S) -> dict:
        """{"replicas": {id: stats}, "inflight": n}: replicas heard from within max_age_s."""
        if self.task is None:  # started on first use: Serve builds the router outside its loop
            self.task = asyncio.get_running_loop().create_task(self._refresh())
        if not self.first.is_set():
            try:
                await asyncio.wait_for(self.first.wait(), timeout=5.0)
            except asyncio.TimeoutError:
                pass
        now = time.monotonic()
        return {"replicas": {k: s for k, (t, s) in self.replicas.items() if now - t <= max_age_s},
                "inflight": self.total_inflight}
