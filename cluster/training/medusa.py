"""Train Medusa heads for a target model: self-distillation on the target's own continuations.

    spec-cluster models train-medusa --target cluster/models/demo/target

1. Prompts are windows of the stdlib training split (training.demo's md5 rule; test suites
   left out as in the benchmarks' prompts), so the held-out benchmark prompts stay unseen.
2. The target continues each prompt, greedily for a share of them and sampled for the rest,
   through the engine's own runner; the hidden state it computed at each position and the
   token it chose next are kept. Head k's label at h_t is the target's own token t+k+1:
   the heads learn what the target will say rather than what the corpus said, which is what
   acceptance rewards (the paper's self-distillation).
3. L = sum_k 0.8^k CE(head_k(h_t), x_{t+k+1}), k = 1..K, the target frozen (AdamW, cosine lr).
4. Greedy continuations of validation-split prompts (md5 % 20 == 1: kept out of the target's
   training and of the benchmarks' held-out prompts) give each head's top-i accuracy and the
   measured chance of each candidate path, from which the sparse tree the drafter uses is
   grown (cluster.engine.drafters.medusa.sparse_tree); both go in the json beside the heads.
"""

from __future__ import annotations

import argparse
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from cluster.engine.drafters.medusa import CONFIG_FILE, MedusaHeads, sparse_tree
from cluster.engine.scheduling.kv_cache import KVCache
from cluster.engine.worker.loader import load_model, load_tokenizer
from cluster.engine.worker.runner import Runner

DEMO_TARGET = Path(__file__).resolve().parents[1] / "models" / "demo" / "target"
TOPK = 5  # ranks per head measured (and offered to the tree)


def prompt_windows(split: str, n: int, length: int, tokenizer, seed: int) -> list[list[int]]:
    """`n` windows of `length` tokens from random files of a split ('train', 'val' or 'held')."""
    from cluster.training.demo_data import SKIP_DIRS, stdlib_files

    files = [t for rel, t in stdlib_files()[split] if not SKIP_DIRS & set(rel.split("/")[:-1])]
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        ids = tokenizer.encode(rng.choice(files))
        if len(ids) > length + 1:
            start = rng.randrange(0, len(ids) - length)
            out.append(ids[start:start + length])
    return out


@torch.inference_mode()
def continuations(model, prompts: list[list[int]], new: int, temperature: float, seed: int,
                  batch: int = 128, desc: str = "continuations") -> tuple[torch.Tensor, torch.Tensor]:
    """The target continues each prompt by `new` tokens (temperature 0: greedy).
    Returns hidden [N, new, D] at positions P-1 .. P+new-2 and tokens [N, new] at P .. P+new-1:
    hidden[:, i] is the state from which the target chose tokens[:, i]."""
    s = model.shape
    dev = next(model.parameters()).device  # the model's device: the GPU where there is one
    gen = torch.Generator(dev).manual_seed(seed)  # on the device: no host copy of each step's probabilities
    hs, ys = [], []
    bar = tqdm(total=len(prompts) * new, desc=desc, unit="tok", leave=False)
    for i in range(0, len(prompts), batch):
        chunk = prompts[i:i + batch]
        P, B = len(chunk[0]), len(chunk)
        kv = KVCache.dense(s.layers, B, P + new + 1, s.kv_heads, s.head_dim, next(model.parameters()).dtype, dev)
        runner, rows = Runner(model, kv, "sdpa"), list(range(B))
        logits, h = runner.forward(rows, [0] * B, chunk, last_only=True, hidden=True)
        h_steps, y_steps = [], []
        for step in range(new):
            if temperature > 0:
                tok = torch.multinomial(torch.softmax(logits / temperature, -1), 1, generator=gen)[:, 0]
            else:
                tok = logits.argmax(-1)
            h_steps.append(h)
            y_steps.append(tok)
            bar.update(B)
            if step + 1 < new:
                logits, h = runner.forward(rows, [P + step] * B, tok[:, None].tolist(), last_only=True, hidden=True)
        hs.append(torch.stack(h_steps, 1).cpu())
        ys.append(torch.stack(y_steps, 1).cpu())
    bar.close()
    return torch.cat(hs), torch.cat(ys)


def head_pairs(hidden: torch.Tensor, tokens: torch.Tensor, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(h_t [M, D], labels [M, K]): head k's label at h_t is the token chosen k steps after
    the one h_t chose (hidden[:, i] -> tokens[:, i + k])."""
    n = tokens.shape[1] - K
    labels = torch.stack([tokens[:, k:k + n] for k in range(1, K + 1)], -1)
    return hidden[:, :n].reshape(-1, hidden.shape[-1]), labels.reshape(-1, K)


@torch.inference_mode()
def label_ranks(heads: MedusaHeads, lm_head: torch.Tensor, h: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """[M, K]: the rank of the label among each head's top TOPK choices (TOPK: not there)."""
    out = []
    for i in range(0, len(h), 4096):
        top = heads(h[i:i + 4096], lm_head).topk(TOPK, -1).indices            # [m, K, TOPK]
        hit = top == labels[i:i + 4096, :, None]
        out.append(torch.where(hit.any(-1), hit.int().argmax(-1), TOPK))
    return torch.cat(out)


def accuracy(ranks: torch.Tensor) -> list[list[float]]:
    """acc[k][i]: share of positions where head k+1's rank-i choice is the label."""
    return [[(ranks[:, k] == i).float().mean().item() for i in range(TOPK)] for k in range(ranks.shape[1])]


def joint_score(ranks: torch.Tensor):
    """Measured chance that a whole path is right: heads are not independent (where head 1 is
    right the text is predictable and head 2 is right more often), and a tree grown from the
    joint estimate goes deeper than the paper's product of marginals would."""
    return lambda path: (ranks[:, : len(path)] == torch.tensor(path)).all(1).float().mean().item()


def train(heads: MedusaHeads, lm_head: torch.Tensor, h: torch.Tensor, labels: torch.Tensor, args) -> list[float]:
    opt = torch.optim.AdamW(heads.parameters(), lr=args.lr, weight_decay=0.0)
    steps = args.epochs * math.ceil(len(h) / args.batch)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / 50) * 0.5 * (1 + math.cos(math.pi * i / steps)))
    lam = torch.tensor([0.8 ** k for k in range(1, heads.num_heads + 1)])
    gen = torch.Generator().manual_seed(args.seed)
    deadline = time.monotonic() + 60 * args.minutes
    losses, bar = [], tqdm(total=steps, desc="train heads", unit="step")
    heads.train()
    for step in range(steps):
        idx = torch.randint(0, len(h), (args.batch,), generator=gen)
        logits = heads(h[idx], lm_head)                                        # [b, K, V]
        ce = F.cross_entropy(logits.flatten(0, 1), labels[idx].flatten(), reduction="none").view(-1, heads.num_heads)
        loss = (ce.mean(0) * lam).sum()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
        bar.update()
        bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}")
        if time.monotonic() > deadline:
            tqdm.write(f"time budget reached at step {step + 1}/{steps}")
            break
    bar.close()
    heads.eval()
    return losses


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="spec-cluster models train-medusa", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(DEMO_TARGET), help="target HF model directory")
    ap.add_argument("--out", help="where the heads go (default: beside the target, in --target)")
    ap.add_argument("--heads", type=int, default=4, help="K, heads (tree depth)")
    ap.add_argument("--layers", type=int, default=1, help="residual blocks per head")
    ap.add_argument("--prompts", type=int, default=768, help="training continuations")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new-tokens", type=int, default=96, help="tokens per continuation")
    ap.add_argument("--greedy-share", type=float, default=0.5, help="share of continuations decoded greedily")
    ap.add_argument("--temperature", type=float, default=0.8, help="for the sampled share")
    ap.add_argument("--eval-prompts", type=int, default=128, help="validation continuations (accuracy, tree)")
    ap.add_argument("--epochs", type=int, default=5)
    ap.add_argument("--batch", type=int, default=512)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--tree-nodes", type=int, default=32, help="size of the sparse tree written to the config")
    ap.add_argument("--minutes", type=float, default=3.0, help="time budget of the training loop")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (CPU)")
    return ap.parse_args(argv)


def frozen_target(args, device: str = "cpu"):
    """The target (fp32, no gradients: only a head beside it learns) and its tokenizer, with
    the run's seed and thread count set."""
    torch.manual_seed(args.seed)
    torch.set_num_threads(args.threads)
    model = load_model(args.target, torch.float32, device)
    for p in model.parameters():
        p.requires_grad_(False)
    return model, load_tokenizer(args.target)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.monotonic()
    model, tok = frozen_target(args)
    K, lm_head = args.heads, model.lm_head.weight
    n_greedy = round(args.prompts * args.greedy_share)
    prompts = prompt_windows("train", args.prompts, args.prompt_len, tok, args.seed)
    parts = [continuations(model, prompts[:n_greedy], args.new_tokens, 0.0, args.seed, desc="greedy continuations"),
             continuations(model, prompts[n_greedy:], args.new_tokens, args.temperature, args.seed,
                           desc="sampled continuations")]
    h, labels = map(torch.cat, zip(*(head_pairs(hh, yy, K) for hh, yy in parts if len(hh))))
    val = prompt_windows("val", args.eval_prompts, args.prompt_len, tok, args.seed + 1)
    eh, el = head_pairs(*continuations(model, val, args.new_tokens, 0.0, args.seed, desc="validation continuations"), K)
    heads = MedusaHeads(model.shape.hidden, K, args.layers)
    before = accuracy(label_ranks(heads, lm_head, eh, el))
    losses = train(heads, lm_head, h, labels, args)
    ranks = label_ranks(heads, lm_head, eh, el)
    acc = accuracy(ranks)
    for k, (a0, a) in enumerate(zip(before, acc), start=1):
        print(f"head {k}: top-1 {a[0]:.3f} (untrained {a0[0]:.3f}), top-{TOPK} {sum(a):.3f}")
    score = joint_score(ranks)
    tree = sparse_tree(score, K, TOPK, args.tree_nodes)
    expected = {g: round(1 + sum(score(p) for p in tree[:g]), 3) for g in (1, 2, 4, 8, 16, 32) if g <= len(tree)}
    print(f"sparse tree of {len(tree)} nodes; expected tokens per greedy step by gamma: {expected}")
    meta = {"tree": tree, "expected_tokens_per_step": expected,
            "head_accuracy_top_i": [[round(x, 4) for x in a] for a in acc],
            "untrained_accuracy_top_i": [[round(x, 4) for x in a] for a in before],
            "training": {"positions": len(h), "eval_positions": len(eh), "final_loss": round(sum(losses[-20:]) / len(losses[-20:]), 4),
                         "steps": len(losses), "seconds": round(time.monotonic() - t0, 1),
                         **{k: v for k, v in vars(args).items() if k not in ("target", "out", "threads")}}}
    path = heads.save(args.out or args.target, meta)
    print(f"wrote {path} ({path.stat().st_size / 1e6:.2f} MB) and {CONFIG_FILE}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
