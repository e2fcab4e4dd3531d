"""The worker: the model (model, loader, embedded) and the passes over it: one padded pass
(runner), CUDA graphs (graphs, capture), launch-ahead (pipeline) and mixed (mixed) steps,
attention backends (attention, paged_attention) and kernels (gemv, fp8)."""
