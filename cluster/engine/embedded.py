"""A trained small Llama embedded in a larger Llama shape: real acceptance at real size.

Random 8B weights tell time but not acceptance (no cheap drafter predicts a random network:
early-exit drafts reach 0-23%). This builds a model with the large shape (every projection,
attention head, layer and vocabulary row is there and is read each step, so a step costs
what the large model's step costs) that computes the small trained model's function, so
the small model's own trained drafter has real, measured acceptance against it.

How the function survives (x real dims = the small model's, every other dim held at 0):
- hidden: the small model's dims first; one more dim, `CONST`, holds a tiny constant `a`
  that no layer reads or writes. Norm weights are scaled by sqrt(small/large) and eps by
  small/large, so RMSNorm over the wider vector gives the small model's numbers.
- heads: small q head i goes to large q head (i // g_s) * g_l + i % g_s, so it still shares
  its kv head; head dim d (of a rotate-half pair) goes to r * d, r = D_l / D_s, so the
  large rotary table with the same theta rotates it at the same frequency; q is scaled by
  sqrt(r) for the softmax scale 1/sqrt(D_l).
- rows that write padded dims are 0 on real input columns, so padded dims stay 0 and
  the columns that read padded inputs can keep random values (the bytes are still read).
  o_proj is 0 outside the real block: an extra q head that shares a real kv head attends
  uniformly (its q is 0) and outputs the mean of real values, which must not be added.
- extra layers compute their attention and MLP on random weights, then o_proj and down_proj
  are 0: the residual passes through. Real layers are spread over the depth.
- padded vocabulary: lm_head rows are 0 on real dims and -M on CONST (the final norm scales
  CONST up), so their logits sit far below every real token's.
"""

from __future__ import annotations

import math

import torch
from transformers import LlamaConfig

from cluster.engine.model import CausalLM, ModelShape, Rotary, load_hf_model

A, FINAL_SCALE, PAD_LOGIT = 2.0**-10, 2.0**10, 2.0**14
LLAMA_8B = dict(vocab_size=128256, hidden_size=4096, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, intermediate_size=14336, max_position_embeddings=131072,
                rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False)


def random_model(cfg: LlamaConfig, device, dtype, seed: int) -> CausalLM:
    """A model of cfg's shape, weights ~ N(0, 0.02), norms 1 (only ever materialised in dtype)."""
    shape = ModelShape.from_hf(cfg)
    with torch.device("meta"):
        model = CausalLM(shape, cfg)
    model = model.to(dtype).to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.fill_(1.0) if "norm" in name else p.normal_(0, 0.02, generator=g)
    model.rotary = Rotary(cfg, shape.max_positions).to(device)
    model.config = cfg
    return model


def _maps(s: ModelShape, b: ModelShape, device):
    if b.head_dim % s.head_dim or b.heads % b.kv_heads or s.kv_heads > b.kv_heads:
        raise ValueError("large head_dim must be a multiple of the small one, and kv heads must fit")
    g_s, g_l, r = s.heads // s.kv_heads, b.heads // b.kv_heads, b.head_dim // s.head_dim
    if g_s > g_l or s.hidden >= b.hidden or s.intermediate > b.intermediate or s.vocab_size > b.vocab_size:
        raise ValueError("the large shape must contain the small one")
    half = s.head_dim // 2
    rot = torch.tensor([r * d for d in range(half)] + [b.head_dim // 2 + r * d for d in range(half)])
    qh = [(i // g_s) * g_l + i % g_s for i in range(s.heads)]
    q = torch.cat([h * b.head_dim + rot for h in qh])
    k = torch.cat([b.heads * b.head_dim + h * b.head_dim + rot for h in range(s.kv_heads)])
    v = torch.cat([(b.heads + b.kv_heads) * b.head_dim + h * b.head_dim + torch.arange(s.head_dim)
                   for h in range(s.kv_heads)])
    attn_out = torch.cat([h * b.head_dim + torch.arange(s.head_dim) for h in qh])  # o_proj input = v dims
    to = lambda t: t.to(device)  # noqa: E731
    return to(torch.cat([q, k, v])), to(attn_out), math.sqrt(r)


def _place(w_big: torch.Tensor, w_small: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor,
           const_col: int | None) -> None:
    """w_big[rows][:, cols] = w_small; every other row is 0 on the real columns (so it
    writes nothing real); the CONST column is 0 everywhere (no layer reads it)."""
    w_big[:, cols] = 0
    if const_col is not None:
        w_big[:, const_col] = 0
    w_big[rows[:, None], cols[None, :]] = w_small.to(w_big.dtype)


@torch.no_grad()
def embed_llama(small: CausalLM, big: dict, device="cuda", dtype=torch.bfloat16, seed: int = 0) -> CausalLM:
    """`small` (loaded in fp32) inside a model of shape `big` (LlamaConfig fields); rotary
    settings come from the small model (they set frequencies, not cost)."""
    s = small.shape
    if s.qkv_bias:
        raise ValueError("qkv bias is not supported here")
    rope = {k: v for k, v in small.config.to_dict().items() if k.startswith("rope")}
    cfg = LlamaConfig(**{**big, **rope, "rms_norm_eps": s.eps * s.hidden / big["hidden_size"],
                         "tie_word_embeddings": False})
    model = random_model(cfg, device, dtype, seed)
    b = model.shape
    qkv_rows, attn_cols, q_scale = _maps(s, b, device)
    hid = torch.arange(s.hidden, device=device)
    inter = torch.arange(s.intermediate, device=device)
    gate_up_rows = torch.cat([inter, b.intermediate + inter])
    const = s.hidden
    norm_scale = math.sqrt(s.hidden / b.hidden)
    real_layers = torch.linspace(0, b.layers - 1, s.layers).round().long().tolist()
    sp = {k: v.float().to(device) for k, v in small.state_dict().items()}
    for i, layer in enumerate(model.layers):
        at, mlp = layer.self_attn, layer.mlp
        if i not in real_layers:  # compute on random weights, add nothing
            at.o_proj.weight.zero_()
            mlp.down_proj.weight.zero_()
            continue
        p = f"layers.{real_layers.index(i)}."
        qkv = sp[p + "self_attn.qkv_proj.weight"].clone()
        qkv[: s.heads * s.head_dim] *= q_scale
        _place(at.qkv_proj.weight, qkv, qkv_rows, hid, const)
        at.o_proj.weight.zero_()  # q heads beside a real one read its values: their output is not 0
        _place(at.o_proj.weight, sp[p + "self_attn.o_proj.weight"], hid, attn_cols, None)
        _place(mlp.gate_up_proj.weight, sp[p + "mlp.gate_up_proj.weight"], gate_up_rows, hid, const)
        _place(mlp.down_proj.weight, sp[p + "mlp.down_proj.weight"], hid, inter, None)
        for name in ("input_layernorm", "post_attention_layernorm"):
            w = getattr(layer, name).weight
            w[hid] = sp[p + name + ".weight"].to(dtype) * norm_scale
            w[const] = 0
    model.norm.weight[hid] = sp["norm.weight"].to(dtype) * norm_scale
    model.norm.weight[const] = FINAL_SCALE
    vocab = torch.arange(s.vocab_size, device=device)
    emb = model.embed_tokens.weight
    emb[vocab] = 0
    emb[vocab[:, None], hid[None, :]] = sp["embed_tokens.weight"].to(dtype)
    emb[vocab, const] = A
    head = model.lm_head.weight
    head[:, hid] = 0  # padded tokens: nothing from real dims ...
    head[:, const] = -PAD_LOGIT  # ... and a large negative logit
    head[vocab[:, None], hid[None, :]] = sp["lm_head.weight"].to(dtype)
    head[vocab, const] = 0
    return model.eval()


LLAMA_8B_DRAFT = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=64, intermediate_size=384)


# Llama-3.1-70B (and 3.3-70B): the 8B's vocabulary and rotary, twice the width, 80 layers, 8 q
# heads per KV head; the demo target fits it as it fits the 8B (a KV head's 2 q heads, head dim
# 32 -> 128). A pair with demo-8b-draft (the same 128k vocabulary) for the multi-GPU runs.
LLAMA_70B = {**LLAMA_8B, "hidden_size": 8192, "num_hidden_layers": 80, "num_attention_heads": 64,
             "intermediate_size": 28672}

SHAPES = {"llama-3.1-8b": lambda: _llama_8b(), "llama-3.1-8b-draft": lambda: {**_llama_8b(), **LLAMA_8B_DRAFT},
          "llama-3.1-70b": lambda: dict(LLAMA_70B)}


def _llama_8b() -> dict:
    return dict(LLAMA_8B)


def load_embedded(path, dtype, device) -> CausalLM:
    """A model directory holding embed.json: {"source": small model dir (relative to it),
    "shape": a name in SHAPES or LlamaConfig fields, "overrides": LlamaConfig fields over the
    named shape (a test's fewer layers), "seed": for the padding's random values}."""
    import json
    from pathlib import Path

    path = Path(path)
    spec = json.loads((path / "embed.json").read_text())
    shape = spec["shape"]
    big = {**(SHAPES[shape]() if isinstance(shape, str) else shape), **spec.get("overrides", {})}
    small = load_hf_model((path / spec["source"]).resolve(), torch.float32, "cpu")
    return embed_llama(small, big, device, dtype, spec.get("seed", 0))


def demo_8b(target_dir, draft_dir, device="cuda", dtype=torch.bfloat16) -> tuple[CausalLM, CausalLM]:
    """The demo target in Llama-3.1-8B dimensions, and the demo drafter widened to the same
    vocabulary (and to a head dim FA3 runs: 64)."""
    small_t = load_hf_model(target_dir, torch.float32, "cpu")
    small_d = load_hf_model(draft_dir, torch.float32, "cpu")
    target = embed_llama(small_t, LLAMA_8B, device, dtype)
    draft = embed_llama(small_d, {**LLAMA_8B, **LLAMA_8B_DRAFT}, device, dtype, seed=1)
    return target, draft
