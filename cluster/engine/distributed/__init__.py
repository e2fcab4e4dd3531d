"""Tensor parallelism: the process group (parallel), rank 0 and its followers (ranks), and
which part of each weight a rank holds (sharding)."""
