"""Issue 38's served run: `spec-cluster up` with configs/hopper-70b.yaml at TP N on one host,
through the real endpoints: one gRPC and one OpenAI request answered, then tokens/s over gRPC
at 1 and 32 streams (128 tokens each, the config's goodput controller).

    TP=4 BUNDLE=.device-bundle-serve bash scripts/gpu_py.sh gpu_tp_served.py   # nvidia-h100-x4
    TP=4 PLACEMENT=disaggregated LEVELS=1,16 BUNDLE=.device-bundle-serve \
        bash scripts/gpu_py.sh gpu_tp_served.py                               # an 8-GPU kind (issue 41)
    python3 scripts/gpu_tp_served.py --cpu-smoke --out /tmp/tps                 # here: orchestration only

Issue 39's comparison, a drafter on its own GPU against the same drafter on rank 0, in one call
(3 of a 4-GPU host: TP 2 on two, the drafter replica on a third), greedy tokens checked
against plain on the same deployment:

    TP=2 PLACEMENT=colocated,disaggregated DRAFT=demo-8b-target GAMMA=4 PLAIN=1 LEVELS=1,8 \
        MAX_SEQS=8 MAX_LEN=2048 BUNDLE=.device-bundle-tp bash scripts/gpu_py.sh gpu_tp_served.py

(nvidia-h200-x4: the 8B-shaped drafter colocated adds 16 GB to rank 0's 70.6 GB. On H100s TP 2
at the 70B shape fits with 2 GiB of KV a rank, the default here at TP 2, and batch buckets up to
8, MAX_SEQS=8, beside a 1B-shaped drafter at most: DRAFT=demo-8b-draft-1b, 2.5 GB.)

On the GPU the target is demo-70b-target (the demo target in Llama-3.1-70B dimensions) over TP
ranks and DRAFT (default demo-8b-draft; demo-8b-draft-1b drafts the same tokens at a 1B's step
time) drafts on rank 0's GPU (at TP 4 on a 4-GPU host no GPU is left for a drafter of its own);
`PLACEMENT=disaggregated` puts it in a drafter replica on a GPU of its own; both, comma-separated,
deploy one after the other and `own_over_colocated` gives the ratio per level. With PLAIN=1 each
level also runs plain decoding over the same prompts; where a request's greedy tokens part from
plain's, one more plain run with log-probabilities gives the target's margin at the first
difference (`margins`, `max_margin`: a rounding apart is a near-tie). Each level records the
drafts made ahead that were used and dropped (GetStats' ahead_hits / ahead_misses). No Redis (kvdir
off), no accelerator_type. `--cpu-smoke`: the demo pair, float32, TP 2 over gloo, 1 and 2 streams
of 8 tokens: it checks the script, not a speed. Writes gpu_tp_served*.json under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
# `spec-cluster up` and its Ray workers import the package too
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)

from cluster.bench.harness import log  # noqa: E402
from cluster.bench.load import run_grpc  # noqa: E402
from cluster.bench.served import served  # noqa: E402
from cluster.bench.workloads import code_prompts  # noqa: E402
from cluster.config import load_config  # noqa: E402


def config(a, placement: str) -> dict:
    cfg = load_config(REPO / "configs/hopper-70b.yaml").model_dump(mode="json")
    gpu = not a.cpu_smoke
    cfg["models"].update(target="demo-70b-target" if gpu else "demo-target", draft=a.draft if gpu else "demo-draft",
                         device="cuda" if gpu else "cpu", dtype="bfloat16" if gpu else "float32",
                         attention="auto" if gpu else "sdpa")
    # TP 2 holds 70.6 GB of weights a rank: 2 GiB of KV and few batch buckets fit an H100 (benchmarks/gpu/tp/h100_tp2)
    kv_gb = a.kv_gb or {2: 2, 4: 16}.get(a.tp, 32)
    cfg["engine"].update(tensor_parallel_size=a.tp, kv_cache_gb=kv_gb if gpu else 0.25,
                         max_num_seqs=a.max_seqs, max_model_len=a.max_len, max_waiting=256)
    cfg["placement"] = placement
    cfg["verifier"]["ray_actor_options"] = {"num_gpus": 1, "num_cpus": 4} if gpu else {"num_cpus": 1}
    # disaggregated: the draft model in a drafter replica on a GPU of its own (TP 2 on GPUs 0-1
    # and the drafter on a third; issue 41's served part: TP 4 on GPUs 0-3 and the drafter on a fifth)
    own_gpu = gpu and placement == "disaggregated"
    cfg["drafter"]["ray_actor_options"] = {"num_gpus": 1, "num_cpus": 2} if own_gpu else {"num_cpus": 1}
    cfg["kvdir"]["url"] = None
    cfg["router"]["failover_wait_s"] = 30.0
    return cfg


def agreement(spec: list[dict], plain: list[dict]) -> dict:
    """Greedy requests of the same prompts with and without speculation: how many gave plain's
    tokens, and where each other one first parts from plain."""
    base = {d["prompt_index"]: [int(t) for t in d.get("token_ids", [])] for d in plain}
    same, first = 0, {}
    for d in spec:
        mine, theirs = [int(t) for t in d.get("token_ids", [])], base.get(d["prompt_index"], [])
        if mine == theirs:
            same += 1
        else:
            first[d["prompt_index"]] = next((i for i, (x, y) in enumerate(zip(mine, theirs)) if x != y),
                                            min(len(mine), len(theirs)))
    return {"same_tokens_as_plain": same, "requests": len(spec), "first_difference": first}


def margins(spec: list[dict], plain: list[dict]) -> dict:
    """Where a request's greedy tokens part from plain decoding's (a plain run with
    log-probabilities), by how much the target preferred plain's token there: its two best
    log-probabilities' gap, and plain's token's over the speculative one's (None: not among the
    two best, a gap no rounding explains). A rounding apart is a near-tie; whole logits, a bug."""
    base = {d["prompt_index"]: d for d in plain}
    out = {}
    for d in spec:
        p = base.get(d["prompt_index"], {})
        mine, theirs = [int(t) for t in d.get("token_ids", [])], [int(t) for t in p.get("token_ids", [])]
        i = next((j for j, (x, y) in enumerate(zip(mine, theirs)) if x != y), None)
        if i is None or i >= len(p.get("logprobs", [])):
            continue
        top = {int(t["token_id"]): t["logprob"] for t in p["logprobs"][i].get("top", [])}
        best = sorted(top.values(), reverse=True)
        both = mine[i] in top and theirs[i] in top
        out[d["prompt_index"]] = {"at": i, "top2_margin": best[0] - best[1] if len(best) > 1 else None,
                                  "plain_minus_spec": top[theirs[i]] - top[mine[i]] if both else None}
    gaps = [m["plain_minus_spec"] for m in out.values()]
    return {"margins": out, "max_margin": None if None in gaps else max(gaps, default=0.0)}


def openai_request(base: str, prompt: str, max_tokens: int) -> int:
    """One completion through the OpenAI API: with the official client where installed."""
    try:
        import openai
    except ImportError:  # the GPU image's bundles may lack it: the same request over plain HTTP
        body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0}).encode()
        req = urllib.request.Request(f"{base}/completions", body, {"content-type": "application/json"})
        return json.loads(urllib.request.urlopen(req, timeout=600).read())["usage"]["completion_tokens"]
    client = openai.OpenAI(base_url=base, api_key="unused", max_retries=0, timeout=600)
    model = client.models.list().data[0].id
    return client.completions.create(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0).usage.completion_tokens


def ahead_counts(address: str) -> dict:
    """The verifiers' drafts made ahead so far (GetStats, summed over replicas), once the stats
    board has taken the replicas' figures since the last request (it reads them every second)."""
    from cluster.client import Client

    time.sleep(2.0)
    with Client(address, timeout=60) as c:
        reps = c.stats().replicas
    return {k: sum(getattr(r, k) for r in reps) for k in ("ahead_hits", "ahead_misses", "draft_failures")}


def measure(a, placement: str, levels: list[int], prompts: list[str], run: dict, write) -> None:
    """One deployment, into `run`: a gRPC and an OpenAI request, then each level at the
    speculation asked for (and plain on the same prompts with --plain)."""
    run["config"] = config(a, placement)
    with served(run["config"], echo=lambda line: print(line, flush=True), timeout_s=1800) as up:
        run["ready_s"] = round(up.ready_s, 1)
        log(placement, "ready in", run["ready_s"], "s")
        from cluster.client import Client

        with Client(up.grpc, timeout=600) as c:
            r = c.generate("def fibonacci(n):", max_tokens=32)
        run["grpc_request"] = {"tokens": len(r.token_ids), "finish_reason": r.finish_reason}
        run["openai_request"] = {"tokens": openai_request(up.http, "import os", 16)}
        log("gRPC:", run["grpc_request"], "OpenAI:", run["openai_request"])
        write()
        for c in levels:
            run_grpc(up.grpc, None, prompts[:c], c, a.new, a.gamma)  # warm-up at this level
            before = ahead_counts(up.grpc)
            done, wall = run_grpc(up.grpc, None, prompts[:2 * c], c, a.new, a.gamma)
            after = ahead_counts(up.grpc)
            tokens = sum(len(d.get("token_ids", [])) for d in done)
            drafted = sum(d["spec"]["drafted"] for d in done)
            point = {"concurrency": c, "requests": len(done), "tokens": tokens, "wall_s": round(wall, 2),
                     "tokens_per_s": round(tokens / wall, 1),
                     "acceptance": round(sum(d["spec"]["accepted"] for d in done) / max(1, drafted), 3),
                     # rows whose drafts, made ahead during the verify pass before, were used / dropped
                     **{k: after[k] - before[k] for k in after}}
            if a.plain:
                base, base_wall = run_grpc(up.grpc, None, prompts[:2 * c], c, a.new, "off")
                point["plain_tokens_per_s"] = round(sum(len(d.get("token_ids", [])) for d in base) / base_wall, 1)
                point.update(agreement(done, base))
                if point["first_difference"]:  # plain again with log-probabilities: the margins there
                    lp, _ = run_grpc(up.grpc, None, prompts[:2 * c], c, a.new, "off", logprobs=2)
                    point.update(margins(done, lp))
            run.setdefault("streams", []).append(point)
            log(placement, "streams", point)
            write()


def plot(R: dict, png: Path) -> None:
    """tokens/s per level: plain, and each placement speculating (`--replot` redraws it)."""
    try:
        import matplotlib
    except ImportError:
        log("no matplotlib here: `python3 scripts/gpu_tp_served.py --replot <json>` draws the figure")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = R["runs"]
    levels = sorted({s["concurrency"] for r in runs.values() for s in r.get("streams", [])})
    bars = {}
    for pl, r in runs.items():
        by = {s["concurrency"]: s for s in r.get("streams", [])}
        if any("plain_tokens_per_s" in s for s in by.values()) and "plain" not in bars:
            bars["plain"] = [by.get(c, {}).get("plain_tokens_per_s", 0.0) for c in levels]
        bars[pl] = [by.get(c, {}).get("tokens_per_s", 0.0) for c in levels]
    fig, ax = plt.subplots(figsize=(7, 4))
    w = 0.8 / max(1, len(bars))
    for i, (name, ys) in enumerate(bars.items()):
        xs = [j + i * w for j in range(len(levels))]
        ax.bar(xs, ys, w, label=name)
        for x, y in zip(xs, ys):
            ax.annotate(f"{y:.0f}", (x, y), ha="center", va="bottom", fontsize=8)
    ax.set_xticks([j + w * (len(bars) - 1) / 2 for j in range(len(levels))], [f"{c} streams" for c in levels])
    ax.set_ylabel("tokens/s (gRPC, greedy)")
    ax.set_title(f"{R['label']}, draft {R['draft']}, gamma {R['gamma']}: own GPU / colocated {R.get('own_over_colocated', {})}",
                 fontsize=8)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--tp", type=int, default=int(os.environ.get("TP", "4")))
    p.add_argument("--levels", default=os.environ.get("LEVELS", "1,32"))
    p.add_argument("--new", type=int, default=int(os.environ.get("NEW_TOKENS", "128")))
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--placement", default=os.environ.get("PLACEMENT", "colocated"),
                   help="colocated: the draft model on rank 0's GPU; disaggregated: a drafter replica of its own; "
                        "both, comma-separated: one deployment after the other, compared per level")
    p.add_argument("--draft", default=os.environ.get("DRAFT", "demo-8b-draft"),
                   help="the draft model on the GPU: demo-8b-draft (tiny), demo-8b-draft-1b (a 1B's step time) or "
                        "demo-8b-target (an 8B's step time; the same small model as the target, so it drafts the "
                        "target's tokens almost always)")
    p.add_argument("--gamma", default=os.environ.get("GAMMA", "auto"), help="auto (the config's controller) or a fixed gamma")
    p.add_argument("--plain", action="store_true", default=os.environ.get("PLAIN") == "1",
                   help="also run each level's prompts without speculation: plain tokens/s and greedy equality")
    p.add_argument("--max-seqs", type=int, default=int(os.environ.get("MAX_SEQS", "64")))
    p.add_argument("--max-len", type=int, default=int(os.environ.get("MAX_LEN", "4096")))
    p.add_argument("--kv-gb", type=float, default=float(os.environ.get("KV_GB", "0")),
                   help="KV pool a rank (GiB); 0: 2 at TP 2, 16 at TP 4, 32 at TP 8")
    p.add_argument("--cpu-smoke", action="store_true")
    p.add_argument("--replot", metavar="JSON", help="only redraw this result file's figure beside it")
    a = p.parse_args()
    if a.replot:
        plot(json.loads(Path(a.replot).read_text()), Path(a.replot).with_suffix(".png"))
        return 0
    if a.cpu_smoke:
        a.tp, a.levels, a.new, a.max_seqs, a.max_len = 2, "1,2", 8, 8, 512
    a.gamma = int(a.gamma) if a.gamma.isdigit() else a.gamma
    placements = a.placement.split(",")
    for pl in placements:
        if pl not in ("colocated", "disaggregated"):
            p.error(f"--placement: {pl!r} is not colocated or disaggregated")
    levels = [int(x) for x in a.levels.split(",")]
    name = ("gpu_tp_served" + ("_drafter_replica" if placements == ["disaggregated"] else "")
            + ("_placements" if len(placements) > 1 else "") + ("_cpu_smoke" if a.cpu_smoke else ""))
    R: dict = {"label": ("CPU smoke (orchestration, NOT a speed): " if a.cpu_smoke else "") + f"served TP {a.tp}",
               "command": " ".join(["python3", "scripts/gpu_tp_served.py", *sys.argv[1:]]),
               "env": {k: os.environ[k] for k in ("TP", "LEVELS", "PLACEMENT", "DRAFT", "GAMMA", "PLAIN", "KV_GB", "MAX_SEQS")
                       if k in os.environ},
               "draft": a.draft, "gamma": a.gamma, "runs": {}}
    out = Path(a.out, name + ".json")
    out.parent.mkdir(parents=True, exist_ok=True)

    def write() -> None:
        if {"colocated", "disaggregated"} <= R["runs"].keys():  # the drafter's own GPU against colocated
            rate = {pl: {s["concurrency"]: s["tokens_per_s"] for s in R["runs"][pl].get("streams", [])} for pl in R["runs"]}
            R["own_over_colocated"] = {c: round(v / rate["colocated"][c], 3)
                                       for c, v in rate["disaggregated"].items() if c in rate["colocated"]}
        out.write_text(json.dumps(R, indent=1) + "\n")

    prompts = code_prompts(max(levels) * 2, chars=1200, seed=9)
    for pl in placements:
        measure(a, pl, levels, prompts, R["runs"].setdefault(pl, {}), write)
        write()
    plot(R, out.with_suffix(".png"))
    log("wrote", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
