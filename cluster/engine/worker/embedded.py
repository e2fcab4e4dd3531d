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
from dataclasses import dataclass

import torch
from torch import nn
from tqdm.auto import tqdm
from transformers import LlamaConfig

from cluster.engine.worker.model import CausalLM, ModelShape, Rotary, load_hf_model

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


def real_layers(small_layers: int, big_layers: int) -> list[int]:
    """Where the small model's layers go in the large depth (spread evenly, first and last kept)."""
    return torch.linspace(0, big_layers - 1, small_layers).round().long().tolist()


def index_maps(s: ModelShape, b: ModelShape, device):
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


def place(w_big: torch.Tensor, w_small: torch.Tensor, rows: torch.Tensor, cols: torch.Tensor,
           const_col: int | None) -> None:
    """w_big[rows][:, cols] = w_small; every other row is 0 on the real columns (so it
    writes nothing real); the CONST column is 0 everywhere (no layer reads it)."""
    w_big[:, cols] = 0
    if const_col is not None:
        w_big[:, const_col] = 0
    w_big[rows[:, None], cols[None, :]] = w_small.to(w_big.dtype)


@dataclass
class _Plan:
    """Where the small model's weights go in the large shape (see the module docstring)."""
    s: ModelShape
    b: ModelShape
    sp: dict          # the small model's weights, fp32, on the device
    dtype: torch.dtype
    device: object

    def __post_init__(self):
        s, b, dev = self.s, self.b, self.device
        self.qkv_rows, self.attn_cols, self.q_scale = index_maps(s, b, dev)
        self.hid = torch.arange(s.hidden, device=dev)
        self.inter = torch.arange(s.intermediate, device=dev)
        self.gate_up_rows = torch.cat([self.inter, b.intermediate + self.inter])
        self.const = s.hidden
        self.norm_scale = math.sqrt(s.hidden / b.hidden)
        self.real_layers = real_layers(s.layers, b.layers)


def _plan(small: CausalLM, big: dict, device, dtype) -> tuple[LlamaConfig, _Plan]:
    s = small.shape
    if s.qkv_bias:
        raise ValueError("qkv bias is not supported here")
    rope = {k: v for k, v in small.config.to_dict().items() if k.startswith("rope")}
    cfg = LlamaConfig(**{**big, **rope, "rms_norm_eps": s.eps * s.hidden / big["hidden_size"],
                         "tie_word_embeddings": False})
    sp = {k: v.float().to(device) for k, v in small.state_dict().items()}
    return cfg, _Plan(s, ModelShape.from_hf(cfg), sp, dtype, device)


def _embed_layer(pl: _Plan, i: int, layer) -> None:
    """Layer i of the large model (a full-size Layer holding random weights), in place."""
    s, sp, hid, const = pl.s, pl.sp, pl.hid, pl.const
    at, mlp = layer.self_attn, layer.mlp
    if i not in pl.real_layers:  # compute on random weights, add nothing
        at.o_proj.weight.zero_()
        mlp.down_proj.weight.zero_()
        return
    p = f"layers.{pl.real_layers.index(i)}."
    qkv = sp[p + "self_attn.qkv_proj.weight"].clone()
    qkv[: s.heads * s.head_dim] *= pl.q_scale
    place(at.qkv_proj.weight, qkv, pl.qkv_rows, hid, const)
    at.o_proj.weight.zero_()  # q heads beside a real one read its values: their output is not 0
    place(at.o_proj.weight, sp[p + "self_attn.o_proj.weight"], hid, pl.attn_cols, None)
    place(mlp.gate_up_proj.weight, sp[p + "mlp.gate_up_proj.weight"], pl.gate_up_rows, hid, const)
    place(mlp.down_proj.weight, sp[p + "mlp.down_proj.weight"], hid, pl.inter, None)
    for name in ("input_layernorm", "post_attention_layernorm"):
        w = getattr(layer, name).weight
        w[hid] = sp[p + name + ".weight"].to(pl.dtype) * pl.norm_scale
        w[const] = 0


def _embed_ends(pl: _Plan, emb: torch.Tensor, head: torch.Tensor, norm: torch.Tensor) -> None:
    """The embedding, LM head and final norm of the large model (full size), in place."""
    s, sp, hid, const, dtype = pl.s, pl.sp, pl.hid, pl.const, pl.dtype
    norm[hid] = sp["norm.weight"].to(dtype) * pl.norm_scale
    norm[const] = FINAL_SCALE
    vocab = torch.arange(s.vocab_size, device=pl.device)
    emb[vocab] = 0
    emb[vocab[:, None], hid[None, :]] = sp["embed_tokens.weight"].to(dtype)
    emb[vocab, const] = A
    head[:, hid] = 0  # padded tokens: nothing from real dims ...
    head[:, const] = -PAD_LOGIT  # ... and a large negative logit
    head[vocab[:, None], hid[None, :]] = sp["lm_head.weight"].to(dtype)
    head[vocab, const] = 0


def _full_layer(pl: _Plan, i: int, seed: int):
    """Layer i of the large model at full size: random weights (seeded by layer, so every
    rank builds the same), then the small model's layer placed in it."""
    from cluster.engine.worker.model import Layer

    g = torch.Generator(device=pl.device).manual_seed(seed * 100_003 + i)
    with torch.device("meta"):
        layer = Layer(pl.b)
    layer = layer.to(pl.dtype).to_empty(device=pl.device)
    for name, w in layer.named_parameters():
        w.fill_(1.0) if "norm" in name else w.normal_(0, 0.02, generator=g)
    _embed_layer(pl, i, layer)
    return layer


def _full_ends(pl: _Plan, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(embedding, LM head, final norm) of the large model at full size."""
    b = pl.b
    g = torch.Generator(device=pl.device).manual_seed(seed * 100_003 + b.layers)
    emb = torch.empty(b.vocab_size, b.hidden, device=pl.device, dtype=pl.dtype).normal_(0, 0.02, generator=g)
    head = torch.empty_like(emb).normal_(0, 0.02, generator=g)
    norm = torch.ones(b.hidden, device=pl.device, dtype=pl.dtype)
    _embed_ends(pl, emb, head, norm)
    return emb, head, norm


def _finish(model: CausalLM, cfg: LlamaConfig, pl: _Plan) -> CausalLM:
    model.rotary = Rotary(cfg, pl.b.max_positions).to(pl.device)  # buffers were on meta
    model.config = cfg
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ValueError(f"embedded model: weights missing for {missing[:4]}")
    return model.eval()


@torch.no_grad()
def embed_llama(small: CausalLM, big: dict, device="cuda", dtype=torch.bfloat16, seed: int = 0) -> CausalLM:
    """`small` (loaded in fp32) inside a model of shape `big` (LlamaConfig fields); rotary
    settings come from the small model (they set frequencies, not cost)."""
    cfg, pl = _plan(small, big, device, dtype)
    with torch.device("meta"):
        model = CausalLM(pl.b, cfg)
    for i in range(pl.b.layers):
        model.layers[i] = _full_layer(pl, i, seed)
    emb, head, norm = _full_ends(pl, seed)
    model.embed_tokens.weight, model.lm_head.weight, model.norm.weight = (nn.Parameter(t) for t in (emb, head, norm))
    return _finish(model, cfg, pl)


def hf_layer_weights(layer, b: ModelShape) -> dict[str, torch.Tensor]:
    """A full-size layer's weights under their Hugging Face names (q/k/v and gate/up apart),
    which is what cluster.engine.worker.sharding cuts."""
    q, kv = b.heads * b.head_dim, b.kv_heads * b.head_dim
    qkv, gate_up = layer.self_attn.qkv_proj.weight, layer.mlp.gate_up_proj.weight
    return {"self_attn.q_proj.weight": qkv[:q], "self_attn.k_proj.weight": qkv[q:q + kv],
            "self_attn.v_proj.weight": qkv[q + kv:], "self_attn.o_proj.weight": layer.self_attn.o_proj.weight,
            "mlp.gate_proj.weight": gate_up[:b.intermediate], "mlp.up_proj.weight": gate_up[b.intermediate:],
            "mlp.down_proj.weight": layer.mlp.down_proj.weight,
            "input_layernorm.weight": layer.input_layernorm.weight,
            "post_attention_layernorm.weight": layer.post_attention_layernorm.weight}


@torch.no_grad()
def embed_llama_shard(small: CausalLM, big: dict, device, dtype, seed: int, group) -> CausalLM:
    """Tensor-parallel rank `group.rank`'s part of embed_llama's model (the same weights): each
    full-size piece is built one at a time (a layer, then the embedding and head), cut to this
    rank's slice as a checkpoint's would be (cluster.engine.worker.sharding) and dropped, so no rank
    holds the whole model (a 70B layer is 1.7 GB in bf16; the model, 141 GB)."""
    from cluster.engine.worker.model import _fuse
    from cluster.engine.worker.sharding import take, weight_slice

    cfg, pl = _plan(small, big, device, dtype)
    b, state = pl.b, {}

    def keep(name: str, t: torch.Tensor) -> None:
        state[name] = take(t, list(t.shape), weight_slice(name, b, group.rank, group.size)).clone()

    # the full-size ends first (4.2 GB at 70B), while this rank holds no slices yet
    for name, t in zip(("model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"), _full_ends(pl, seed)):
        keep(name, t)
    for i in tqdm(range(b.layers), desc="building this rank's layers", unit="layer", disable=b.layers < 16):
        for name, t in hf_layer_weights(_full_layer(pl, i, seed), b).items():
            keep(f"model.layers.{i}.{name}", t)
    with torch.device("meta"):
        model = CausalLM(b, cfg, group)
    model.load_state_dict(_fuse(state, model.shape), strict=False, assign=True)
    return _finish(model, cfg, pl)


LLAMA_8B_DRAFT = dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=64, intermediate_size=384)


# Llama-3.1-70B (and 3.3-70B): the 8B's vocabulary and rotary, twice the width, 80 layers, 8 q
# heads per KV head; the demo target fits it as it fits the 8B (a KV head's 2 q heads, head dim
# 32 -> 128). A pair with demo-8b-draft (the same 128k vocabulary) for the multi-GPU runs.
LLAMA_70B = {**LLAMA_8B, "hidden_size": 8192, "num_hidden_layers": 80, "num_attention_heads": 64,
             "intermediate_size": 28672}

# Llama-3.2-1B: the draft model a Llama-3.1-8B target is served with (the same vocabulary and
# rotary). demo-8b-draft-1b is the demo drafter at this size: its tokens, a real drafter's step time.
LLAMA_1B = {**LLAMA_8B, "hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 64, "intermediate_size": 8192}

SHAPES = {"llama-3.1-8b": lambda: _llama_8b(), "llama-3.1-8b-draft": lambda: {**_llama_8b(), **LLAMA_8B_DRAFT},
          "llama-3.2-1b": lambda: dict(LLAMA_1B), "llama-3.1-70b": lambda: dict(LLAMA_70B)}


def _llama_8b() -> dict:
    return dict(LLAMA_8B)


def load_embedded(path, dtype, device, group=None) -> CausalLM:
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
    if group is not None:  # a tensor-parallel rank's part only
        return embed_llama_shard(small, big, device, dtype, spec.get("seed", 0), group)
    return embed_llama(small, big, device, dtype, spec.get("seed", 0))


def demo_8b(target_dir, draft_dir, device="cuda", dtype=torch.bfloat16) -> tuple[CausalLM, CausalLM]:
    """The demo target in Llama-3.1-8B dimensions, and the demo drafter widened to the same
    vocabulary (and to a head dim FA3 runs: 64)."""
    small_t = load_hf_model(target_dir, torch.float32, "cpu")
    small_d = load_hf_model(draft_dir, torch.float32, "cpu")
    target = embed_llama(small_t, LLAMA_8B, device, dtype)
    draft = embed_llama(small_d, {**LLAMA_8B, **LLAMA_8B_DRAFT}, device, dtype, seed=1)
    return target, draft
