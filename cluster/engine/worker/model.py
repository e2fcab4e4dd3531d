"""A compact decoder for the Llama family (Llama, Qwen2, Mistral configs).

Weights load from a Hugging Face model directory (config.json + safetensors). q/k/v and
gate/up projections are fused at load time: one matmul instead of three (two) per layer.
Rotary tables come from transformers' own rotary-embedding class, so every rope_type it
knows (default, llama3, yarn, ...) is computed the way the reference computes it.
"""

from __future__ import annotations

import os
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from cluster.engine.worker.attention import AttnContext
from cluster.engine.worker.sharding import local_shape, read_shards, vocab_rows

log = logging.getLogger(__name__)
SUPPORTED = ("llama", "qwen2", "mistral")


@dataclass(frozen=True)
class ModelShape:
    vocab_size: int
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    qkv_bias: bool
    tie_embeddings: bool
    max_positions: int

    @classmethod
    def from_hf(cls, cfg) -> "ModelShape":
        if cfg.model_type not in SUPPORTED:
            raise ValueError(f"model_type {cfg.model_type!r} is not supported (supported: {', '.join(SUPPORTED)})")
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        return cls(cfg.vocab_size, cfg.hidden_size, cfg.num_hidden_layers, cfg.num_attention_heads,
                   cfg.num_key_value_heads or cfg.num_attention_heads, head_dim, cfg.intermediate_size,
                   cfg.rms_norm_eps, cfg.model_type == "qwen2" or bool(getattr(cfg, "attention_bias", False)),
                   bool(cfg.tie_word_embeddings), cfg.max_position_embeddings)

    def num_params(self) -> int:
        h, d = self.hidden, self.head_dim
        attn = h * d * (self.heads + 2 * self.kv_heads) + self.heads * d * h
        layer = attn + 3 * h * self.intermediate + 2 * h
        emb = self.vocab_size * h * (1 if self.tie_embeddings else 2)
        return self.layers * layer + emb + h


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary embedding, as HF Llama. x: [B, T, H, D]; cos/sin: [B, T, 1, D/2]."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


def rope_qk(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k of a projection's output [..., heads + 2 kv_heads, D], rotated: (q [..., heads, D]
    contiguous, as attention backends take it; k [..., kv_heads, D])."""
    q, k = rope(qkv[..., : heads + kv_heads, :], cos, sin).split([heads, kv_heads], dim=-2)
    return q.contiguous(), k


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Normalise in fp32 as the reference does, then cast back.
    return (F.rms_norm(x.float(), (x.shape[-1],), eps=eps) * weight.float()).to(x.dtype)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def linear(x, w, bias=None, norm=None, eps: float = 0.0, silu: bool = False, residual=None):
    """[residual +] linear([rms_norm(x, norm) | silu_mul(x)]): a projection with its
    neighbours, so the GPU path can run it as one kernel (cluster.engine.worker.gemv)."""
    if norm is not None:
        x = KERNELS["rms_norm"](x, norm, eps)
    if silu:
        x = KERNELS["silu_mul"](x)
    y = F.linear(x, w, bias)
    return y if residual is None else residual + y


KERNELS = {"rope_qk": rope_qk, "rms_norm": rms_norm, "silu_mul": silu_mul, "linear": linear}


def compile_kernels(cache_dir: str | None = None) -> None:
    """GPU fast path. RMSNorm fused by torch.compile (a decode step is otherwise dozens of tiny
    kernels per layer), compiled once per shape family and shared by all layers; rotary and
    SiLU(gate) * up as the Triton kernels in cluster.engine.worker.pointwise (POINTWISE=inductor:
    by torch.compile too, to compare); projections of up to 16 token rows (batch-1 decode and
    verify, small batches) by the Triton kernels in cluster.engine.worker.gemv, wider ones on cuBLAS.
    Process-wide and idempotent: the target and a drafter in one process share it.
    `cache_dir`: Triton's kernels and tuning and inductor's artifacts go there (both libraries
    read these variables when they compile), so a later start loads instead of compiling."""
    if cache_dir:
        root = os.path.expanduser(cache_dir)
        os.environ["TRITON_CACHE_DIR"] = os.path.join(root, "triton")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(root, "inductor")
    if KERNELS["linear"] is not linear:
        return
    # dynamic=True still specialises sizes 0 and 1 (a batch or a step of one token) and guards
    # on eps and dtype, so a target and a drafter in one process need more than dynamo's 8
    # variants a function; past the limit it ran the rest eagerly (rms_norm hit it at start-up
    # on every GPU run, benchmarks/gpu/smoke), and CUDA graphs captured the unfused kernels
    import torch._dynamo

    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    from cluster.engine.worker import gemv, pointwise

    compiled = ("rope_qk", "rms_norm", "silu_mul") if os.environ.get("POINTWISE") == "inductor" else ("rms_norm",)
    for name in compiled:
        KERNELS[name] = torch.compile(KERNELS[name], dynamic=True)
    if "rope_qk" not in compiled:  # callers compile only for models on CUDA
        KERNELS["rope_qk"], KERNELS["silu_mul"] = pointwise.rope_qk, pointwise.silu_mul

    def gpu_linear(x, w, bias=None, norm=None, eps=0.0, silu=False, residual=None):
        if x.is_cuda and gemv.supported(x.numel() // x.shape[-1], *w.shape):
            return gemv.fused_linear(x, w, bias, norm, eps, silu, residual)
        if residual is not None and bias is None and x.is_cuda:
            # the residual add as cuBLAS's epilogue (C + A @ B): one kernel, not two, per
            # o_proj and down_proj; 64 fewer small kernels in an 8B verify or prefill pass
            if norm is not None:
                x = KERNELS["rms_norm"](x, norm, eps)
            if silu:
                x = KERNELS["silu_mul"](x)
            n = w.shape[0]
            return torch.addmm(residual.reshape(-1, n), x.reshape(-1, x.shape[-1]), w.t()).view(*x.shape[:-1], n)
        return linear(x, w, bias, norm, eps, silu, residual)

    KERNELS["linear"] = gpu_linear


class Rotary(nn.Module):
    def __init__(self, hf_config, max_positions: int):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

        ref = LlamaRotaryEmbedding(hf_config)
        t = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(t, ref.inv_freq.float())
        self.register_buffer("cos", freqs.cos() * ref.attention_scaling, persistent=False)
        self.register_buffer("sin", freqs.sin() * ref.attention_scaling, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [B, T, 1, D/2] for the step's positions, gathered once for all layers."""
        # padded positions of a graph's rows may run past the table; their outputs are unused
        positions = positions.clamp(max=self.cos.shape[0] - 1)
        return self.cos[positions][:, :, None, :], self.sin[positions][:, :, None, :]


class Attention(nn.Module):
    def __init__(self, s: ModelShape, reduce=None, adds_residual: bool = True):
        """reduce: the all-reduce joining tensor-parallel ranks' partial o_proj sums; None: one
        process. adds_residual: this rank's partial sum carries the residual (rank 0's alone, in
        its projection's epilogue), so the all-reduce gives h + attention(h) with no add after it."""
        super().__init__()
        self.s, self.reduce, self.adds_residual = s, reduce, adds_residual
        self.qkv_proj = nn.Linear(s.hidden, s.head_dim * (s.heads + 2 * s.kv_heads), bias=s.qkv_bias)
        self.o_proj = nn.Linear(s.heads * s.head_dim, s.hidden, bias=False)

    def forward(self, h, norm: "RMSNorm", rot, backend, k_cache, v_cache, ctx, scale=None):
        """h + attention(norm(h)); `scale`: the layer's fp8 scales when the cache is fp8."""
        B, T, _ = h.shape
        s, lin = self.s, KERNELS["linear"]
        qkv = lin(h, self.qkv_proj.weight, self.qkv_proj.bias, norm.weight, norm.eps)
        qkv = qkv.view(B, T, s.heads + 2 * s.kv_heads, s.head_dim)
        q, k = KERNELS["rope_qk"](qkv, *rot, s.heads, s.kv_heads)  # q and k rotated in one op
        out = backend(q, k, qkv[:, :, s.heads + s.kv_heads:], k_cache, v_cache, ctx, scale)
        y = lin(out.reshape(B, T, -1), self.o_proj.weight, residual=h if self.adds_residual else None)
        return y if self.reduce is None else self.reduce(y)

    def segmented(self, h, norm: "RMSNorm", rot, backend, k_cache, v_cache, segs, scale=None):
        """As forward over the real tokens of several segments, h [N, hidden]: the projections
        and rotary run once over all N tokens, attention once per segment on its padded block
        with its own context (cluster.engine.worker.attention.Segment)."""
        s, lin = self.s, KERNELS["linear"]
        n = h.shape[0]
        qkv = lin(h, self.qkv_proj.weight, self.qkv_proj.bias, norm.weight, norm.eps)
        qkv = qkv.view(n, s.heads + 2 * s.kv_heads, s.head_dim)
        q, k = KERNELS["rope_qk"](qkv, *rot, s.heads, s.kv_heads)
        v = qkv[:, s.heads + s.kv_heads:]
        out = torch.cat([seg.unpad(backend(seg.pad(q), seg.pad(k), seg.pad(v), k_cache, v_cache,
                                           seg.ctx, scale)) for seg in segs])
        y = lin(out.reshape(n, -1), self.o_proj.weight, residual=h if self.adds_residual else None)
        return y if self.reduce is None else self.reduce(y)


class MLP(nn.Module):
    def __init__(self, s: ModelShape, reduce=None, adds_residual: bool = True):
        super().__init__()
        self.reduce, self.adds_residual = reduce, adds_residual  # as Attention's, for down_proj
        self.gate_up_proj = nn.Linear(s.hidden, 2 * s.intermediate, bias=False)
        self.down_proj = nn.Linear(s.intermediate, s.hidden, bias=False)

    def forward(self, h, norm: "RMSNorm"):
        """h + mlp(norm(h))."""
        lin = KERNELS["linear"]
        gate_up = lin(h, self.gate_up_proj.weight, norm=norm.weight, eps=norm.eps)
        y = lin(gate_up, self.down_proj.weight, silu=True, residual=h if self.adds_residual else None)
        return y if self.reduce is None else self.reduce(y)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return KERNELS["rms_norm"](x, self.weight, self.eps)


class Layer(nn.Module):
    def __init__(self, s: ModelShape, reduce=None, adds_residual: bool = True):
        super().__init__()
        self.input_layernorm = RMSNorm(s.hidden, s.eps)
        self.self_attn = Attention(s, reduce, adds_residual)
        self.post_attention_layernorm = RMSNorm(s.hidden, s.eps)
        self.mlp = MLP(s, reduce, adds_residual)


class VocabEmbedding(nn.Module):
    """A tensor-parallel rank's rows of the embedding: tokens outside them embed as 0 here,
    and the all-reduce gives every rank every token's row."""

    def __init__(self, vocab_size: int, hidden: int, group):
        super().__init__()
        self.start, rows = vocab_rows(vocab_size, group.rank, group.size)
        self.weight = nn.Parameter(torch.empty(rows, hidden))
        self.group = group

    def forward(self, ids):
        local = ids - self.start
        outside = (local < 0) | (local >= self.weight.shape[0])
        h = F.embedding(local.masked_fill(outside, 0), self.weight).masked_fill_(outside[..., None], 0)
        return self.group.all_reduce(h)


class CausalLM(nn.Module):
    """Returns hidden states; `logits(h)` applies the head only where the caller needs it.

    With `group` (cluster.engine.distributed.parallel.Group) it is one tensor-parallel rank's part
    (cluster.engine.worker.sharding): `shape` is then the rank's (its heads, KV heads, MLP features)
    with the whole vocabulary, and `logits` returns full-vocabulary logits on rank 0, None on
    the others."""

    def __init__(self, shape: ModelShape, hf_config, group=None):
        super().__init__()
        self.group = group
        if group is not None:
            shape = local_shape(shape, group.size)
        self.shape = shape
        reduce = None if group is None else group.all_reduce
        if group is None:
            self.embed_tokens = nn.Embedding(shape.vocab_size, shape.hidden)
            self.lm_head = nn.Linear(shape.hidden, shape.vocab_size, bias=False)
        else:
            self.embed_tokens = VocabEmbedding(shape.vocab_size, shape.hidden, group)
            self.lm_head = nn.Linear(shape.hidden, self.embed_tokens.weight.shape[0], bias=False)
        self.layers = nn.ModuleList(Layer(shape, reduce, group is None or group.first) for _ in range(shape.layers))
        self.norm = RMSNorm(shape.hidden, shape.eps)
        self.rotary = Rotary(hf_config, shape.max_positions)
        self.backend = None  # set by the runner: attention.make_backend(...)
        # Layers whose input (the residual stream there) an EAGLE-3 drafter reads, in its
        # order (vLLM's convention: id i is the input of layer i); set before graphs are captured.
        self.aux_layers: tuple[int, ...] = ()

    def forward(self, input_ids, positions, kv, ctx: AttnContext, num_layers: int | None = None,
                aux: list | None = None):
        """Final-normed hidden states; with `aux`, appends [B, T, len(aux_layers) * D], the
        aux layers' inputs side by side (what an EAGLE-3 head's fc reads)."""
        h = self.embed_tokens(input_ids)
        rot = self.rotary(positions)
        taken = {}
        for i, layer in enumerate(self.layers[:num_layers]):
            if aux is not None and i in self.aux_layers:
                taken[i] = h
            scale = kv.scales[i] if kv.scales is not None else None
            h = layer.self_attn(h, layer.input_layernorm, rot, self.backend, kv.k[i], kv.v[i], ctx, scale)
            h = layer.mlp(h, layer.post_attention_layernorm)
        if aux is not None and self.aux_layers:
            aux.append(torch.cat([taken[i] for i in self.aux_layers], dim=-1))
        return self.norm(h)

    def forward_segments(self, input_ids, positions, kv, segs: list, aux: list | None = None):
        """forward over several padded segments in one pass (cluster.engine.worker.runner.forward_mixed):
        input_ids and positions [N] are the segments' real tokens back to back; embedding,
        projections, MLP and norms read the weights once for all of them, and only attention
        runs per segment (Attention.segmented). Returns [N, hidden]; with `aux`, appends [N, A]."""
        h = self.embed_tokens(input_ids)
        cos, sin = self.rotary(positions[None])
        rot = (cos[0], sin[0])  # [N, 1, D/2]
        taken = {}
        for i, layer in enumerate(self.layers):
            if aux is not None and i in self.aux_layers:
                taken[i] = h
            scale = kv.scales[i] if kv.scales is not None else None
            h = layer.self_attn.segmented(h, layer.input_layernorm, rot, self.backend, kv.k[i], kv.v[i], segs, scale)
            h = layer.mlp(h, layer.post_attention_layernorm)
        if aux is not None and self.aux_layers:
            aux.append(torch.cat([taken[i] for i in self.aux_layers], dim=-1))
        return self.norm(h)

    def logits(self, h: torch.Tensor, fp32: bool = True) -> torch.Tensor:
        """The head over h; in the weights' dtype with fp32=False (a rounding-free cast away)."""
        y = KERNELS["linear"](h, self.lm_head.weight)
        if self.group is not None:
            y = self.group.gather_vocab(y, self.shape.vocab_size)
            if y is None:
                return None
        return y.float() if fp32 else y


def _fuse(state: dict[str, torch.Tensor], shape: ModelShape) -> dict[str, torch.Tensor]:
    """Map HF parameter names onto this module, fusing q/k/v and gate/up. Consumes `state`:
    each part is freed as its fused tensor is made, so fusing never holds the weights twice
    (a 70B rank's 66 GiB of slices on an 80 GB GPU ran out of memory here when it did)."""
    out = {}
    while state:
        name, t = state.popitem()
        out[name.removeprefix("model.")] = t
    for i in range(shape.layers):
        p = f"layers.{i}."
        for kind in ("weight", "bias"):
            parts = [out.pop(f"{p}self_attn.{x}_proj.{kind}", None) for x in "qkv"]
            if parts[0] is not None:
                out[f"{p}self_attn.qkv_proj.{kind}"] = torch.cat(parts)
        out[f"{p}mlp.gate_up_proj.weight"] = torch.cat([out.pop(f"{p}mlp.gate_proj.weight"), out.pop(f"{p}mlp.up_proj.weight")])
    if shape.tie_embeddings or "lm_head.weight" not in out:
        out["lm_head.weight"] = out["embed_tokens.weight"]
    for key in [k for k in out if "rotary_emb" in k]:
        out.pop(key)
    return out


def load_hf_model(path: str | Path, dtype: torch.dtype, device: torch.device | str, group=None) -> CausalLM:
    """Build the model from an HF directory (config.json + *.safetensors), weights in `dtype`;
    with `group`, this tensor-parallel rank's part, read slice by slice (cluster.engine.worker.sharding)."""
    from safetensors.torch import load_file
    from transformers import AutoConfig
    from tqdm.auto import tqdm

    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"{path} is not a model directory (no config.json)")
    cfg = AutoConfig.from_pretrained(path)
    shape = ModelShape.from_hf(cfg)
    with torch.device("meta"):
        model = CausalLM(shape, cfg, group)
    files = sorted(f for f in path.glob("*.safetensors") if f.name != "medusa_heads.safetensors")  # not the model's
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    if group is not None:  # this rank's slices only
        state = read_shards(files, shape, group.rank, group.size)
    else:
        state = {}
        for f in tqdm(files, desc=f"loading {path.name}", unit="shard", disable=len(files) < 2):
            state.update(load_file(f, device="cpu"))
    fused = _fuse(state, model.shape)
    state = {k: fused.pop(k).to(dtype) for k in list(fused)}  # one tensor converted at a time
    model.load_state_dict(state, strict=False, assign=True)
    model.rotary = Rotary(cfg, shape.max_positions)  # buffers were on meta
    missing = [n for n, p in model.named_parameters() if p.is_meta]
    if missing:
        raise ValueError(f"{path}: weights missing for {missing[:4]}")
    model.config = cfg
    log.info("loaded %s: %s, %.1fM params, %s", path, cfg.model_type, shape.num_params() / 1e6, dtype)
    return model.to(device).eval()
