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
import hashlib
import json
import math
import os
import random
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

EOS = "<|endoftext|>"
VOCAB_SIZE = 4096
SEQ_LEN = 512
MAX_FILE_BYTES = 1_000_000
MAX_TOTAL_BYTES = 15_000_000
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
# data
# --------------------------------------------------------------------------


def is_held_out(rel_path: str) -> bool:
    """The held-out rule: 1 file in 20, by the md5 of its stdlib-relative path."""
    return int(hashlib.md5(rel_path.encode()).hexdigest(), 16) % 20 == 0


def is_validation(rel_path: str) -> bool:
    """Another 1 file in 20 (never a held-out one), kept out of training for model selection."""
    return int(hashlib.md5(rel_path.encode()).hexdigest(), 16) % 20 == 1


def stdlib_files(root: str | None = None) -> dict[str, list[tuple[str, str]]]:
    """{"train", "val", "held"} lists of (relative_path, text), sorted by path."""
    root = root or sysconfig.get_paths()["stdlib"]
    split: dict[str, list[tuple[str, str]]] = {"train": [], "val": [], "held": []}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d != "site-packages" and d != "__pycache__")
        for name in sorted(filenames):
            if not name.endswith(".py"):
                continue
            path = os.path.join(dirpath, name)
            rel = os.path.relpath(path, root).replace(os.sep, "/")
            try:
                if os.path.getsize(path) > MAX_FILE_BYTES:
                    continue
                text = Path(path).read_bytes().decode("utf-8")
            except (OSError, UnicodeDecodeError):
                continue
            if EOS in text or not text.strip():
                continue
            key = "held" if is_held_out(rel) else "val" if is_validation(rel) else "train"
            split[key].append((rel, text))
    for v in split.values():
        v.sort()
    return split


def train_tokenizer(texts: list[str]):
    """Byte-level BPE (GPT-2 style pre-tokenizer, no prefix space) -> PreTrainedTokenizerFast."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=[EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(tqdm(texts, desc="tokenizer: train BPE", unit="file"), trainer=trainer, length=len(texts))
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=EOS,
        eos_token=EOS,
        pad_token=EOS,
        clean_up_tokenization_spaces=False,
        model_max_length=2048,
    )
    return fast


def encode_docs(tokenizer, texts: list[str], desc: str) -> torch.Tensor:
    """Token ids of all texts, each followed by the EOS separator, as one int32 tensor."""
    backend = tokenizer.backend_tokenizer
    eos_id = tokenizer.convert_tokens_to_ids(EOS)
    ids: list[int] = []
    batch = 64
    with tqdm(total=len(texts), desc=desc, unit="file") as bar:
        for i in range(0, len(texts), batch):
            for enc in backend.encode_batch(texts[i : i + batch], add_special_tokens=False):
                ids.extend(enc.ids)
                ids.append(eos_id)
            bar.update(len(texts[i : i + batch]))
    return torch.tensor(ids, dtype=torch.int32)


def check_roundtrip(tokenizer, texts: list[str]) -> None:
    samples = [
        "def f(x):\n    return x  # comment\n\n\tif a:\n        pass\n",
        "  leading  spaces\r\n\n\n  x = {'a': [1, 2]}  \n",
        "é ü ∑ 中文 \"\"\"doc\"\"\"\n",
    ] + [t[:3000] for t in texts[:20]]
    for s in samples:
        ids = tokenizer.encode(s, add_special_tokens=False)
        back = tokenizer.decode(ids)
        if back != s:
            raise RuntimeError(f"tokenizer round-trip failed for {s[:80]!r} -> {back[:80]!r}")


# --------------------------------------------------------------------------
# models
# --------------------------------------------------------------------------


def make_config(arch: dict, eos_id: int):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=VOCAB_SIZE,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
        bos_token_id=eos_id,
        eos_token_id=eos_id,
        pad_token_id=eos_id,
        hidden_act="silu",
        attention_bias=False,
        mlp_bias=False,
        **arch,
    )


def make_model(arch: dict, eos_id: int, device: str):
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM(make_config(arch, eos_id))
    model.tie_weights()
    return model.to(device=device, dtype=torch.float32)


def add_residual_dropout(model, p: float) -> None:
    """Dropout on each attention/MLP output before the residual add (active in train mode only).

    Forward hooks, so the saved model is a plain LlamaForCausalLM."""
    if p <= 0:
        return

    def hook(module, inputs, output):
        if not module.training:
            return output
        if isinstance(output, tuple):
            return (F.dropout(output[0], p, True),) + tuple(output[1:])
        return F.dropout(output, p, True)

    for layer in model.model.layers:
        layer.self_attn.register_forward_hook(hook)
        layer.mlp.register_forward_hook(hook)


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())  # tied weights counted once


def batches(tokens: torch.Tensor, batch_size: int, gen: torch.Generator, aligned: bool = False):
    """Endless random (input, label) windows of SEQ_LEN tokens from a token stream.

    ``aligned``: the stream is a stack of SEQ_LEN + 1 token sequences; take whole ones."""
    n = tokens.numel() - SEQ_LEN - 1
    ar = torch.arange(SEQ_LEN + 1, device=tokens.device)
    while True:
        if aligned:
            starts = torch.randint(0, tokens.numel() // (SEQ_LEN + 1), (batch_size,), generator=gen) * (SEQ_LEN + 1)
        else:
            starts = torch.randint(0, n, (batch_size,), generator=gen)
        starts = starts.to(tokens.device)
        win = tokens[starts[:, None] + ar[None, :]].long()
        yield win[:, :-1], win[:, 1:]


def distill_loss(logits: torch.Tensor, t_logits: torch.Tensor) -> torch.Tensor:
    """KL(teacher || student), mean over positions."""
    t_logp = F.log_softmax(t_logits.float(), dim=-1)
    d_logp = F.log_softmax(logits.float(), dim=-1)
    return (t_logp.exp() * (t_logp - d_logp)).sum(-1).mean()


@torch.no_grad()
def val_metrics(model, val: torch.Tensor, use_amp: bool, teacher=None, chunks: int = 32) -> dict:
    """Validation perplexity, and with a teacher the KL and top-1 agreement with it."""
    was_training = model.training
    model.eval()
    n_chunks = min(chunks, (val.numel() - 1) // SEQ_LEN)
    nll = kl = agree = 0.0
    n = 0
    for i in range(0, n_chunks, 16):
        idx = torch.arange(i, min(n_chunks, i + 16), device=val.device)
        win = val[idx[:, None] * SEQ_LEN + torch.arange(SEQ_LEN + 1, device=val.device)[None, :]].long()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=use_amp):
            logits = model(input_ids=win[:, :-1]).logits.float()
            nll += F.cross_entropy(logits.reshape(-1, logits.size(-1)), win[:, 1:].reshape(-1), reduction="sum").item()
            if teacher is not None:
                t_logits = teacher(input_ids=win[:, :-1]).logits.float()
                kl += distill_loss(logits, t_logits).item() * win[:, 1:].numel()
                agree += (logits.argmax(-1) == t_logits.argmax(-1)).sum().item()
        n += win[:, 1:].numel()
    model.train(was_training)
    out = {"ppl": math.exp(nll / max(1, n))}
    if teacher is not None:
        out["kl"] = kl / max(1, n)
        out["agree"] = agree / max(1, n)
    return out


def train_loop(
    name: str,
    model,
    tokens: torch.Tensor,
    *,
    steps: int,
    batch_size: int,
    lr: float,
    minutes: float | None,
    device: str,
    seed: int,
    val: torch.Tensor,
    teacher=None,
    ce_weight: float = 0.1,
    extra_tokens: torch.Tensor | None = None,
    extra_frac: float = 0.0,
    eval_every: int = 200,
) -> dict:
    """AdamW + linear warmup + cosine decay; plain CE, or distillation when ``teacher`` is given.

    Every ``eval_every`` steps the model is scored on the validation split
    (perplexity for the target, KL to the teacher for the drafter) and the
    best weights are kept: with a few MB of source the models overfit in a
    few epochs, and this keeps the best point of the run.  ``extra_tokens``
    (target-generated text) replace a fraction ``extra_frac`` of the batches.
    """
    use_amp = device.startswith("cuda")
    decay, no_decay = [], []
    for n, p in model.named_parameters():
        (decay if p.ndim >= 2 else no_decay).append(p)
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.95),
        eps=1e-8,
        fused=use_amp,
    )
    total = {"steps": max(1, steps)}
    warmup = max(1, min(200, total["steps"] // 20))

    def lr_at(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        t = min(1.0, (step - warmup) / max(1, total["steps"] - warmup))
        return 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * t))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    gen = torch.Generator().manual_seed(seed)
    data = batches(tokens, batch_size, gen)
    extra = batches(extra_tokens, batch_size, gen, aligned=True) if extra_tokens is not None and extra_frac > 0 else None
    pick = random.Random(seed)
    model.train()
    t0 = time.time()
    budget = minutes * 60 if minutes else None
    bar = tqdm(total=total["steps"], desc=f"train {name}", unit="step", mininterval=2.0)
    step, ema, t20 = 0, None, t0
    curve: list[dict] = []
    best: dict = {"score": float("inf"), "step": 0, "state": None}

    def score_now() -> None:
        m = val_metrics(model, val, use_amp, teacher)
        score = m["kl"] if teacher is not None else math.log(m["ppl"])
        curve.append({"step": step, **{k: round(v, 4) for k, v in m.items()}})
        if score < best["score"]:
            best.update(score=score, step=step, state={k: v.detach().clone() for k, v in model.state_dict().items()})
        tqdm.write(f"{name} step {step}: val {', '.join(f'{k} {v:.4f}' for k, v in m.items())}"
                   f" (train loss ema {ema if ema is not None else float('nan'):.3f})")

    while step < total["steps"]:
        src = extra if extra is not None and pick.random() < extra_frac else data
        x, y = next(src)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=use_amp):
            logits = model(input_ids=x).logits.float()
            ce = F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1))
            if teacher is not None:
                with torch.no_grad():
                    t_logits = teacher(input_ids=x).logits.float()
                loss = distill_loss(logits, t_logits) + ce_weight * ce
            else:
                loss = ce
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        step += 1
        bar.update(1)
        if step % 20 == 0 or step == total["steps"]:
            val_ = loss.item()
            ema = val_ if ema is None else 0.9 * ema + 0.1 * val_
            bar.set_postfix({"loss": f"{ema:.3f}", "ce": f"{ce.item():.3f}", "lr": f"{sched.get_last_lr()[0]:.2e}"})
            if step == 20:
                t20 = time.time()
            if budget is not None and step == 60:
                # Fit the schedule to the time budget from the measured step time (warm-up excluded).
                per_step = (time.time() - t20) / 40
                fit = int(20 + (budget - (t20 - t0)) / per_step)
                if fit < total["steps"]:
                    total["steps"] = max(step + 1, fit)
                    bar.total = total["steps"]
                    bar.refresh()
        if step % eval_every == 0 or step == total["steps"]:
            score_now()
        if budget is not None and time.time() - t0 > budget * 1.05:
            score_now()
            break
    bar.close()
    elapsed = time.time() - t0
    if best["state"] is not None:
        model.load_state_dict(best["state"])
    model.eval()
    return {
        "steps": step,
        "best_step": best["step"],
        "batch_size": batch_size,
        "seq_len": SEQ_LEN,
        "tokens_seen": step * batch_size * SEQ_LEN,
        "epochs": round(step * batch_size * SEQ_LEN / max(1, tokens.numel()), 2),
        "lr": lr,
        "seconds": round(elapsed, 1),
        "final_loss_ema": round(ema, 4) if ema is not None else None,
        "val_curve": curve,
    }


@torch.no_grad()
def sample_from(model, prompts: torch.Tensor, new_tokens: int, temperature: float, seed: int) -> torch.Tensor:
    """Sample continuations with the KV cache; returns prompts + continuations as one int32 stream."""
    use_amp = prompts.is_cuda
    gen = torch.Generator(device=prompts.device).manual_seed(seed)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=use_amp):
        out = model(input_ids=prompts, use_cache=True)
        past, seq = out.past_key_values, [prompts]
        for _ in range(new_tokens):
            probs = torch.softmax(out.logits[:, -1].float() / temperature, dim=-1)
            nxt = torch.multinomial(probs, 1, generator=gen)
            seq.append(nxt)
            out = model(input_ids=nxt, past_key_values=past, use_cache=True)
            past = out.past_key_values
    return torch.cat(seq, dim=1).reshape(-1).to(torch.int32)


def generate_distill_data(target, tokens: torch.Tensor, n_seqs: int, seed: int, temperature: float, batch: int = 512) -> torch.Tensor:
    """Target-written text for distillation: 32 training tokens of prompt, then SEQ_LEN - 32 sampled."""
    gen = torch.Generator().manual_seed(seed + 99)
    prompt_len = 32
    chunks = []
    for i in tqdm(range(0, n_seqs, batch), desc="target samples for distillation", mininterval=2.0):
        b = min(batch, n_seqs - i)
        starts = torch.randint(0, tokens.numel() - prompt_len, (b,), generator=gen).to(tokens.device)
        prompts = tokens[starts[:, None] + torch.arange(prompt_len, device=tokens.device)[None, :]].long()
        chunks.append(sample_from(target, prompts, SEQ_LEN + 1 - prompt_len, temperature, seed + i))
    return torch.cat(chunks)


# --------------------------------------------------------------------------
# evaluation
# --------------------------------------------------------------------------


@torch.no_grad()
def perplexity(model, tokens: torch.Tensor, max_chunks: int, batch: int = 32) -> tuple[float, int]:
    n_chunks = min(max_chunks, (tokens.numel() - 1) // SEQ_LEN)
    total_nll, total_n = 0.0, 0
    for i in range(0, n_chunks, batch):
        idx = torch.arange(i, min(n_chunks, i + batch), device=tokens.device)
        win = tokens[idx[:, None] * SEQ_LEN + torch.arange(SEQ_LEN + 1, device=tokens.device)[None, :]].long()
        logits = model(input_ids=win[:, :-1]).logits.float()
        nll = F.cross_entropy(logits.reshape(-1, logits.size(-1)), win[:, 1:].reshape(-1), reduction="sum")
        total_nll += nll.item()
        total_n += win[:, 1:].numel()
    return math.exp(total_nll / max(1, total_n)), total_n


@torch.no_grad()
def greedy_generate(model, prompts: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """KV-less greedy continuation of equal-length prompts: (B, P) -> (B, new_tokens)."""
    seq = prompts
    for _ in range(new_tokens):
        nxt = model(input_ids=seq).logits[:, -1].argmax(-1, keepdim=True)
        seq = torch.cat([seq, nxt], dim=1)
    return seq[:, prompts.size(1) :]


def simulate_acceptance(matches: list[list[bool]], gamma: int) -> dict:
    """Greedy speculative decoding against a reference greedy continuation.

    ``matches[b][k]`` says whether the drafter's greedy token after
    ``prompt + ref[:k]`` equals ``ref[k]``.  With greedy drafting and greedy
    verification, a drafted token is accepted only if all earlier drafted tokens
    in the step matched, so every accepted token was proposed from a prefix of
    the reference, and the number accepted from position ``k`` is the run of
    consecutive matches from ``k``, capped at gamma.  Each verify step then
    emits one more target token (the correction, or the bonus token).
    """
    drafted = accepted = steps = 0
    for m in matches:
        pos, n = 0, len(m)
        while pos < n:
            d = min(gamma, n - pos)
            a = 0
            while a < d and m[pos + a]:
                a += 1
            drafted += d
            accepted += a
            steps += 1
            pos += a + 1
    return {
        "gamma": gamma,
        "drafted": drafted,
        "accepted": accepted,
        "verify_steps": steps,
        "acceptance_rate": round(accepted / max(1, drafted), 4),
        "mean_accepted_length": round((accepted + steps) / max(1, steps), 4),
    }


@torch.no_grad()
def explicit_spec_decode(target, draft, prompt: torch.Tensor, new_tokens: int, gamma: int, eos_id: int) -> dict:
    """Literal greedy speculative decoding (KV-less) for one prompt, as a cross-check."""
    seq = prompt[None, :]
    produced = drafted = accepted = steps = 0
    while produced < new_tokens:
        d = min(gamma, new_tokens - produced)
        prop = seq
        for _ in range(d):
            nxt = draft(input_ids=prop).logits[:, -1].argmax(-1, keepdim=True)
            prop = torch.cat([prop, nxt], dim=1)
        tgt = target(input_ids=prop).logits[0, seq.size(1) - 1 :].argmax(-1)  # d + 1 target tokens
        drafts = prop[0, seq.size(1) :]
        a = 0
        while a < d and drafts[a] == tgt[a]:
            a += 1
        out = torch.cat([drafts[:a], tgt[a : a + 1]])
        drafted += d
        accepted += a
        steps += 1
        seq = torch.cat([seq, out[None, :]], dim=1)
        produced += out.numel()
        if (out == eos_id).any():
            break
    return {"drafted": drafted, "accepted": accepted, "verify_steps": steps, "tokens": seq[0, prompt.numel() :].tolist()}


def evaluate(target, draft, tokenizer, held: torch.Tensor, device: str, seed: int, n_prompts: int, ppl_chunks: int) -> dict:
    eos_id = tokenizer.convert_tokens_to_ids(EOS)
    # Evaluate the weights as saved (bf16), computed in fp32 for stable argmaxes.
    tgt = target.to(torch.bfloat16).to(torch.float32).eval()
    drf = draft.to(torch.bfloat16).to(torch.float32).eval()
    held = held.to(device)
    report: dict = {}
    ppl_t, n_tok = perplexity(tgt, held, ppl_chunks)
    ppl_d, _ = perplexity(drf, held, ppl_chunks)
    report["heldout_tokens_for_ppl"] = n_tok
    report["target_ppl"] = round(ppl_t, 3)
    report["draft_ppl"] = round(ppl_d, 3)

    prompt_len, new_tokens = 64, 128
    n_chunks = held.numel() // SEQ_LEN
    rng = random.Random(seed + 7)
    chunk_ids = rng.sample(range(n_chunks), min(n_prompts, n_chunks))
    prompts = torch.stack([held[c * SEQ_LEN : c * SEQ_LEN + prompt_len] for c in chunk_ids]).long()
    cont = greedy_generate(tgt, prompts, new_tokens)
    seqs = torch.cat([prompts, cont], dim=1)
    d_pred = drf(input_ids=seqs).logits[:, prompt_len - 1 : -1].argmax(-1)  # draft's next token after each prefix
    match = (d_pred == cont).tolist()
    refs = cont.tolist()
    lens = []
    for b, r in enumerate(refs):
        n = r.index(eos_id) + 1 if eos_id in r else len(r)  # stop at the target's EOS
        match[b] = match[b][:n]
        lens.append(n)
    report["spec_prompts"] = len(chunk_ids)
    report["spec_prompt_len"] = prompt_len
    report["spec_max_new_tokens"] = new_tokens
    report["spec_mean_reference_len"] = round(sum(lens) / len(lens), 2)
    report["draft_top1_agreement"] = round(sum(sum(m) for m in match) / max(1, sum(lens)), 4)
    report["speculative"] = {str(g): simulate_acceptance(match, g) for g in (2, 4, 8)}

    # Cross-check the simulation against literal speculative decoding on a few prompts.
    check = []
    for b in range(min(4, len(chunk_ids))):
        ex = explicit_spec_decode(tgt, drf, prompts[b], lens[b], 4, eos_id)
        sim = simulate_acceptance([match[b]], 4)
        check.append(
            {
                "same_tokens": ex["tokens"][: lens[b]] == refs[b][: lens[b]],
                "explicit_accepted": ex["accepted"],
                "simulated_accepted": sim["accepted"],
            }
        )
    report["crosscheck_gamma4"] = check

    samples = []
    for b in range(2):
        samples.append(
            {
                "prompt": tokenizer.decode(prompts[b].tolist()),
                "continuation": tokenizer.decode(refs[b][: lens[b]]),
            }
        )
    report["samples"] = samples
    return report


# --------------------------------------------------------------------------
# saving
# --------------------------------------------------------------------------


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
