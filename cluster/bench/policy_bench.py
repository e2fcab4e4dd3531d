"""Load ramp: tokens/s against concurrency for each speculation policy (off, fixed 4, table,
goodput), greedy, demo pair, held-out code prompts.

    python -m cluster.bench.policy_bench --out benchmarks/policy
    python -m cluster.bench.policy_bench --out benchmarks/policy --ray --levels 1,4,16

Engine level (default): one in-process engine per policy (sharing the weights), kept for
the whole ramp so the goodput controller learns as the load rises, as it would on a
server. At concurrency c, c requests are in flight and each finished one is replaced by
the next; tokens/s counts the window in which the batch stays full (it ends when the first
request finishes with nothing left to replace it), over the engine's own step time. The
engines take steps in turn, so a burst of load from another process on a shared machine
lands on every policy alike; `--repeats` runs per level, pooled.
Every request's greedy output must equal its output with speculation off (the first run
of that request under `off` is the reference); a mismatch fails the run after the JSON
is written.

`--ray` does the same through a local Ray Serve cluster and the gRPC proxy (policy_bench_ray).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import Counter, deque
from pathlib import Path

import torch
from tqdm.auto import tqdm

from cluster.bench.policies import BASELINES, POLICIES, policy_config, requests
from cluster.bench.report import figure, write_json
from cluster.config import parse_config
from cluster.engine.sampling import SamplingParams
from cluster.engine.scheduling.sequence import SpecParams
from cluster.serve.build import build_engine


def cluster_config(policy: str, max_num_seqs: int, overrides: dict | None = None) -> dict:
    spec = policy_config(policy)
    base = {"speculation": spec, "engine": {"max_num_seqs": max_num_seqs, "max_waiting": max_num_seqs,
                                            "max_model_len": 1024, "max_batch_tokens": 1024}}
    return {**base, **(overrides or {})}


class Outputs:
    """The off policy's output of each request is the reference for every other run of it."""

    def __init__(self):
        self.ref: dict[int, list[int]] = {}
        self.mismatches: list[str] = []

    def check(self, policy: str, c: int, i: int, ids: list[int]) -> None:
        if i not in self.ref:
            if policy != "off":
                raise RuntimeError("run off first at each level: it makes the reference")
            self.ref[i] = ids
        elif ids != self.ref[i]:
            n = next((k for k, (a, b) in enumerate(zip(ids, self.ref[i])) if a != b), min(len(ids), len(self.ref[i])))
            self.mismatches.append(f"{policy} c={c} request {i}: differs from off at token {n}")


class Stream:
    """One policy's engine kept at concurrency c over a request list, one step at a time."""

    def __init__(self, policy: str, engine, reqs: list[tuple[str, int]], c: int):
        self.policy, self.engine, self.reqs, self.c = policy, engine, reqs, c
        self.pending, self.live = deque(range(len(reqs))), {}
        self.out: dict[int, list[int]] = {i: [] for i in range(len(reqs))}
        self.obs, self.window, self.tokens, self.wall, self.cpu = [], True, 0, 0.0, 0.0
        engine.on_verify = self.obs.append

    @property
    def done(self) -> bool:
        return not (self.pending or self.live)

    def step(self) -> None:
        e = self.engine
        while self.pending and len(self.live) < self.c:
            i = self.pending.popleft()
            prompt, m = self.reqs[i]
            sid = e.add_request(prompt, SamplingParams(max_tokens=m, ignore_eos=True), SpecParams("auto"),
                                request_id=f"r{i}")
            self.live[sid] = i
        if self.window and len(self.live) < self.c:  # nothing left to refill with: draining
            self.window = False
            e.on_verify = None
        t0, c0 = time.perf_counter(), time.thread_time()
        outs = e.step()
        if self.window:
            self.wall += time.perf_counter() - t0
            self.cpu += time.thread_time() - c0
        for o in outs:
            i = self.live[o.seq_id]
            self.out[i] += o.token_ids
            self.tokens += len(o.token_ids) if self.window else 0
            if o.finished:
                del self.live[o.seq_id]

    def stats(self) -> dict:
        obs = self.obs
        rows = sum(o.batch_size for o in obs)
        drafted = sum(o.drafted for o in obs)
        accepted = sum(sum(o.accepted_per_position) for o in obs)
        mean = lambda xs: 1e3 * statistics.fmean(xs) if obs else 0.0  # noqa: E731
        return {"tokens": self.tokens, "seconds": self.wall, "cpu_seconds": self.cpu,
                "tokens_per_s": self.tokens / self.wall, "tokens_per_cpu_s": self.tokens / max(self.cpu, 1e-9),
                "mean_gamma": drafted / rows if rows else 0.0,
                "acceptance_rate": accepted / drafted if drafted else 0.0,
                "mean_batch": rows / len(obs) if obs else 0.0, "verify_steps": len(obs),
                "gamma_steps": dict(sorted(Counter(o.gamma for o in obs).items())),
                "verify_ms_per_step": mean([o.verify_s for o in obs]),
                "draft_ms_per_step": mean([o.draft_s for o in obs])}


def run_level(engines: dict, reqs: list[tuple[str, int]], c: int) -> list[Stream]:
    """Every policy at concurrency c, stepped in turn: a burst of load from elsewhere on
    the machine lands on all of them alike. tokens/s counts each engine's own steps
    inside its full-batch window."""
    streams = [Stream(p, e, reqs, c) for p, e in engines.items()]
    while not all(s.done for s in streams):
        for s in streams:
            if not s.done:
                s.step()
    return streams


def build_engines(policies: list[str], max_num_seqs: int) -> dict:
    """One engine per policy, all on the same target and draft weights (built once), so
    the interleaved steps do not evict each other's weights from the CPU caches."""
    from cluster.engine.drafters.model import ModelDrafter
    from cluster.engine.drafters.ngram import NgramDrafter
    from cluster.engine.engine import Engine
    from cluster.policy.controller import make_controller

    first = build_engine(parse_config(cluster_config(policies[0], max_num_seqs)))
    engines = {policies[0]: first}
    draft_model = first.drafters["model"].runner.model
    for p in policies[1:]:
        cfg = parse_config(cluster_config(p, max_num_seqs))
        ec = cfg.engine_config()
        drafters = {"ngram": NgramDrafter(),
                    "model": ModelDrafter(draft_model, 2 * ec.max_num_seqs, ec.max_model_len)}
        e = Engine(first.model, first.tokenizer, ec, drafters, "model", identity=cfg.models.target)
        e.controller = make_controller(cfg.speculation)
        engines[p] = e
    return engines


def compute_bound(engine, ms_per_token: float) -> None:
    """Make each verify pass also wait `ms_per_token` per token it carries: the shape of a
    verifier past its compute knee (a GPU at large batch x gamma). On this CPU the demo
    target is row-bound (~1 ms per row against ~0.2 ms per extra token), so speculation
    keeps paying at any batch here; with this wait it stops paying at a few streams, and
    the controllers have to find that from what they measure, like on the real thing."""
    forward = engine.runner.forward

    def slow(slots, cache_lens, tokens, last_only, *args, **kw):
        out = forward(slots, cache_lens, tokens, last_only, *args, **kw)
        if not last_only:  # verify passes (prefill asks for the last position only)
            time.sleep(ms_per_token * sum(map(len, tokens)) / 1e3)
        return out

    engine.runner.forward = slow


def summarise(cells: dict[tuple[str, int], list[dict]], levels: list[int], policies: list[str]) -> list[dict]:
    """Per (policy, level): tokens/s pooled over repeats (all tokens over all step time);
    goodput's ratio to the best baseline, pooled and per repeat (the repeats are paired:
    the policies shared each repeat's machine load)."""
    rows = []
    for c in levels:
        row = {"concurrency": c}
        for p in policies:
            runs = cells[(p, c)]
            row[p] = {"tokens_per_s": sum(r["tokens"] for r in runs) / sum(r["seconds"] for r in runs),
                      "runs_tokens_per_s": [r["tokens_per_s"] for r in runs],
                      **{k: statistics.fmean(r[k] for r in runs)
                         for k in ("mean_gamma", "acceptance_rate", "mean_batch", "verify_ms_per_step",
                                   "draft_ms_per_step")}}
        base = [p for p in BASELINES if p in policies]
        if "goodput" in policies and base:
            best = max(base, key=lambda p: row[p]["tokens_per_s"])
            row["best_baseline"] = best
            row["goodput_ratio"] = row["goodput"]["tokens_per_s"] / row[best]["tokens_per_s"]
            n = len(cells[("goodput", c)])
            row["goodput_ratio_per_repeat"] = [
                cells[("goodput", c)][i]["tokens_per_s"] / max(cells[(p, c)][i]["tokens_per_s"] for p in base)
                for i in range(n)]
        rows.append(row)
    return rows


def plot(rows: list[dict], policies: list[str], path: Path, title: str) -> None:
    plt = figure()
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    xs = [r["concurrency"] for r in rows]
    style = {"off": "k--", "fixed4": "s-", "table": "^-", "goodput": "o-"}
    for p in policies:
        ax.plot(xs, [r[p]["tokens_per_s"] for r in rows], style.get(p, "-"), label=p, lw=2 if p == "goodput" else 1.2)
    ax.set(xscale="log", xlabel="concurrent streams", ylabel="tokens/s (greedy, pooled over repeats)",
           title=title)
    ax.set_xticks(xs, [str(x) for x in xs])
    ax.grid(alpha=0.3)
    ax.legend()
    for p in policies:
        if p != "off":
            ax2.plot(xs, [r[p]["mean_gamma"] for r in rows], style.get(p, "-"), label=f"{p} gamma",
                     lw=2 if p == "goodput" else 1, alpha=1 if p == "goodput" else 0.5)
    if "goodput" in policies:
        ax3 = ax2.twinx()
        ax3.plot(xs, [r["goodput"]["acceptance_rate"] for r in rows], "g:", label="goodput acceptance")
        ax3.set(ylabel="acceptance rate", ylim=(0, 1))
        ax3.legend(loc="upper center")
    ax2.set(xscale="log", xlabel="concurrent streams", ylabel="mean gamma (draft tokens per sequence per step)",
            title="gamma chosen against concurrency")
    ax2.set_xticks(xs, [str(x) for x in xs])
    ax2.set_ylim(bottom=0)
    ax2.grid(alpha=0.3)
    ax2.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="benchmarks/policy")
    ap.add_argument("--levels", default="1,2,4,8,16,32")
    ap.add_argument("--policies", default=",".join(POLICIES))
    ap.add_argument("--rounds", type=int, default=3, help="requests per level = rounds x concurrency")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--min-tokens", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=160)
    # One intra-op thread: on a small shared machine two threads stall on each other's
    # barriers whenever another process takes a core, which swamps the policy differences.
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--verify-ms-per-token", type=float, default=0.0,
                    help="emulate a compute-bound verifier (see compute_bound); 0 = this CPU as it is")
    ap.add_argument("--ray", action="store_true", help="through local Ray Serve and gRPC instead")
    args = ap.parse_args(argv)
    if args.ray:
        from cluster.bench.policy_bench_ray import main as ray_main

        return ray_main(args)
    torch.set_num_threads(args.threads)
    levels = [int(x) for x in args.levels.split(",")]
    policies = args.policies.split(",")
    if policies[0] != "off":
        raise SystemExit("--policies must start with off (it makes the reference outputs)")
    reqs = requests(args.rounds * max(levels), args.min_tokens, args.max_tokens)
    engines = build_engines(policies, max(levels))
    if args.verify_ms_per_token:
        for e in engines.values():
            compute_bound(e, args.verify_ms_per_token)
    # Warm-up, not measured: other prompts, one stream; also the controllers' cold start.
    run_level(engines, requests(4, 64, 64, seed=99), 1)
    outputs, cells = Outputs(), {}
    bar = tqdm(total=len(levels) * args.repeats, desc="policy ramp")
    for c in levels:
        for rep in range(args.repeats):
            for s in run_level(engines, reqs[: args.rounds * c], c):
                for i, ids in s.out.items():
                    outputs.check(s.policy, c, i, ids)
                cells.setdefault((s.policy, c), []).append({**s.stats(), "controller": s.engine.controller.snapshot()})
            bar.set_postfix_str(" ".join(f"{p} {cells[(p, c)][-1]['tokens_per_s']:.0f}" for p in policies))
            bar.update()
    bar.close()
    rows = summarise(cells, levels, policies)
    for r in rows:
        line = "  ".join(f"{p} {r[p]['tokens_per_s']:6.1f} (g {r[p]['mean_gamma']:.2f})" for p in policies)
        tqdm.write(f"c={r['concurrency']:2d}: {line}  ratio {r.get('goodput_ratio', float('nan')):.3f}")
    data = {"kind": "engine", "levels": levels, "policies": {p: POLICIES.get(p, "inline") for p in policies},
            "rounds": args.rounds, "repeats": args.repeats, "threads": args.threads,
            "verify_ms_per_token": args.verify_ms_per_token,
            "max_tokens_range": [args.min_tokens, args.max_tokens], "results": rows,
            "identical_to_off": not outputs.mismatches, "mismatches": outputs.mismatches[:20],
            "checked_outputs": len(outputs.ref),
            "goodput_controller_final": engines["goodput"].controller.snapshot() if "goodput" in engines else None,
            "runs": {f"{p}@{c}": v for (p, c), v in cells.items()}}
    k = args.verify_ms_per_token
    path = write_json(args.out, f"policy_engine_compute_bound_{k:g}ms" if k else "policy_engine", data)
    plot(rows, policies, path.with_suffix(".png"),
         f"Engine on CPU ({args.threads} thread), demo pair" + (f", verify +{k:g} ms/token" if k else ""))
    print(f"wrote {path} and {path.with_suffix('.png')}")
    if outputs.mismatches:
        print("greedy outputs differ from speculation off:\n" + "\n".join(outputs.mismatches[:20]), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
