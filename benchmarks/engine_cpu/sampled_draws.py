"""What a sampled row's draws cost the host when its generator is a CPU one, as before commit
81bc909: one Exp(1) vector over the vocabulary a row a step (the exponential race of
cluster.engine.spec.acceptance), drawn by the CPU. Now the generator lives on the engine's
device and the draw is a kernel there; that side needs a GPU to time.

    PYTHONPATH=. python3 benchmarks/engine_cpu/sampled_draws.py    # sampled_draws.json
"""

import json
import platform
import statistics
import time
from pathlib import Path

import torch

torch.set_num_threads(1)
out = {"command": "PYTHONPATH=. python3 benchmarks/engine_cpu/sampled_draws.py", "torch": torch.__version__,
       "cpu": platform.processor() or platform.machine(), "threads": 1, "vocab": {}}
for vocab in (4096, 32000, 128256):  # the demo's, Llama-2's, Llama-3's
    g = torch.Generator().manual_seed(0)
    times = []
    for _ in range(50):
        t = time.perf_counter()
        torch.empty(vocab).exponential_(generator=g).clamp_(min=1e-20)
        times.append(time.perf_counter() - t)
    ms = 1e3 * statistics.median(times)
    out["vocab"][vocab] = {"ms_a_row": round(ms, 4), "ms_a_step_64_rows": round(64 * ms, 2),
                           "ms_a_step_256_rows": round(256 * ms, 2)}
    print(vocab, out["vocab"][vocab])
Path(__file__).with_name("sampled_draws.json").write_text(json.dumps(out, indent=1) + "\n")
