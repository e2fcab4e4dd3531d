"""The inference engine: no Ray, nothing above it. `engine.Engine` runs one step at a time.

Rooms:
  scheduling/   requests, sequences, the scheduler, KV blocks (pool, cache, hashing, sizing)
  worker/       the model and the passes over it: runner, CUDA graphs, launch-ahead and mixed
                steps, attention backends and kernels, loading
  distributed/  tensor parallelism: the process group, rank 0 and its followers, weight shards
  spec/         speculation inside a step: drafting plans, acceptance, trees, aux hidden states
  drafters/     the drafters themselves, one module each, and their registry
At the top: the engine loop (engine.py, generate.py), its config, sampling, logprobs, stop
strings, and the observation each step reports.
"""
