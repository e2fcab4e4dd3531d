"""Where one pass's wall time goes: its kernels under torch.profiler, grouped by what they do,
against the GPU's busy time and the host calls around them (GPU machine).

    from cluster.bench.profiling import step_profile
    step_profile(lambda: runner.forward(...), steps=10)   # per-step figures, in microseconds
"""

from __future__ import annotations

import statistics
import time
from collections import defaultdict

# first match wins: a name may hold several of these words
CATEGORIES = (("all_reduce", ("one_shot", "all_reduce", "allreduce", "two_shot")),
              ("nccl", ("nccl",)),
              ("gemv", ("gemv",)),
              ("gemm", ("gemm", "cutlass", "sm90_", "nvjet", "cublas")),
              ("attention", ("attn", "attention", "paged", "flash")),
              ("copy", ("copy", "memcpy", "memset", "cat")),
              ("fused_elementwise", ("triton_", "fused")),
              ("elementwise", ("elementwise", "vectorized", "reduce")))
HOST_CALLS = ("broadcast", "cudaGraphLaunch", "cudaStreamSynchronize", "cudaEventSynchronize", "cudaMemcpyAsync")


def category(name: str) -> str:
    low = name.lower()
    for cat, words in CATEGORIES:
        if any(w in low for w in words):
            return cat
    return "other"


def _busy(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def gaps(kernels: list[tuple[float, float, str]], steps: int, top: int, min_us: float = 20.0) -> dict:
    """Where the GPU sat idle: every gap of at least `min_us` between one kernel's end (the
    latest so far) and the next kernel's start, grouped by the kernels on either side
    ("previous -> next", names cut to 40 characters), per step; the host work that ran late
    is what came before the next kernel's launch."""
    by, end = defaultdict(lambda: [0, 0.0]), None
    prev = ""
    for s, e, name in kernels:
        if end is not None and s - end >= min_us:
            d = by[f"{prev[:40]} -> {name[:40]}"]
            d[0] += 1
            d[1] += s - end
        if end is None or e > end:
            end, prev = e, name
    ranked = sorted(by.items(), key=lambda kv: -kv[1][1])
    return {"idle_us": sum(us for _, us in by.values()) / steps,
            "largest": {k: {"count": c / steps, "us": us / steps} for k, (c, us) in ranked[:top]}}


def launch_lead(launches: list[tuple[float, float]], kernels: list[tuple[float, float, str]]) -> dict:
    """Whether the GPU starts a graph while its launch call still runs: per cudaGraphLaunch, the
    call's duration and how long after the call began the first kernel at or after that time
    started (medians; kernels sorted by start). A lead under the duration: the GPU began before
    the host finished launching, so splitting a graph would not start it sooner."""
    import bisect

    starts = [k[0] for k in kernels]
    call, lead = [], []
    for s, e in launches:
        i = bisect.bisect_left(starts, s)
        if i < len(starts):
            call.append(e - s)
            lead.append(starts[i] - s)
    if not call:
        return {}
    return {"count": len(call), "call_us": statistics.median(call), "first_kernel_after_us": statistics.median(lead)}


def step_profile(fn, steps: int = 10, top: int = 12) -> dict:
    """`fn` run `steps` times: wall per step, then under the profiler its kernels per step (by
    category, count and microseconds), the GPU's busy time (their union) and the host calls
    that wait or launch. All-reduce kernels wait for every peer, so the first of a step also
    holds how late the slowest rank started it: `first_all_reduce_us` against the median."""
    import torch

    cuda = torch.cuda.is_available()  # on a CPU (the scripts' smoke runs): host calls only
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(3):
        fn()
    sync()
    t = time.perf_counter()
    for _ in range(steps):
        fn()
    sync()
    wall = (time.perf_counter() - t) / steps
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(steps):
            fn()
        sync()
    kernels, host, launches = [], defaultdict(lambda: [0, 0.0]), []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels.append((e.time_range.start, e.time_range.end, e.name))
        else:
            if "cudaGraphLaunch" in e.name:
                launches.append((e.time_range.start, e.time_range.end))
            for word in HOST_CALLS:
                if word.lower() in e.name.lower():
                    host[word][0] += 1
                    host[word][1] += e.time_range.end - e.time_range.start
    kernels.sort()
    cats, names = defaultdict(lambda: [0, 0.0]), defaultdict(lambda: [0, 0.0])
    for s, e, name in kernels:
        for d in (cats[category(name)], names[name[:90]]):
            d[0] += 1
            d[1] += e - s
    per = lambda d: {k: {"count": c / steps, "us": us / steps} for k, (c, us) in  # noqa: E731
                     sorted(d.items(), key=lambda kv: -kv[1][1])}
    out_gaps = gaps(kernels, steps, top)
    out_gaps["graph_launches"] = launch_lead(launches, kernels)
    reduces = [e - s for s, e, name in kernels if category(name) == "all_reduce"]
    out = {"steps": steps, "wall_us": 1e6 * wall,
           "profiled_span_us": (kernels[-1][1] - kernels[0][0]) / steps if kernels else 0.0,
           "kernel_us": sum(e - s for s, e, _ in kernels) / steps,
           "gpu_busy_us": _busy([(s, e) for s, e, _ in kernels]) / steps,
           "kernels_per_step": len(kernels) / steps,
           "by_category": per(cats), "top_kernels": dict(list(per(names).items())[:top]),
           "host_calls": per(host), "gaps": out_gaps}
    if reduces and len(reduces) >= steps:
        k = len(reduces) // steps
        out["all_reduce"] = {"per_step": k, "median_us": statistics.median(reduces),
                             "first_of_step_us": statistics.median(reduces[::k][:steps])}
    return out


class CatchUps:
    """What a ModelDrafter's catch-ups ran (calls, rows, tokens, passes; GPU ms on its stream's
    timers) and the graphs torch.compile compiled meanwhile, read per step by `take()`: a switch
    up from plain decoding pays the catch-up, and a trace of these tells what its price grows with
    (tokens, passes, or a recompile at a new width). An instrument around the drafter's methods
    until `close()`; the drafter is unchanged. A catch-up's time is booked at the first `take()`
    that finds it done: a look-ahead's, queued beside the verify pass, may land a step late."""

    FIELDS = ("calls", "rows", "tokens", "passes", "ms", "compiled")  # `row()`'s order

    def __init__(self, drafter):
        import torch

        self._counts: dict[str, float] = defaultdict(float)
        self._timers: list = []
        self._inside = False
        catch_up, forward = drafter._catch_up, drafter.runner.forward
        cuda = next(drafter.runner.model.parameters()).is_cuda

        def timed_catch_up(kv_rows, lens, feed):
            c = self._counts
            c["calls"] += 1
            c["rows"] += len(feed)
            c["tokens"] += sum(map(len, feed))
            if cuda:  # on the stream it runs on: no sync
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
            t = time.perf_counter()
            self._inside = True
            try:
                return catch_up(kv_rows, lens, feed)
            finally:
                self._inside = False
                if cuda:
                    end.record()
                    self._timers.append((start, end))
                else:
                    c["ms"] += 1e3 * (time.perf_counter() - t)

        def counted_forward(*args, **kw):
            if self._inside:
                self._counts["passes"] += 1
            return forward(*args, **kw)

        self._restore = lambda: (setattr(drafter, "_catch_up", catch_up), setattr(drafter.runner, "forward", forward))
        drafter._catch_up, drafter.runner.forward = timed_catch_up, counted_forward
        self._compiled = _compiled_graphs()

    @classmethod
    def of(cls, engine) -> "CatchUps | _NoCatchUps":
        """For an engine's model drafter; one that records nothing where it has none."""
        from cluster.engine.drafters.model import ModelDrafter

        d = engine.drafters.get("model")
        return cls(d) if isinstance(d, ModelDrafter) else _NoCatchUps()

    def close(self) -> None:
        """The drafter's own methods back (a pending timer is dropped)."""
        self._restore()
        self._timers.clear()

    def take(self) -> dict[str, float]:
        """Since the last take: the counts, the catch-ups' ms (those whose timers are done) and
        the graphs torch.compile compiled."""
        out, self._counts = dict(self._counts), defaultdict(float)
        waiting = []
        for start, end in self._timers:
            if end.query():
                out["ms"] = out.get("ms", 0.0) + start.elapsed_time(end)
            else:
                waiting.append((start, end))
        self._timers = waiting
        compiled = _compiled_graphs()
        out["compiled"], self._compiled = compiled - self._compiled, compiled
        return {k: round(v, 3) for k, v in out.items() if v}

    def row(self) -> list[float]:
        """`take()` as numbers in FIELDS' order (a trace row stays one line in the JSON)."""
        got = self.take()
        return [got.get(k, 0) for k in self.FIELDS]


class _NoCatchUps:
    """CatchUps' surface where there is no model drafter to watch."""

    def take(self) -> dict:
        return {}

    def row(self) -> list:
        return []

    def close(self) -> None:
        pass


def _compiled_graphs() -> int:
    try:
        from torch._dynamo.utils import counters
    except ImportError:  # pragma: no cover - torch without dynamo
        return 0
    return int(counters["stats"]["unique_graphs"])
