"""The tensor-parallel process group of one verifier: who a rank is, and its collectives.

Two groups over the same ranks. `device` carries activations (NCCL on CUDA, gloo on CPU)
with a step-sized timeout: a rank that dies or stalls mid-step surfaces as an error on the
others, never as a hang. `host` (always gloo) carries rank 0's per-step headers: followers
wait on it between steps for as long as the engine idles, so its timeout is long; a dead
rank 0 still ends their wait at once (its sockets close).
"""

from __future__ import annotations

import datetime
import logging
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)
IDLE_TIMEOUT_S = 7 * 24 * 3600  # a follower may wait this long for rank 0's next step


class RankFailure(RuntimeError):
    """A collective failed: another rank died or stalled. The replica cannot continue."""


@dataclass
class Group:
    rank: int
    size: int
    device: torch.device
    step_group: object = None   # activations (NCCL / gloo), step timeout
    host_group: object = None   # headers (gloo), idle timeout

    @property
    def first(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of x over ranks, in place (the row-parallel projections' partial sums)."""
        dist.all_reduce(x, group=self.step_group)
        return x

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


def rank_device(device: str, rank: int) -> torch.device:
    """A rank's device: cuda:<rank> where the process sees the node's GPUs (spawned ranks),
    cuda:0 where it sees only its own (Ray sets CUDA_VISIBLE_DEVICES per actor); cpu as it is."""
    if device != "cuda":
        return torch.device(device)
    return torch.device(f"cuda:{rank % torch.cuda.device_count()}")


def init_group(rank: int, size: int, addr: str, port: int, device: str, step_timeout_s: float) -> Group:
    """Join the group (blocks until all `size` ranks have joined)."""
    dev = rank_device(device, rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    step = datetime.timedelta(seconds=step_timeout_s)
    dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", rank=rank, world_size=size, timeout=step)
    host = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=IDLE_TIMEOUT_S))
    log.info("rank %d of %d joined (%s, %s)", rank, size, backend, dev)
    return Group(rank, size, dev, dist.group.WORLD, host)
