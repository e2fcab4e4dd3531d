"""The tensor-parallel process group of one verifier: who a rank is, and its collectives.

Two groups over the same ranks. `device` carries activations (NCCL on CUDA, gloo on CPU;
small all-reduces on CUDA through `OneShot`, below) with a step-sized timeout: a rank that
dies or stalls mid-step surfaces as an error on the others, never as a hang. `host` (always gloo) carries rank 0's per-step headers: followers
wait on it between steps for as long as the engine idles, so its timeout is long; a dead
rank 0 still ends their wait at once (its sockets close).
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)
IDLE_TIMEOUT_S = 7 * 24 * 3600  # a follower may wait this long for rank 0's next step


class RankFailure(RuntimeError):
    """A collective failed: another rank died or stalled. The replica cannot continue."""


class OneShot:
    """All-reduces of up to `max_bytes` as one kernel over symmetric memory: each rank copies
    its part into a buffer every peer can read over NVLink, and one launch reads and sums them
    (torch.ops.symm_mem.one_shot_all_reduce_out). At a decode step's sizes (16 KB a row of an
    8192-wide model) NCCL's ring costs its latency 160 times a step (a 70B shape's 80 layers).
    One buffer serves every call: the kernel's barriers order one call's reads before the next
    call's writes, in a CUDA graph as eagerly. Every rank adds the parts in rank order, so all
    ranks get the same sums, and a decode and a verify pass of a few rows reduce alike."""

    def __init__(self, group, max_bytes: int, dtype: torch.dtype, device: torch.device):
        import torch.distributed._symmetric_memory as symm_mem

        self.name, self.dtype = group.group_name, dtype
        self.numel = max_bytes // torch.empty((), dtype=dtype).element_size()
        if hasattr(symm_mem, "enable_symm_mem_for_group"):  # required before torch 2.8, a no-op since
            symm_mem.enable_symm_mem_for_group(self.name)
        self.buffer = symm_mem.empty(self.numel, dtype=dtype, device=device)
        symm_mem.rendezvous(self.buffer, self.name)

    def fits(self, x: torch.Tensor) -> bool:
        return x.dtype == self.dtype and x.numel() <= self.numel and x.is_contiguous()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x summed over ranks, in place."""
        part = self.buffer[: x.numel()]
        part.copy_(x.view(-1))
        torch.ops.symm_mem.one_shot_all_reduce_out(part, "sum", self.name, x.view(-1))
        return x


@dataclass
class Group:
    rank: int
    size: int
    device: torch.device
    step_group: object = None   # activations (NCCL / gloo), step timeout
    host_group: object = None   # headers (gloo), idle timeout
    one_shot: OneShot | None = None  # small all-reduces on CUDA (tp_one_shot_kb)

    @property
    def first(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of x over ranks, in place (the row-parallel projections' partial sums)."""
        if self.one_shot is not None and self.one_shot.fits(x):
            return self.one_shot(x)
        dist.all_reduce(x, group=self.step_group)
        return x

    def enable_one_shot(self, max_kb: int, dtype: torch.dtype) -> None:
        """Small all-reduces through OneShot, decided on every rank at once (collectives):
        only if it gives NCCL's sums eagerly and from a captured CUDA graph. Otherwise (no
        symmetric memory here, a failed capture, a wrong sum) NCCL stays, with a warning. Each
        phase starts only once every rank finished the last: a one-shot kernel waits for all
        its peers, so a rank that dropped out would hang the others' GPUs."""
        if not max_kb or self.device.type != "cuda" or self.size == 1:
            return
        # Symmetric memory maps each peer's buffer over NVLink, so every peer's GPU must be
        # visible here. Ray's per-actor CUDA_VISIBLE_DEVICES shows a rank its own GPU alone, as
        # cuda:0 on every rank, and the rendezvous then fails on overlapping devices
        # (vllm-project/vllm#45729): NCCL serves every size there.
        if not self._agree(lambda: torch.cuda.device_count() >= self.size):
            log.warning("rank %d: one-shot all-reduce needs the group's %d GPUs visible, %d are: NCCL for all sizes",
                        self.rank, self.size, torch.cuda.device_count())
            return
        one = None
        # small integers: every sum is exact in bf16, whatever order a kernel adds in
        gen = torch.Generator(device=self.device).manual_seed(self.rank)
        x = torch.randint(-8, 9, (4096,), generator=gen, device=self.device).to(dtype)
        want = x.clone()
        dist.all_reduce(want, group=self.step_group)

        def made():
            nonlocal one
            one = OneShot(self.step_group, max_kb * 1024, dtype, self.device)
            return True

        graph, y = torch.cuda.CUDAGraph(), x.clone()

        def captured():
            with torch.cuda.graph(graph):
                one(y)
            return True

        def replayed():
            y.copy_(x)
            graph.replay()
            return torch.equal(y, want)

        for phase in (made, lambda: torch.equal(one(x.clone()), want), captured, replayed):
            if not self._agree(phase):
                log.warning("one-shot all-reduce unavailable: NCCL for all sizes")
                return
        self.one_shot = one
        log.info("rank %d: all-reduces up to %d KB one-shot over symmetric memory", self.rank, max_kb)

    def _agree(self, phase) -> bool:
        """Whether `phase()` returned True on every rank (an exception counts as False)."""
        try:
            ok = bool(phase())
        except Exception as e:  # noqa: BLE001 - NCCL serves every size; this only speeds small ones
            log.warning("rank %d: one-shot all-reduce check failed (%s: %s)", self.rank, type(e).__name__, e)
            ok = False
        agreed = torch.tensor([int(ok)], device=self.device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=self.step_group)
        return bool(agreed.item())

    def all_max(self, x: torch.Tensor) -> torch.Tensor:
        """Elementwise maximum of x over ranks, in place (each rank's amax of its own heads
        becomes the amax over all heads: cluster.engine.worker.fp8)."""
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=self.step_group)
        return x

    def gather_vocab(self, x: torch.Tensor, vocab_size: int) -> torch.Tensor | None:
        """Each rank's vocabulary slice [..., V/N] of the logits, joined on rank 0 as [..., V];
        None elsewhere (only rank 0 samples). An all-gather, not a gather: one collective
        (NCCL's gather is a group of sends and receives) that CUDA graphs capture as every
        rank's passes do (cluster.engine.distributed.ranks)."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x, group=self.step_group)
        return torch.cat(parts, dim=-1)[..., :vocab_size] if self.first else None

    def broadcast_tokens(self, x: torch.Tensor | int | tuple) -> torch.Tensor:
        """Rank 0's int64 tokens on its device to every rank's device (a follower passes their
        shape): a launched-ahead step's input or a verify pass's drafts, in stream order after
        rank 0 made them."""
        x = x.contiguous() if isinstance(x, torch.Tensor) else torch.empty(x, dtype=torch.int64, device=self.device)
        dist.broadcast(x, src=0, group=self.step_group)
        return x

    def broadcast_header(self, x: torch.Tensor) -> torch.Tensor:
        """A host int64 tensor from rank 0 to every rank (sizes agreed beforehand)."""
        dist.broadcast(x, src=0, group=self.host_group)
        return x

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def free_port() -> int:
    """A port free on every interface: rank 0's rendezvous listens on all of them."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


# Set by a launcher that shows a rank every GPU and names the one it drives (cluster.serve.followers)
DEVICE_ENV = "SPEC_CLUSTER_CUDA_DEVICE"


def rank_device(device: str, rank: int) -> torch.device:
    """A rank's device: the index DEVICE_ENV names where it is set; else cuda:<rank> where the
    process sees the node's GPUs (spawned ranks), cuda:0 where it sees only its own; cpu as it is."""
    if device != "cuda":
        return torch.device(device)
    if os.environ.get(DEVICE_ENV):
        return torch.device(f"cuda:{int(os.environ[DEVICE_ENV])}")
    return torch.device(f"cuda:{rank % torch.cuda.device_count()}")


def init_group(rank: int, size: int, addr: str, port: int, device: str, step_timeout_s: float,
               one_shot_kb: int = 0, dtype: torch.dtype = torch.bfloat16) -> Group:
    """Join the group (blocks until all `size` ranks have joined); on CUDA with `one_shot_kb`,
    small all-reduces of `dtype` go one-shot (Group.enable_one_shot)."""
    dev = rank_device(device, rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    step = datetime.timedelta(seconds=step_timeout_s)
    dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", rank=rank, world_size=size, timeout=step)
    host = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=IDLE_TIMEOUT_S))
    log.info("rank %d of %d joined (%s, %s)", rank, size, backend, dev)
    group = Group(rank, size, dev, dist.group.WORLD, host)
    group.enable_one_shot(one_shot_kb, dtype)
    return group
