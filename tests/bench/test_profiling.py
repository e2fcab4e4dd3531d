"""cluster.bench.profiling: the accounting of a profiled step (busy time as the union of kernel
intervals, and idle gaps grouped by the kernels on either side), and what a drafter's catch-ups ran."""

import torch

from cluster.bench.profiling import _busy, category, gaps, launch_lead, step_profile


def test_busy_time_counts_overlapping_kernels_once():
    assert _busy([(0, 10), (5, 12), (20, 25), (21, 22)]) == 17


def test_gaps_are_grouped_by_neighbours_and_averaged_per_step():
    # two steps, each: a 5 us gap (under the threshold), a 60 us wait before the verify GEMM
    kernels = []
    for t in (0, 1000):
        kernels += [(t, t + 10, "argmax"), (t + 15, t + 20, "copy"), (t + 80, t + 400, "_gemm_rows_kernel"),
                    (t + 100, t + 120, "one_shot_all_reduce")]  # inside the GEMM's span: no gap
    g = gaps(kernels, steps=2, top=4)
    # 60 us in each step before the GEMM, and 600 between the steps (argmax after the GEMM's end)
    assert g["largest"]["copy -> _gemm_rows_kernel"] == {"count": 1.0, "us": 60.0}
    assert g["largest"]["_gemm_rows_kernel -> argmax"] == {"count": 0.5, "us": 300.0}
    assert g["idle_us"] == 360.0


def test_category_first_match_wins():
    assert category("void one_shot_all_reduce_kernel<bf16>") == "all_reduce"
    assert category("_gemm_rows_kernel") == "gemm"
    assert category("something_else") == "other"


def test_a_cpu_step_profile_reports_host_calls_and_no_kernels():
    calls = []
    p = step_profile(lambda: calls.append(torch.ones(4).sum()), steps=3)
    assert len(calls) == 3 + 3 + 3  # warm-up, timed, profiled
    assert p["steps"] == 3 and p["kernel_us"] == 0.0 and p["gaps"]["idle_us"] == 0


def test_launch_lead_tells_whether_the_gpu_starts_before_the_launch_returns():
    kernels = [(40, 500, "layer 0"), (510, 900, "layer 1"), (1300, 1400, "argmax")]
    # a 100 us launch whose first kernel began 40 us in; another whose began 100 us after its end
    assert launch_lead([(0, 100), (1000, 1200)], kernels) == {"count": 2, "call_us": 150.0,
                                                              "first_kernel_after_us": 170.0}
    assert launch_lead([(2000, 2100)], kernels) == {}  # no kernel after it


def test_catch_ups_count_what_the_drafter_ran(demo_pair):
    """After plain steps, the step that turns drafting on first runs the draft model over every
    token its rows missed: CatchUps reads exactly the lag the engine reported before that step
    (the controller's switch price is read against it), and a step's worth of tokens a row after."""
    from cluster.bench.profiling import CatchUps
    from cluster.engine.config import EngineConfig
    from cluster.engine.engine import Engine
    from cluster.engine.sampling import SamplingParams
    from cluster.engine.scheduling.sequence import SpecParams

    class PlainThenDrafts:  # the engine's controller interface: plain steps, then gamma 3
        steps = 0

        def gamma(self, batch_size, cluster_inflight=0):
            self.steps += 1
            return 0 if self.steps <= 8 else 3

        def observe(self, obs):
            pass

    e = Engine.from_pretrained(*demo_pair, "model", EngineConfig(max_num_seqs=4, max_model_len=128, dtype="float32"))
    catch_ups = CatchUps(e.drafters["model"])
    e.controller = PlainThenDrafts()
    for prompt in ("def f(x):\n    return", "import os\nimport sys\n"):
        e.add_request(prompt, SamplingParams(max_tokens=24, ignore_eos=True), SpecParams("auto"))
    steps = []
    while e.has_work:
        lag = e.planner.lag(list(e.scheduler.running))
        e.step()
        steps.append((lag, catch_ups.take()))
    drafting = [(lag, c) for lag, c in steps if c.get("calls")]
    (lag, first), later = drafting[0], drafting[1:]
    assert lag > 2 * 8 and first["tokens"] == lag and first["rows"] == 2 and first["passes"] >= 1 and first["ms"] > 0
    assert later and all(c["tokens"] <= c["rows"] * (3 + 1) and c["passes"] == 1 for _, c in later)
    e.generate(["x = 1"], SamplingParams(max_tokens=8, ignore_eos=True), SpecParams("fixed", 3))
    calls, rows, tokens, passes = catch_ups.row()[:4]  # one row: a pass a call, its prompt first
    assert calls >= 1 and rows == passes == calls and tokens >= len(e.tokenizer.encode("x = 1")) + calls - 1
    catch_ups.close()  # the drafter's own methods again: nothing more is counted
    e.generate(["x = 1"], SamplingParams(max_tokens=8, ignore_eos=True), SpecParams("fixed", 3))
    assert catch_ups.take() == {}
