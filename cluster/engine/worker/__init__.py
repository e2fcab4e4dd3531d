"""The worker: the model (model, loader, embedded, sharding) and the passes over it: one padded
pass (runner), CUDA graphs (graphs, capture), launch-ahead (pipeline) and mixed (mixed) steps,
tree layouts (tree), attention backends (attention, paged_attention), kernels (gemv, fp8) and
the KV pool's size from free memory (memory)."""
