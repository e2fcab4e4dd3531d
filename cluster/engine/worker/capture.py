"""Capture and replay of a step: CUDA graphs on a GPU, or an eager stand-in for CPU tests.

The graph classes (cluster.engine.worker.graphs, cluster.engine.drafters.eagle3_graphs) and the
launch-ahead pipeline reach the CUDA-only calls through this interface alone: pinned host
buffers, copy events, a memory pool, and `capture(body) -> (graph, outputs)`. `Eager`
implements it on any device: capture runs `body` once, and each replay runs it again and
copies what it returns into the tensors capture returned. So the real graph classes, with
their buffers, shapes and bookkeeping, run under the CPU suite; only the hardware call is
replaced. A body must read its inputs from tensors only (as a captured graph does): Python
state read in it is frozen at capture on a GPU but read afresh by the stand-in.

`for_device` picks one: CUDA graphs on CUDA where the attention backend can be captured;
on CPU none, unless a test turned the stand-in on (`eager_on_cpu`). SDPA runs under it: graph
contexts give every row the cache's full width, which SDPA masks by position.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import contextmanager

import torch


class CudaGraphs:
    @staticmethod
    def host(n: int) -> torch.Tensor:
        """[n] int64 host buffer the device copies from without a sync (pinned)."""
        return torch.zeros((n,), dtype=torch.int64, pin_memory=True)

    @staticmethod
    def event():
        return torch.cuda.Event()

    @staticmethod
    def timer():
        """An event that times the stream's work: elapsed_time(later) in ms, once both are done."""
        return torch.cuda.Event(enable_timing=True)

    @staticmethod
    def pool():
        return torch.cuda.graph_pool_handle()

    @staticmethod
    def capture(body: Callable[[], tuple], pool) -> tuple[torch.cuda.CUDAGraph, tuple]:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            body()  # warm-up allocations outside the graph
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool):
            out = body()
        return graph, out


class _Done:
    """An event whose work is always done (eager copies finish before they return)."""

    def record(self) -> None:
        pass

    def synchronize(self) -> None:
        pass


class _Clock(_Done):
    """The stand-in's timer: eager work is done when its call returns, so the host clock times it."""

    def record(self) -> None:
        self.t = time.perf_counter()

    def elapsed_time(self, later: "_Clock") -> float:
        return 1e3 * (later.t - self.t)


class _EagerGraph:
    def __init__(self, body: Callable[[], tuple], out: tuple):
        self.body, self.out = body, out
        self.replays = self.resets = 0

    def reset(self) -> None:
        """As CUDAGraph.reset: nothing to free here, counted for the tests."""
        self.resets += 1

    def replay(self) -> None:
        self.replays += 1
        for kept, new in zip(self.out, self.body()):
            if kept is not None and new is not kept:
                kept.copy_(new)


class Eager:
    """The stand-in: same interface, bodies run eagerly at every replay."""

    @staticmethod
    def host(n: int) -> torch.Tensor:
        return torch.zeros((n,), dtype=torch.int64)

    @staticmethod
    def event() -> _Done:
        return _Done()

    @staticmethod
    def timer() -> _Clock:
        return _Clock()

    @staticmethod
    def pool() -> None:
        return None

    @staticmethod
    def capture(body: Callable[[], tuple], pool) -> tuple[_EagerGraph, tuple]:
        out = body()
        return _EagerGraph(body, out), out


_eager_on_cpu = False


@contextmanager
def eager_on_cpu():
    """Tests: CPU runners and drafters built inside get the eager stand-in for CUDA graphs."""
    global _eager_on_cpu
    _eager_on_cpu = True
    try:
        yield
    finally:
        _eager_on_cpu = False


def for_device(device: torch.device, backend) -> CudaGraphs | Eager | None:
    """How steps on `device` with this attention backend are captured; None: eager passes."""
    if device.type == "cuda":
        return CudaGraphs() if backend.graphs else None
    return Eager() if _eager_on_cpu else None
