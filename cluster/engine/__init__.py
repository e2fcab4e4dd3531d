"""The inference engine: no Ray, nothing above it. `engine.Engine` runs one step at a time.

Rooms:
  scheduling/   sequences, the scheduler, KV blocks (pool, cache, hashing)
  worker/       the model and the passes over it: runner, CUDA graphs, launch-ahead and mixed
                steps, tree layouts, attention backends and kernels, loading, weight shards,
                the KV pool's size
  distributed/  tensor parallelism: the process group, rank 0 and its followers
  spec/         speculation inside a step: drafting plans, acceptance, aux hidden states
  drafters/     the drafters themselves, one module each, and their registry
At the top: the engine loop (engine.py, generate.py), the request check (requests.py), its
config, sampling, logprobs, stop strings, and the observation each step reports.
Rooms import downwards in the order scheduling, worker, drafters, spec, distributed
(tests/test_layering.py).
"""
