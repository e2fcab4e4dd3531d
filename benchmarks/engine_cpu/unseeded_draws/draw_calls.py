"""Host time of one step's draws for B sampled rows, per-row generators (every sampled row
before: a generator a row, `exponential_` and `uniform_` a row) against `fill_draws` for
unseeded rows (one call for them all). Width 16, so what is timed is the calls' host work, not
filling 128k-wide rows: the part a GPU pays as kernel launches. Writes draw_calls.json and
draw_calls.png here.

    PYTHONPATH=. python3 benchmarks/engine_cpu/unseeded_draws/draw_calls.py
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch

from cluster.bench.report import figure, save_figure
from cluster.engine.sampling import SamplingParams, fill_draws

HERE = Path(__file__).parent
WIDTH, REPS = 16, 200


def per_row(out: torch.Tensor, gens: list[torch.Generator]) -> None:
    for b, g in enumerate(gens):  # what acceptance did for every sampled row: two calls a row
        out[b, :4].uniform_(generator=g)
        out[b].exponential_(generator=g)


def batched(out: torch.Tensor, params: list[SamplingParams]) -> None:
    gens = [None] * len(params)
    fill_draws(out[:, :4], params, gens, "uniform")
    fill_draws(out, params, gens, "exponential")


def ms(fn) -> float:
    times = []
    for _ in range(REPS):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return 1e3 * statistics.median(times)


def main() -> int:
    torch.set_num_threads(1)
    rows, res = [16, 64, 128, 256], {"width": WIDTH, "reps": REPS, "rows": {}}
    for b in rows:
        out, params = torch.ones(b, WIDTH), [SamplingParams(temperature=0.7)] * b
        gens = [torch.Generator().manual_seed(i) for i in range(b)]
        res["rows"][b] = {"per_row_generators_ms": ms(lambda: per_row(out, gens)),  # noqa: B023
                          "fill_draws_unseeded_ms": ms(lambda: batched(out, params))}  # noqa: B023
        print(b, {k: round(v, 3) for k, v in res["rows"][b].items()})
    (HERE / "draw_calls.json").write_text(json.dumps(res, indent=1))
    plt = figure()
    fig, ax = plt.subplots(figsize=(6, 3.8))
    for key, label in (("per_row_generators_ms", "a generator a row (before)"), ("fill_draws_unseeded_ms", "unseeded rows at once")):
        ax.plot(rows, [res["rows"][b][key] for b in rows], "o-", label=label)
    ax.set(xlabel="sampled rows", ylabel="host ms a step (uniform + Exp(1) draws)", title="draw calls' host work, CPU")
    save_figure(fig, HERE / "draw_calls.png", ax)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
