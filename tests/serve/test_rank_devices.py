"""Which GPU a rank of a tensor-parallel GPU replica drives when it sees every GPU of the node
(cluster.serve.followers.SHARED_GPUS): the one Ray gave it, by its index among the visible ones."""

from __future__ import annotations

import pytest
import torch

from cluster.engine.distributed.parallel import DEVICE_ENV, rank_device
from cluster.serve.followers import device_index


@pytest.mark.parametrize("assigned, visible, want", [
    ("2", None, "2"),                   # the node sets nothing: Ray's ids are the CUDA indices
    ("2", "", "2"),
    ("5", "4,5,6,7", "1"),              # a pod shown GPUs 4-7
    ("GPU-bb", "GPU-aa,GPU-bb", "1"),   # ids as UUIDs
])
def test_rays_gpu_is_found_among_the_visible_ones(assigned, visible, want):
    assert device_index(assigned, visible) == want


def test_a_gpu_not_visible_is_an_error():
    with pytest.raises(RuntimeError, match="not among CUDA_VISIBLE_DEVICES"):
        device_index("3", "0,1")


def test_a_named_device_wins_over_the_rank(monkeypatch):
    monkeypatch.setenv(DEVICE_ENV, "2")
    assert rank_device("cuda", 3) == torch.device("cuda:2")  # not cuda:3: Ray placed rank 3 on GPU 2
    assert rank_device("cpu", 3) == torch.device("cpu")
