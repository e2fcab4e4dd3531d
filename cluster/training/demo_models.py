"""Demo-pair models and their training loop: Llama configs, distillation loss,
validation, and sampling the target for the drafter's distillation data."""


import math
import random
import time

import torch
import torch.nn.functional as F
from tqdm import tqdm

from cluster.training.demo_data import SEQ_LEN, VOCAB_SIZE

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
