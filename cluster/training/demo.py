"""Train the demo target/drafter model pair on the Python standard library.

``spec-cluster models train-demo`` calls :func:`main`.  Everything is built
from the Python standard library's own source (``*.py`` under
``sysconfig.get_paths()['stdlib']``, ``site-packages`` skipped), which every
machine has:

1. a byte-level BPE tokenizer (vocab 4096, ``<|endoftext|>`` as bos/eos/pad
   and document separator), saved for ``AutoTokenizer.from_pretrained``;
2. a *target* ``LlamaForCausalLM`` (~5.8M params);
3. a *drafter* ``LlamaForCausalLM`` (~0.9M params) distilled on the target's
   output distribution (KL(target || draft) + a little CE).

A file is held out when ``md5(relative_path) % 20 == 0``; held-out files are
never used for the tokenizer, for training or for model selection.  Files with
``md5 % 20 == 1`` form a validation split, also kept out of training, on which
the best checkpoint of each run is chosen (the stdlib is only ~3M tokens where
the test suite is not installed, and the target overfits within ~10 epochs).

Reference run (H200, ~4 min): ``python3 -m cluster.training.demo --out DIR --minutes 4``.  The evaluation (held-out
perplexity and greedy speculative acceptance at gamma 2/4/8) is written to
``<out>/REPORT.json``.

Only torch, transformers, tokenizers, safetensors, tqdm and the standard
library are imported, so it runs on a bare GPU machine.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import sysconfig
import time
from pathlib import Path

import torch

from cluster.training.demo_data import (EOS, MAX_TOTAL_BYTES, SEQ_LEN, check_roundtrip, encode_docs, stdlib_files,
                                        train_tokenizer)
from cluster.training.demo_eval import evaluate
from cluster.training.demo_models import (add_residual_dropout, generate_distill_data, make_model, n_params,
                                          train_loop)

MAX_FILE_SAFETENSORS = 16 * 1024 * 1024

TARGET_ARCH = dict(
    hidden_size=256,
    num_hidden_layers=6,
    num_attention_heads=8,
    num_key_value_heads=4,
    intermediate_size=768,
)
DRAFT_ARCH = dict(
    hidden_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=384,
)

# --------------------------------------------------------------------------
# saving
# --------------------------------------------------------------------------


# The demo pair are code-completion models, not chat models: role tags made the target answer
# "<html>" repeated. The messages' text, turns on lines of their own, is the code to continue,
# so /v1/chat/completions answers as /v1/completions does (README's chat example)
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% if not loop.last %}\n{% endif %}{% endfor %}"


def save_model(model, tokenizer, out_dir: Path, eos_id: int) -> None:
    from transformers import GenerationConfig

    out_dir.mkdir(parents=True, exist_ok=True)
    model = model.to(torch.bfloat16)
    try:
        model.save_pretrained(out_dir, safe_serialization=True)
    except TypeError:  # transformers versions without the argument always write safetensors
        model.save_pretrained(out_dir)
    # Older readers (transformers 4.x, other engines) look for these keys.
    cfg_path = out_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg.setdefault("torch_dtype", "bfloat16")
    cfg.setdefault("dtype", "bfloat16")
    cfg.setdefault("rope_theta", 10000.0)
    cfg.setdefault("rope_scaling", None)
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    GenerationConfig(bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id).save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    # transformers 5 writes its own backend class name; 4.x only knows this one (5.x maps it back).
    tc_path = out_dir / "tokenizer_config.json"
    tc = json.loads(tc_path.read_text())
    tc["tokenizer_class"] = "PreTrainedTokenizerFast"
    tc["chat_template"] = CHAT_TEMPLATE  # so the OpenAI chat endpoint can render messages
    tc_path.write_text(json.dumps(tc, indent=2) + "\n")
    if not list(out_dir.glob("*.safetensors")):
        raise RuntimeError(f"no safetensors file written in {out_dir}")


def check_sizes(out: Path) -> dict:
    sizes = {}
    for p in sorted(out.rglob("*")):
        if p.is_file():
            sizes[str(p.relative_to(out))] = p.stat().st_size
            if p.suffix == ".safetensors" and p.stat().st_size >= MAX_FILE_SAFETENSORS:
                raise RuntimeError(f"{p} is {p.stat().st_size} bytes (limit 16 MiB)")
    total = sum(sizes.values())
    if total > MAX_TOTAL_BYTES:
        raise RuntimeError(f"model files total {total} bytes (limit {MAX_TOTAL_BYTES})")
    return {"total_bytes": total, "files": sizes}


# --------------------------------------------------------------------------
# main
# --------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="spec-cluster models train-demo",
        description="Train the demo target/drafter pair (byte-level BPE + Llama) on the Python stdlib source.",
    )
    ap.add_argument("--out", default="cluster/models/demo", help="output dir (target/, draft/, REPORT.json)")
    ap.add_argument("--steps", type=int, default=None, help="target training steps (default: from --epochs)")
    ap.add_argument("--draft-steps", type=int, default=None, help="drafter distillation steps (default: from --draft-epochs)")
    ap.add_argument("--epochs", type=float, default=20.0, help="target epochs over the training tokens, if --steps is not given")
    ap.add_argument("--draft-epochs", type=float, default=30.0, help="drafter epochs, if --draft-steps is not given")
    ap.add_argument("--batch-size", type=int, default=32, help="sequences of 512 tokens per step")
    ap.add_argument("--lr", type=float, default=2e-3, help="peak learning rate of the target")
    ap.add_argument("--draft-lr", type=float, default=3e-3, help="peak learning rate of the drafter")
    ap.add_argument("--dropout", type=float, default=0.1, help="residual dropout while training the target")
    ap.add_argument("--gen-seqs", type=int, default=4096, help="target-sampled sequences to distill on (0: none)")
    ap.add_argument("--gen-frac", type=float, default=0.5, help="fraction of drafter batches from target samples")
    ap.add_argument("--gen-temperature", type=float, default=0.8, help="sampling temperature of those samples")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--minutes", type=float, default=None, help="time budget per model (fits the schedule; drafter gets half)")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--prompts", type=int, default=64, help="held-out prompts for the acceptance evaluation")
    ap.add_argument("--ppl-chunks", type=int, default=256, help="held-out 512-token chunks for perplexity")
    ap.add_argument("--stdlib", default=None, help="stdlib dir (default: this interpreter's)")
    ap.add_argument("--max-files", type=int, default=None, help="use only the first N training files (smoke tests)")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    if args.device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    out = Path(args.out)
    t_start = time.time()

    root = args.stdlib or sysconfig.get_paths()["stdlib"]
    split = stdlib_files(root)
    if args.max_files:
        split["train"] = split["train"][: args.max_files]
        split["val"] = split["val"][: max(4, args.max_files // 10)]
        split["held"] = split["held"][: max(4, args.max_files // 10)]
    print(
        f"stdlib {root}: {len(split['train'])} training, {len(split['val'])} validation, "
        f"{len(split['held'])} held-out files",
        flush=True,
    )
    train_texts = [t for _, t in split["train"]]
    val_texts = [t for _, t in split["val"]]
    held_texts = [t for _, t in split["held"]]

    tokenizer = train_tokenizer(train_texts)
    check_roundtrip(tokenizer, held_texts)
    eos_id = tokenizer.convert_tokens_to_ids(EOS)
    train_tok = encode_docs(tokenizer, train_texts, "tokenize train").to(args.device)
    val_tok = encode_docs(tokenizer, val_texts, "tokenize validation").to(args.device)
    held_tok = encode_docs(tokenizer, held_texts, "tokenize held-out")
    print(
        f"tokens: train {train_tok.numel():,}, validation {val_tok.numel():,}, held-out {held_tok.numel():,}; "
        f"eos id {eos_id}",
        flush=True,
    )
    per_epoch = train_tok.numel() / (args.batch_size * SEQ_LEN)
    steps = args.steps or max(1, round(args.epochs * per_epoch))
    draft_steps = args.draft_steps or max(1, round(args.draft_epochs * per_epoch))
    eval_every = max(10, round(per_epoch / 2))

    report: dict = {
        "stdlib": root,
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else args.device,
        "seed": args.seed,
        "args": vars(args),
        "train_files": len(split["train"]),
        "val_files": len(split["val"]),
        "heldout_files": len(split["held"]),
        "train_tokens": train_tok.numel(),
        "val_tokens": val_tok.numel(),
        "heldout_tokens": held_tok.numel(),
        "bytes_per_token": round(sum(len(t.encode()) for t in train_texts) / max(1, train_tok.numel()), 3),
        "tokenizer": {"vocab_size": len(tokenizer), "bos_token_id": tokenizer.bos_token_id,
                      "eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id},
    }

    torch.manual_seed(args.seed)
    target = make_model(TARGET_ARCH, eos_id, args.device)
    add_residual_dropout(target, args.dropout)
    report["target_params"] = n_params(target)
    print(f"target: {report['target_params']:,} params, {steps} steps", flush=True)
    report["target_train"] = train_loop(
        "target", target, train_tok, steps=steps, batch_size=args.batch_size, lr=args.lr,
        minutes=args.minutes, device=args.device, seed=args.seed, val=val_tok, eval_every=eval_every,
    )
    report["target_train"]["objective"] = f"CE, residual dropout {args.dropout}"
    target.requires_grad_(False)
    target.eval()

    gen_tok = None
    if args.gen_seqs > 0 and args.gen_frac > 0:
        t0 = time.time()
        gen_tok = generate_distill_data(target, train_tok, args.gen_seqs, args.seed, args.gen_temperature)
        report["distill_samples"] = {"sequences": args.gen_seqs, "tokens": gen_tok.numel(),
                                     "temperature": args.gen_temperature, "seconds": round(time.time() - t0, 1)}

    torch.manual_seed(args.seed + 1)
    draft = make_model(DRAFT_ARCH, eos_id, args.device)
    report["draft_params"] = n_params(draft)
    print(f"drafter: {report['draft_params']:,} params, {draft_steps} steps", flush=True)
    draft_minutes = args.minutes / 2 if args.minutes else None
    report["draft_train"] = train_loop(
        "draft", draft, train_tok, steps=draft_steps, batch_size=args.batch_size, lr=args.draft_lr,
        minutes=draft_minutes, device=args.device, seed=args.seed + 1, val=val_tok, teacher=target,
        extra_tokens=gen_tok, extra_frac=args.gen_frac if gen_tok is not None else 0.0, eval_every=eval_every,
    )
    report["draft_train"]["objective"] = (
        "KL(target || draft) + 0.1 * CE, target frozen (eval); batches from the training split"
        + (f", {args.gen_frac:.0%} of them target-sampled continuations of training prompts" if gen_tok is not None else "")
    )

    save_model(target, tokenizer, out / "target", eos_id)
    save_model(draft, tokenizer, out / "draft", eos_id)

    report.update(evaluate(target, draft, tokenizer, held_tok, args.device, args.seed, args.prompts, args.ppl_chunks))
    report["sizes"] = check_sizes(out)
    report["total_seconds"] = round(time.time() - t_start, 1)
    (out / "REPORT.json").write_text(json.dumps(report, indent=2) + "\n")

    for i, s in enumerate(report["samples"]):
        print(f"\n===== sample {i}: prompt =====\n{s['prompt']}\n----- target greedy continuation -----\n{s['continuation']}")
    brief = {k: v for k, v in report.items() if k not in ("samples", "args")}
    for k in ("target_train", "draft_train"):
        brief[k] = {kk: vv for kk, vv in report[k].items() if kk != "val_curve"}
    print("\n" + json.dumps(brief, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
