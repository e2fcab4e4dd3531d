"""Tensor parallelism: the process group (parallel), and rank 0 with its followers (ranks)."""
