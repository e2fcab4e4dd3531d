"""The 70B-shaped demo target split over N GPUs of one host (issue 29): the engine as
build_engine starts it under engine.tensor_parallel_size (rank 0 here, ranks 1..N-1 spawned,
NCCL, small all-reduces one-shot (`ONE_SHOT_KB=0`: NCCL only); CUDA graphs on every rank,
`GRAPHS=0` for eager passes), bf16, the draft model demo-8b-draft on rank 0's GPU.

    TP=2 bash scripts/gpu_py.sh gpu_tp.py          # on nvidia-h100-x2; $OUT/gpu_tp.json + .png
    python3 scripts/gpu_tp.py --cpu-smoke --out /tmp/tp   # here: orchestration only, not speed

PARTS (--parts / PARTS, comma-separated, default all):
- batch1: plain decoding of one stream against the aggregate ceiling, copy bandwidth / weight
  bytes per rank (every rank reads its shard each step; norms are replicated, so this is
  rank 0's own parameter bytes);
- verify: one gamma-4 verify pass (5 tokens) over a decode step, at 512 tokens of context;
- spec: the draft model at a few gammas: speedup over plain and the ideal
  E[N] * t_decode / (t_decode + gamma * t_draft) (gpu_bench.py's formula), and the step's time
  against its passes back to back (`passes_over_step`: the gamma + 1 verify pass and gamma
  drafts over the step's wall time; under 1 by the host's share); EAGLE-3 runs under
  tensor parallelism, but no head is embedded at the 70B shape yet, so it is recorded as not run;
- sweep: c requests in flight over max(2c, 8), plain / fixed gamma 4 / goodput controller per
  level (gpu_scale.py's method), with gpu_scale's roofline at per-rank bytes on a GPU;
- profile: rank 0's kernels in a decode step and a gamma-4 verify pass at 512 tokens of context,
  by kind, against the step's wall time, and (with a drafter) whole speculative engine steps of
  one stream at the largest gamma (cluster.bench.profiling; not in the default).
DRAFT=none: no drafter (parts that need none start faster).
Results are rewritten after every part, so a run cut at the device's 10 minutes keeps them.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

from cluster.bench.harness import (copy_bandwidth, cuda_time, decode_rate, drop_ids, dumps, log, matmul_rate, roofline,
                                    spec_point, step_calls)
from cluster.bench.load import run_engine, summarise
from cluster.bench.profiling import CatchUps
from cluster.bench.workloads import code_prompts
from cluster.config import ClusterConfig, resolve_model_path
from cluster.engine.drafters.base import DraftRequest
from cluster.engine.scheduling.sequence import SpecParams
from cluster.policy import SpeculationPolicyConfig, make_controller

# --cpu-smoke: the 70B construction (64 q heads over 8 KV heads of 128 dims, the 128k
# vocabulary) at the demo's 6 layers and a 512-wide residual stream, as tests/engine/test_embedded.py
SMOKE = {"hidden_size": 512, "num_hidden_layers": 6, "intermediate_size": 1024, "head_dim": 128}


def timed(fn, iters: int) -> float:
    """Median seconds per call: CUDA events on a GPU, wall time on a CPU."""
    if torch.cuda.is_available():
        return cuda_time(fn, iters)
    fn()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def bandwidth(cuda: bool) -> float:
    if cuda:
        return copy_bandwidth()
    x = torch.empty(256 * 1024**2, dtype=torch.uint8)
    y = torch.empty_like(x)
    return 2 * x.numel() / timed(lambda: y.copy_(x), 5)


def target_dir(name: str, overrides: dict) -> str:
    """The target's directory; with overrides (fewer layers, narrower), a temporary embed.json
    over the same source and shape, which every rank loads by path."""
    path = Path(resolve_model_path(name))
    if not overrides:
        return str(path)
    spec = json.loads((path / "embed.json").read_text())
    spec["source"] = str((path / spec["source"]).resolve())
    spec["overrides"] = {**spec.get("overrides", {}), **overrides}
    out = Path(tempfile.mkdtemp(prefix="gpu_tp_target_"))
    (out / "embed.json").write_text(json.dumps(spec))
    return str(out)


def draft_time(drafter, ids: list[int], gamma: int, iters: int) -> float:
    """Seconds per drafted token (gpu_bench.draft_time, on either device)."""
    req = [DraftRequest("timing", ids, gamma)]
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    drafter.propose(req)
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        drafter.propose(req)
    sync()
    drafter.release(["timing"])
    return (time.perf_counter() - t0) / iters / gamma


def batch1(engine, a, R: dict) -> None:
    one = a.prompts[:1]
    decode_rate(engine, one, SpecParams("off"), new=a.warm)  # tune kernels, fill allocator
    plain = decode_rate(engine, one, SpecParams("off"), new=a.new)
    R["batch1"] = {**drop_ids(plain), "ceiling_tokens_per_s": R["ceiling_tokens_per_s"],
                   "fraction_of_ceiling": plain["tokens_per_s"] / R["ceiling_tokens_per_s"], "new_tokens": a.new}
    a.plain = plain
    log("batch 1 plain:", R["batch1"])


def context_steps(engine, a, widths=(1, 5)):
    """A row of a.ctx tokens and calls that time one step of each width after it (1: decode, 5: a gamma-4 verify)."""
    ids = engine.tokenizer.encode(a.prompts[1])
    return step_calls(engine, (ids * (a.ctx // max(len(ids), 1) + 1))[: a.ctx], widths)


def verify(engine, a, R: dict) -> None:
    slot, step = context_steps(engine, a)
    t_dec, t_ver = timed(step[1], a.iters), timed(step[5], a.iters)
    engine.kv.close(slot)
    R["verify"] = {"context_tokens": a.ctx, "decode_ms": 1e3 * t_dec, "verify5_ms": 1e3 * t_ver, "ratio": t_ver / t_dec}
    log("verify g4 / decode:", R["verify"])


def profile(engine, a, R: dict) -> None:
    from cluster.bench.profiling import step_profile

    slot, step = context_steps(engine, a)
    R["profile"] = {"context_tokens": a.ctx}
    for w, name in ((1, "decode"), (5, "verify5")):
        R["profile"][name] = p = step_profile(step[w])
        log(f"profile {name}: wall {p['wall_us']:.0f} us, kernels {p['kernel_us']:.0f} us, busy {p['gpu_busy_us']:.0f} us,",
            {k: round(v["us"]) for k, v in p["by_category"].items()}, p.get("all_reduce"))
    engine.kv.close(slot)
    if engine.drafters:  # a whole speculative step of one stream: where the GPU waits on the host
        from cluster.engine.sampling import SamplingParams

        g = max(a.gammas)
        sid = engine.add_request(a.prompts[0], SamplingParams(max_tokens=40 * (g + 1), ignore_eos=True),
                                 SpecParams("fixed", g), "model")
        while not engine.seqs[sid].num_output:  # past the prefill
            engine.step()
        R["profile"][f"spec_step_g{g}"] = p = step_profile(engine.step)
        engine.abort(sid)
        log(f"profile spec step g{g}: wall {p['wall_us']:.0f} us, busy {p['gpu_busy_us']:.0f} us,",
            {k: round(v["us"]) for k, v in p["by_category"].items()}, {k: round(v["us"]) for k, v in p["host_calls"].items()})


def spec(engine, a, R: dict) -> None:
    if "verify" not in R:
        verify(engine, a, R)
    if getattr(a, "plain", None) is None:
        batch1(engine, a, R)
    one, t_dec, plain = a.prompts[:1], R["verify"]["decode_ms"] / 1e3, a.plain
    drafter = engine.drafters["model"]
    out = R["spec"] = {"drafter": a.draft, "by_gamma": {},
                       "eagle3": "not run: no EAGLE-3 head embedded at the 70B shape yet"}
    slot, step = context_steps(engine, a, [g + 1 for g in a.gammas])
    t_verify = {g: timed(step[g + 1], a.iters) for g in a.gammas}  # the verify pass alone, at a.ctx
    engine.kv.close(slot)
    for g in a.gammas:
        decode_rate(engine, one, SpecParams("fixed", g), "model", new=a.warm)
        s = decode_rate(engine, one, SpecParams("fixed", g), "model", new=a.new)
        t_draft = draft_time(drafter, engine.tokenizer.encode(a.prompts[2]), g, a.iters)
        # how close a step came to its passes run back to back: the verify pass and g drafts
        # (the ideal above prices the verify pass as a decode step)
        step_ms = 1e3 * s["mean_accepted_len"] / s["tokens_per_s"]
        held, engine.spec_ahead = engine.spec_ahead, None  # the same steps, each waiting for the host
        w = decode_rate(engine, one, SpecParams("fixed", g), "model", new=a.new) if held is not None else s
        engine.spec_ahead = held
        out["by_gamma"][g] = {**spec_point(engine, one[0], s, plain, t_dec, g * t_draft),
                              "waiting_tokens_per_s": w["tokens_per_s"], "same_tokens_as_waiting": w["token_ids"] == s["token_ids"],
                              "spec_ahead": None if held is None else {"hits": held.hits, "fresh": held.fresh},
                              "draft_ms_per_token": 1e3 * t_draft, "verify_ms": 1e3 * t_verify[g], "step_ms": step_ms,
                              "passes_over_step": 1e3 * (t_verify[g] + g * t_draft) / step_ms}
        log(f"draft model g{g}:", out["by_gamma"][g])
    best = max(out["by_gamma"], key=lambda g: out["by_gamma"][g]["tokens_per_s"])
    out["best_gamma"], out["best"] = best, out["by_gamma"][best]


def sweep(engine, a, R: dict) -> None:
    """gpu_scale.sweep's method without its CUDA-graph accounting (no graphs under TP):
    distinct prompts of a.prompt_len tokens, fresh ones per run so no mode inherits another's
    prefix cache, output lengths drawn once for all modes."""
    tok, levels = engine.tokenizer, a.levels
    need = sum(3 * (max(8, 2 * c) + c) for c in levels)
    distinct: dict[tuple, list[int]] = {}
    for seed in range(11, 40):
        for text in code_prompts(need, chars=6 * a.prompt_len, seed=seed):
            ids = tok.encode(text)
            if len(ids) >= a.prompt_len:
                distinct[tuple(ids[: a.prompt_len])] = ids[: a.prompt_len]
        if len(distinct) >= need:
            break
    prompts = iter(distinct.values())
    take = lambda k: [next(prompts) for _ in range(k)]  # noqa: E731
    rng = random.Random(5)
    lengths = [rng.randint(*a.out_range) for _ in range(max(8, 2 * max(levels)))]
    controller = make_controller(SpeculationPolicyConfig(mode="goodput"))
    catch_ups = CatchUps.of(engine)  # each step's catch-ups (what a switch up pays), in the goodput trace
    out = R["sweep"] = {"prompt_tokens": a.prompt_len, "output_tokens": list(a.out_range), "points": []}
    for c in levels:
        n = max(8, 2 * c)
        point: dict = {"concurrency": c, "requests": n}
        if "matmul_flops" in R:
            point["roofline_tokens_per_s"] = roofline([a.prompt_len] * n, lengths[:n], c, R)
        for name, sp in (("off", SpecParams("off")), ("fixed4", SpecParams("fixed", 4)), ("goodput", SpecParams("auto"))):
            engine.controller = controller if name == "goodput" else None
            run_engine(engine, take(c), c, lengths[:c], sp)  # warm-up (and the controller's measurements)
            # per step: batch, gamma, drafted, accepted, step ms, draft ms, tok/s by gamma weighed, CatchUps.FIELDS
            trace: list = []
            catch_ups.take()  # not the warm-up's
            engine.on_verify = lambda o: trace.append(  # noqa: B023 - read before the next mode
                (o.batch_size, o.gamma, o.drafted, sum(o.accepted_per_position), round(1e3 * o.step_s, 2),
                 round(1e3 * o.draft_s, 2), [round(x) for x in controller.goodputs_seen],
                 catch_ups.row()))
            point[name] = summarise(*run_engine(engine, take(n), c, lengths[:n], sp))
            engine.on_verify = None
            if name == "goodput":
                point[name]["controller"] = controller.snapshot()
                point[name]["trace"] = trace
        engine.controller = None
        best = max(point["off"]["tokens_per_s"], point["fixed4"]["tokens_per_s"])
        point["goodput_over_best"] = point["goodput"]["tokens_per_s"] / best
        out["points"].append(point)
        log("sweep", c, {m: round(point[m]["tokens_per_s"], 2) for m in ("off", "fixed4", "goodput")},
            "goodput/best", round(point["goodput_over_best"], 3))
        write(a, R)
    catch_ups.close()


def plot(R: dict, png: str) -> None:
    """The four parts side by side; `--replot JSON` redraws a run's figure here where the
    device's image lacks matplotlib."""
    try:
        import matplotlib
    except ImportError:
        log("no matplotlib here: the figure is left to `python3 scripts/gpu_tp.py --replot <json>`")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 4, figsize=(18, 4))
    fig.suptitle(R["label"], fontsize=9)
    if "batch1" in R:
        ax[0].bar(["plain", "ceiling"], [R["batch1"]["tokens_per_s"], R["ceiling_tokens_per_s"]])
        ax[0].set(title=f"batch 1, TP {R['tp']}: {R['batch1']['fraction_of_ceiling']:.2f} of ceiling", ylabel="tokens/s")
    if "verify" in R:
        v = R["verify"]
        ax[1].bar(["decode", "verify g4"], [v["decode_ms"], v["verify5_ms"]])
        ax[1].set(title=f"verify / decode = {v['ratio']:.2f}", ylabel="ms")
    if "spec" in R:
        gs = list(R["spec"]["by_gamma"])
        ax[2].plot(gs, [R["spec"]["by_gamma"][g]["speedup"] for g in gs], "o-", label="measured")
        ax[2].plot(gs, [R["spec"]["by_gamma"][g]["ideal_speedup"] for g in gs], "s--", label="ideal")
        ax[2].set(title="draft model speedup over plain", xlabel="gamma")
        ax[2].legend()
    if "sweep" in R and R["sweep"]["points"]:
        pts = R["sweep"]["points"]
        cs = [p["concurrency"] for p in pts]
        for m in ("off", "fixed4", "goodput"):
            ax[3].plot(cs, [p[m]["tokens_per_s"] for p in pts], "o-", label=m)
        if "roofline_tokens_per_s" in pts[0]:
            ax[3].plot(cs, [p["roofline_tokens_per_s"] for p in pts], "k:", label="roofline")
        ax[3].set_xscale("log", base=2)
        ax[3].set(yscale="log", xlabel="concurrency", title="sweep, tokens/s")
        ax[3].legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def write(a, R: dict) -> None:
    os.makedirs(a.out, exist_ok=True)
    Path(a.out, f"{a.name}.json").write_text(dumps(R))


def parse(argv=None):
    env = os.environ.get
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tp", type=int, default=int(env("TP", "2")))
    p.add_argument("--target", default=env("TARGET", "demo-70b-target"))
    p.add_argument("--draft", default=env("DRAFT", "demo-8b-draft"))
    p.add_argument("--layers", type=int, default=int(env("LAYERS", "0")), help="reduced-layer check (0: all)")
    p.add_argument("--parts", default=env("PARTS", "batch1,verify,spec,sweep"))
    p.add_argument("--eager", action="store_true", default=env("GRAPHS", "1") == "0",
                   help="no CUDA graphs (GRAPHS=0): the eager passes, for a same-machine baseline")
    p.add_argument("--one-shot-kb", type=int, default=int(env("ONE_SHOT_KB", "512")),
                   help="engine.tp_one_shot_kb (ONE_SHOT_KB): all-reduces up to this size one-shot; 0: NCCL only")
    p.add_argument("--no-compile", dest="compile", action="store_false", default=env("COMPILE", "1") != "0",
                   help="engine.compile off (COMPILE=0): no fused Triton GEMV or compiled kernels on any rank")
    p.add_argument("--levels", default=env("LEVELS", "1,8,32,128"))
    p.add_argument("--gammas", default=env("GAMMAS", "2,3,4,6"))
    p.add_argument("--max-seqs", type=int, default=int(env("MAX_SEQS", "0")),
                   help="engine.max_num_seqs (MAX_SEQS; 0: max(64, the largest level)): fewer graphs to capture")
    p.add_argument("--kv-gb", type=float, default=float(env("KV_GB", "0")),
                   help="KV pool per rank (GiB); 0: 4 at TP 2 (70B bf16 leaves ~14 GiB of an H100), 16 at TP 4, 32 at TP 8")
    p.add_argument("--out", default=env("OUT", "."))
    p.add_argument("--name", default=env("NAME", ""))
    p.add_argument("--replot", metavar="JSON", help="only redraw this result file's figure beside it")
    p.add_argument("--cpu-smoke", action="store_true", help="CPU, float32, reduced 70B shape, TP 2 over gloo, a few steps")
    a = p.parse_args(argv)
    a.levels = [int(x) for x in a.levels.split(",")]
    a.gammas = [int(x) for x in a.gammas.split(",")]
    a.parts = a.parts.split(",")
    a.graphs = not a.eager
    a.new, a.warm, a.iters, a.ctx, a.prompt_len, a.out_range = 128, 16, 20, 512, 640, (64, 192)
    a.overrides = {"num_hidden_layers": a.layers} if a.layers else {}
    if a.cpu_smoke:
        a.tp, a.levels, a.gammas, a.overrides = 2, [1, 2], [2, 4], dict(SMOKE)
        a.new, a.warm, a.iters, a.ctx, a.prompt_len, a.out_range = 8, 2, 2, 32, 24, (4, 8)
    a.name = a.name or f"gpu_tp{a.tp}" + ("_cpu_smoke" if a.cpu_smoke else f"_l{a.layers}" if a.layers else "") + \
        ("_eager" if a.eager else "") + ("_nccl" if not a.one_shot_kb else "") + ("" if a.compile else "_nocompile")
    return a


def main(argv=None) -> int:
    a = parse(argv)
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")  # captures, start-up
    if a.replot:
        plot(json.loads(Path(a.replot).read_text()), str(Path(a.replot).with_suffix(".png")))
        return 0
    cuda = not a.cpu_smoke
    if cuda:
        assert torch.cuda.device_count() >= a.tp, f"TP {a.tp} needs {a.tp} GPUs, {torch.cuda.device_count()} here"
    kv_gb = a.kv_gb or (0.25 if not cuda else {2: 4, 4: 16}.get(a.tp, 32))
    target = target_dir(a.target, a.overrides)
    cfg = ClusterConfig.model_validate({
        "models": {"target": target, "draft": None if a.draft == "none" else a.draft,
                   "drafter": "none" if a.draft == "none" else "model", "device": "cuda" if cuda else "cpu",
                   "dtype": "bfloat16" if cuda else "float32"},
        "engine": {"tensor_parallel_size": a.tp, "cuda_graphs": a.graphs, "tp_one_shot_kb": a.one_shot_kb,
                   "max_num_seqs": (a.max_seqs or max(64, max(a.levels))) if cuda else 8,
                   "max_model_len": 2048 if cuda else 512,
                   "max_waiting": 1024, "max_batch_tokens": 2048, "prefill_chunk": 512, "kv_cache_gb": kv_gb,
                   "compile": a.compile and cuda, "prefix_caching": True},
        "speculation": {"mode": "goodput", "gamma": 4, "gamma_max": 8}})
    label = ("CPU smoke (orchestration check, NOT a speed figure): " if a.cpu_smoke else "") + \
        f"{a.target} TP {a.tp}" + (f", overrides {a.overrides}" if a.overrides else "")
    R: dict = {"label": label, "device": torch.cuda.get_device_name() if cuda else "cpu", "tp": a.tp,
               "gpus": torch.cuda.device_count() if cuda else 0, "torch": torch.__version__,
               "command": " ".join(["python3", "scripts/gpu_tp.py", *(argv or sys.argv[1:])]),
               "env": {k: os.environ[k] for k in ("TP", "PARTS", "LEVELS", "LAYERS", "GAMMAS", "KV_GB", "MAX_SEQS", "GRAPHS",
                                                 "ONE_SHOT_KB", "COMPILE")
                       if k in os.environ},
               "engine": cfg.engine.model_dump(), "target_overrides": a.overrides}
    from cluster.serve.build import build_engine

    # before the engine: the copy test's 4 GiB would not fit beside a TP-2 rank's 66 GiB of weights
    bw, flops = bandwidth(cuda), matmul_rate() if cuda else None
    if cuda:
        torch.cuda.empty_cache()
    t = time.time()
    engine = build_engine(cfg)
    try:
        model = engine.runner.model
        s = model.shape
        rank_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        R.update(start_s=time.time() - t, startup=engine.startup, weight_bytes_per_rank=rank_bytes, copy_bandwidth_Bps=bw,
                 ceiling_tokens_per_s=bw / rank_bytes, backend=engine.backend,
                 kv_blocks=engine.kv.pool.num_blocks, rank0_shape=str(s))
        if cuda:  # gpu_scale.roofline's inputs, per rank (each rank does 1/N of the FLOPs and bytes)
            R.update(param_bytes=rank_bytes, param_count=sum(p.numel() for p in model.parameters()),
                     kv_bytes_per_token=2 * s.layers * s.kv_heads * s.head_dim * 2,
                     copy_bandwidth=bw, matmul_flops=flops)
        log(f"engine up in {R['start_s']:.0f}s: {rank_bytes / 1e9:.2f} GB a rank, copy {bw / 1e9:.0f} GB/s, "
            f"ceiling {R['ceiling_tokens_per_s']:.1f} tok/s")
        write(a, R)
        # PROMPT_SEED / PROMPT_CHARS: another run's prompts (gpu_tp_served's: 9 / 1200)
        seed, chars = int(os.environ.get("PROMPT_SEED", "11")), int(os.environ.get("PROMPT_CHARS", "400"))
        a.prompts, a.plain = code_prompts(8, chars=chars, seed=seed), None
        for part in a.parts:
            try:
                {"batch1": batch1, "verify": verify, "spec": spec, "sweep": sweep, "profile": profile}[part](engine, a, R)
            except Exception as e:  # noqa: BLE001 - keep what the other parts measure
                import traceback

                traceback.print_exc()
                R.setdefault("errors", {})[part] = f"{type(e).__name__}: {e}"
            write(a, R)
    finally:
        engine.close()
        if a.overrides:
            shutil.rmtree(target, ignore_errors=True)
    plot(R, os.path.join(a.out, f"{a.name}.png"))
    write(a, R)
    log("done:", os.path.join(a.out, a.name + ".json"))
    return 1 if R.get("errors") else 0


if __name__ == "__main__":
    sys.exit(main())
