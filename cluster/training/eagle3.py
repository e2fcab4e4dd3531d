"""Train an EAGLE-3 head on a frozen target, with the training-time test (Li et al., 2025).

    spec-cluster models train-eagle3 --target cluster/models/demo/target

1. Sequences: windows of the stdlib training split (training.demo's md5 rule, the held-out
   benchmark prompts never seen) continued by the target itself, greedily for a share and
   sampled for the rest, so the head learns what the target says. One more target pass over
   each whole sequence keeps, at every position, the aux hidden states (the inputs of the
   three chosen layers, what serving captures) and the target's logits.
2. Draft vocabulary: the `--draft-vocab` ids the target emits most (default all of a small
   vocabulary, 32,000 of a large one); d2t/t2d map them.
3. The head starts from the target where shapes agree (lm_head rows of the draft vocabulary,
   the final norm; the embedding is the target's, shared and frozen, as serving shares it).
4. Training-time test: step 0 runs the head over every position p, fed fc(aux_p) and token
   t_{p+1}, causally; step j > 0 feeds each position its own step j-1 output and token
   t_{p+j+1}, and its query sees the target-fed keys up to p plus the keys its own chain wrote
   at steps 1..j (the diagonal), which is what drafting j tokens ahead sees. The loss at each
   step is the cross-entropy against the target's distribution at that position over the
   draft vocabulary, weighted 0.8^j.
5. Validation sequences (md5 % 20 == 1) give each step's top-1 agreement with the target's
   argmax; the head is written beside the target (`<target>/eagle3`, the original release's
   layout) with those figures under `spec_cluster` in its config.json.
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from cluster.engine.drafters.eagle3_head import Eagle3Head, HeadConfig
from cluster.engine.drafters.eagle3_load import default_aux_layers, load_head, save_head
from cluster.engine.scheduling.kv_cache import KVCache
from cluster.engine.worker.runner import Runner
from cluster.training.medusa import DEMO_TARGET, continuations, frozen_target, prompt_windows

OUT_DIR = "eagle3"  # beside the target (cluster.serve.build.EAGLE3_DIR)


def pick_aux_layers(layers: int) -> tuple[int, ...]:
    """vLLM's low/middle/high where they are three layers; evenly spread where they repeat
    (a shallow target: 6 layers give (2, 3, 3))."""
    ids = default_aux_layers(layers)
    return ids if len(set(ids)) == 3 else (1, layers // 2, layers - 1)


@torch.inference_mode()
def features(model, seqs: torch.Tensor, ids: torch.Tensor, batch: int = 64):
    """(sequences [N, T], aux hidden states [N, T, A], the target's logits on the draft
    vocabulary [N, T, Vd] (both bf16: memory), the target's argmax [N, T])."""
    s, (N, T) = model.shape, seqs.shape
    dev = next(model.parameters()).device
    seqs, ids = seqs.to(dev), ids.to(dev)
    auxs, logits, top = [], [], []
    for i in tqdm(range(0, N, batch), desc="target features", leave=False):
        chunk = seqs[i:i + batch]
        kv = KVCache.dense(s.layers, len(chunk), T + 1, s.kv_heads, s.head_dim, torch.float32, dev)
        lg, _, aux = Runner(model, kv, "sdpa").forward(list(range(len(chunk))), [0] * len(chunk), chunk.tolist(),
                                                        last_only=False, aux=True)
        auxs.append(aux.to(torch.bfloat16))
        logits.append(lg[..., ids].to(torch.bfloat16))
        top.append(lg.argmax(-1))
    return seqs, torch.cat(auxs), torch.cat(logits), torch.cat(top)


def draft_vocab(seqs: torch.Tensor, vocab: int, size: int) -> tuple[torch.Tensor, float]:
    """The `size` most frequent ids (sorted) and the share of tokens they cover."""
    counts = torch.bincount(seqs.flatten(), minlength=vocab)
    ids = counts.topk(min(size, vocab)).indices.sort().values
    return ids, (counts[ids].sum() / counts.sum()).item()


def new_head(model, aux_layers: tuple[int, ...], ids: torch.Tensor) -> Eagle3Head:
    from transformers import LlamaConfig

    s = model.shape
    hf = LlamaConfig(**{k: v for k, v in model.config.to_dict().items() if k not in ("architectures", "model_type")})
    hf.num_hidden_layers = 1
    hc = HeadConfig(s.hidden, s.heads, s.kv_heads, s.head_dim, s.intermediate, s.eps, s.vocab_size, len(ids),
                    s.hidden, aux_layers, max_positions=s.max_positions)
    head = Eagle3Head(hc, hf)
    with torch.no_grad():
        head.embed_tokens.weight = model.embed_tokens.weight  # shared and frozen, as in serving
        head.lm_head.weight.copy_(model.lm_head.weight[ids])
        head.norm.weight.copy_(model.norm.weight)
        head.d2t.copy_(ids.cpu() - torch.arange(len(ids)))
        head.fc.weight.mul_(0.5)
    return head


def _attend(q, keys0, vals0, diag_k, diag_v) -> torch.Tensor:
    """q [B, T, H, d] over the target-fed keys [B, T, Hkv, d] up to its own position (causal)
    and, per query, its own chain's keys of the earlier steps (diag_*: lists of [B, T, Hkv, d])."""
    B, T, H, d = q.shape
    rep = H // keys0.shape[2]
    qh = q.transpose(1, 2)                                                 # [B, H, T, d]
    k0 = keys0.repeat_interleave(rep, 2).transpose(1, 2)
    v0 = vals0.repeat_interleave(rep, 2).transpose(1, 2)
    scores = qh @ k0.transpose(-1, -2) / math.sqrt(d)                      # [B, H, T, T]
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    dk = [k.repeat_interleave(rep, 2).transpose(1, 2) for k in diag_k]     # each [B, H, T, d]
    dv = [v.repeat_interleave(rep, 2).transpose(1, 2) for v in diag_v]
    diag = [(qh * k).sum(-1, keepdim=True) / math.sqrt(d) for k in dk]     # each [B, H, T, 1]
    p = torch.softmax(torch.cat([scores] + diag, -1), -1)
    out = p[..., :T] @ v0
    for i, v in enumerate(dv):
        out = out + p[..., T + i: T + i + 1] * v
    return out.transpose(1, 2).reshape(B, T, H * d)


def ttt_losses(head: Eagle3Head, tokens, aux, target_logits, target_top, steps: int, ids: torch.Tensor):
    """Per step j: (loss, top-1 agreement with the target's argmax) over the valid positions.
    tokens [B, T], aux [B, T, A], target_logits [B, T, Vd] (on the draft vocabulary),
    target_top [B, T] (the target's argmax over its whole vocabulary)."""
    B, T = tokens.shape
    P = T - 1                                                  # positions 0 .. T-2 have a next token
    pos = torch.arange(P, device=tokens.device)
    x = head.combine(aux[:, :P].float())
    keys0 = vals0 = None
    diag_k, diag_v, out = [], [], []
    for j in range(steps):
        at = (pos + j + 1).clamp(max=T - 1)                    # token fed, and where the label is
        q, k, v, res = head.project(tokens[:, at], x, (pos + j)[None].expand(B, -1))
        if j == 0:
            keys0, vals0 = k, v
            attn = _attend(q, k, v, [], [])
        else:
            diag_k.append(k)
            diag_v.append(v)
            attn = _attend(q, keys0, vals0, diag_k, diag_v)
        x = head.finish(attn, res)
        logp = torch.log_softmax(head.logits(x), -1)           # [B, P, Vd]
        p_t = torch.softmax(target_logits[:, at].float(), -1)  # the target's distribution on the draft vocab
        valid = (pos + j + 1 <= T - 1).float()[None].expand(B, -1)
        loss = (-(p_t * logp).sum(-1) * valid).sum() / valid.sum()
        agree = ((ids[logp.argmax(-1)] == target_top[:, at]).float() * valid).sum() / valid.sum()
        out.append((loss, agree))
    return out


def make_sequences(model, tok, split: str, n: int, args, seed: int) -> torch.Tensor:
    """[n, prompt_len + new_tokens]: windows of a split, continued by the target."""
    prompts = prompt_windows(split, n, args.prompt_len, tok, seed)
    n_greedy = round(n * args.greedy_share) if split == "train" else n
    batch = 1024 if args.device.startswith("cuda") else 128  # a GPU steps 1024 rows about as fast as 128
    parts = []
    for chunk, temp in ((prompts[:n_greedy], 0.0), (prompts[n_greedy:], args.temperature)):
        if chunk:
            _, y = continuations(model, chunk, args.new_tokens, temp, seed, batch, desc=f"{split} continuations")
            parts.append(torch.cat([torch.tensor(chunk), y.cpu()], 1))
    return torch.cat(parts)


def train(head, data, ids, args) -> list[float]:
    seqs, aux, logits, top = data
    params = [p for n, p in head.named_parameters() if n != "embed_tokens.weight"]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)
    steps = args.epochs * math.ceil(len(seqs) / args.batch)
    start, budget = time.monotonic(), 60 * args.minutes
    # cosine decay over the steps or the time budget, whichever runs out first (a shared CPU
    # makes the number of steps a time budget allows unknowable in advance)
    done = lambda i: min(1.0, max(i / steps, (time.monotonic() - start) / budget))  # noqa: E731
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: min(1.0, (i + 1) / 30) * 0.5 * (1 + math.cos(math.pi * done(i))))
    gen = torch.Generator().manual_seed(args.seed)
    deadline = start + budget
    losses, bar = [], tqdm(total=steps, desc="train eagle3 head", unit="step")
    head.train()
    for step in range(steps):
        idx = torch.randint(0, len(seqs), (args.batch,), generator=gen).to(seqs.device)
        per_step = ttt_losses(head, seqs[idx], aux[idx], logits[idx], top[idx], args.ttt_steps, ids)
        loss = sum(0.8 ** j * l for j, (l, _) in enumerate(per_step))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        losses.append(loss.item())
        bar.update()
        bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}",
                        acc0=f"{per_step[0][1].item():.2f}", accN=f"{per_step[-1][1].item():.2f}")
        if time.monotonic() > deadline:
            tqdm.write(f"time budget reached at step {step + 1}/{steps}")
            break
    bar.close()
    head.eval()
    return losses


@torch.no_grad()
def evaluate(head, data, ids, steps: int, batch: int = 32) -> list[float]:
    """Top-1 agreement with the target per draft step, over every validation position."""
    tot = [0.0] * steps
    seqs = data[0]
    for i in range(0, len(seqs), batch):
        for j, (_, a) in enumerate(ttt_losses(head, *(t[i:i + batch] for t in data), steps, ids)):
            tot[j] += a.item() * len(seqs[i:i + batch])
    return [round(t / len(seqs), 4) for t in tot]


def parse_args(argv):
    ap = argparse.ArgumentParser(prog="spec-cluster models train-eagle3", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=str(DEMO_TARGET), help="target HF model directory")
    ap.add_argument("--out", help=f"head directory (default: {OUT_DIR}/ beside the target)")
    ap.add_argument("--aux-layers", help="target layers feeding fc, e.g. 1,3,5 (default: low/middle/high)")
    ap.add_argument("--init", help="continue training this head (its aux layers, draft vocabulary and weights): "
                    "a run longer than one time budget, on fresh sequences with another --seed")
    ap.add_argument("--draft-vocab", type=int, help="draft vocabulary size (d2t/t2d; default: the target's, up to "
                    "32,000 as in the EAGLE-3 releases: a smaller one caps acceptance at its coverage)")
    ap.add_argument("--prompts", type=int, default=512, help="training sequences")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=96, help="target tokens continuing each prompt")
    ap.add_argument("--greedy-share", type=float, default=0.5, help="share of continuations decoded greedily")
    ap.add_argument("--temperature", type=float, default=0.8, help="for the sampled share")
    ap.add_argument("--eval-prompts", type=int, default=64)
    ap.add_argument("--ttt-steps", type=int, default=4, help="draft steps of the training-time test")
    ap.add_argument("--epochs", type=int, default=8)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--minutes", type=float, default=5.0, help="time budget of the training loop")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2, help="torch threads (CPU)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (the target and the head, fp32)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.monotonic()
    if args.device.startswith("cuda"):
        torch.set_float32_matmul_precision("high")  # TF32: the head learns as well, several times faster
    model, tok = frozen_target(args, args.device)
    s = model.shape
    head = (load_head(args.init, s.layers, torch.float32, args.device, model.embed_tokens.weight, s.vocab_size,
                      s.max_positions) if args.init else None)
    aux_layers = (head.cfg.aux_layers if head else tuple(int(x) for x in args.aux_layers.split(",")) if args.aux_layers
                  else pick_aux_layers(s.layers))
    model.aux_layers = aux_layers
    args.draft_vocab = args.draft_vocab or min(s.vocab_size, 32000)
    seqs = make_sequences(model, tok, "train", args.prompts, args, args.seed)
    ids, coverage = draft_vocab(seqs, s.vocab_size, args.draft_vocab)
    if head:  # its own draft vocabulary, and what it covers of these sequences
        ids = head.target_ids(torch.arange(head.cfg.draft_vocab, device=args.device)).sort().values
        counts = torch.bincount(seqs.flatten(), minlength=s.vocab_size)
        coverage = (counts[ids.cpu()].sum() / counts.sum()).item()
    ids = ids.to(args.device)
    data = features(model, seqs, ids)
    val = features(model, make_sequences(model, tok, "val", args.eval_prompts, args, args.seed + 1), ids)
    head = head or new_head(model, aux_layers, ids).to(args.device)
    before = evaluate(head, val, ids, args.ttt_steps)
    losses = train(head, data, ids, args)
    acc = evaluate(head, val, ids, args.ttt_steps)
    print(f"top-1 agreement with the target by draft step: {acc} (untrained {before}); "
          f"draft vocab {len(ids)} covers {coverage:.3f} of the target's tokens")
    meta = {"aux_layers": list(aux_layers), "validation_top1_by_step": acc, "untrained_top1_by_step": before,
            "draft_vocab_coverage": round(coverage, 4),
            "training": {"sequences": len(data[0]), "steps": len(losses), "final_loss": round(sum(losses[-20:]) / len(losses[-20:]), 4),
                         "seconds": round(time.monotonic() - t0, 1),
                         **{k: v for k, v in vars(args).items() if k not in ("target", "out", "threads")}}}
    if args.init:  # what the head it continued had been through, and its figures then
        import json

        before = json.loads((Path(args.init) / "config.json").read_text()).get("spec_cluster", {})
        meta["training_before"] = before.get("training", {}) | {"validation_top1_by_step": before.get("validation_top1_by_step")}
    out = Path(args.out or Path(args.target) / OUT_DIR)
    path = save_head(head.cpu(), out, meta)
    print(f"wrote {path} ({path.stat().st_size / 1e6:.2f} MB) and {out / 'config.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
