"""The EAGLE-3 head (Li et al., 2025): one decoder layer that drafts from the target's features.

At position p the head reads the token that follows, t_{p+1}, and a hidden input x_p, and
predicts t_{p+2}. For positions the target has computed, x_p = fc(aux_p), aux_p being the
target's residual stream at three layers (low, middle, high) side by side; for a draft
position it is the head's own output at the position before (its pre-norm hidden state):

    r  = x                       (hidden_norm(x) when the checkpoint normalises before the residual)
    a  = attention(q/k/v over concat(input_layernorm(embed(t)), hidden_norm(x)))   # 2*hidden in
    r  = r + o_proj(a);  r = r + mlp(post_attention_layernorm(r))
    out = r;  logits = lm_head(norm(r))    over a reduced draft vocabulary; target id = d + d2t[d]

as vLLM's and SGLang's llama_eagle3 compute it. The head keeps its own (one-layer) KV cache;
`forward` runs over a paged cache through the engine's attention backends, and `project` /
`finish` split it around attention so training can run its own (training-time test) attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from cluster.engine.worker.attention import AttnContext
from cluster.engine.worker.model import KERNELS, MLP, ModelShape, RMSNorm, Rotary


@dataclass(frozen=True)
class HeadConfig:
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    eps: float
    vocab_size: int            # the target's vocabulary (embedding rows)
    draft_vocab: int           # lm_head rows
    target_hidden: int         # fc reads len(aux_layers) * target_hidden
    aux_layers: tuple[int, ...]
    norm_before_residual: bool = False
    qkv_bias: bool = False
    fc_bias: bool = False
    max_positions: int = 2048

    def shape(self) -> ModelShape:
        """The head's layer as a one-layer model shape (for its KV cache and the MLP module)."""
        return ModelShape(self.vocab_size, self.hidden, 1, self.heads, self.kv_heads, self.head_dim,
                          self.intermediate, self.eps, self.qkv_bias, False, self.max_positions)


class Eagle3Head(nn.Module):
    def __init__(self, cfg: HeadConfig, hf_config):
        """hf_config: a transformers LlamaConfig of the head's layer (rotary parameters)."""
        super().__init__()
        self.cfg, self.shape = cfg, cfg.shape()
        D, s = cfg.hidden, self.shape
        self.embed_tokens = nn.Embedding(cfg.vocab_size, D)
        self.fc = nn.Linear(len(cfg.aux_layers) * cfg.target_hidden, D, bias=cfg.fc_bias)
        self.input_layernorm = RMSNorm(D, cfg.eps)
        self.hidden_norm = RMSNorm(D, cfg.eps)
        self.qkv_proj = nn.Linear(2 * D, cfg.head_dim * (cfg.heads + 2 * cfg.kv_heads), bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.heads * cfg.head_dim, D, bias=False)
        self.post_attention_layernorm = RMSNorm(D, cfg.eps)
        self.mlp = MLP(s)
        self.norm = RMSNorm(D, cfg.eps)
        self.lm_head = nn.Linear(D, cfg.draft_vocab, bias=False)
        # draft id d is target id d + d2t[d] (the published offsets); identity for a full vocab
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab, dtype=torch.int64))
        self.rotary = Rotary(hf_config, cfg.max_positions)
        self.hf_config = hf_config
        self.backend = None  # an attention backend (cluster.engine.worker.attention), set by the drafter

    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's aux hidden states [..., A] -> the head's hidden input [..., D]."""
        return F.linear(aux.to(self.fc.weight.dtype), self.fc.weight, self.fc.bias)

    def project(self, ids: torch.Tensor, x: torch.Tensor, positions: torch.Tensor):
        """q [B, T, H, d], k and v [B, T, Hkv, d] (rotated), and the residual [B, T, D]."""
        c, lin = self.cfg, KERNELS["linear"]
        B, T = ids.shape
        e = KERNELS["rms_norm"](self.embed_tokens(ids), self.input_layernorm.weight, c.eps)
        xn = KERNELS["rms_norm"](x, self.hidden_norm.weight, c.eps)
        residual = xn if c.norm_before_residual else x
        qkv = lin(torch.cat([e.to(xn.dtype), xn], dim=-1), self.qkv_proj.weight, self.qkv_proj.bias)
        qkv = qkv.view(B, T, c.heads + 2 * c.kv_heads, c.head_dim)
        q, k = KERNELS["rope_qk"](qkv, *self.rotary(positions), c.heads, c.kv_heads)
        return q, k, qkv[:, :, c.heads + c.kv_heads:], residual

    def finish(self, attn: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """Attention output [B, T, H*d] -> the head's pre-norm output [B, T, D]."""
        r = KERNELS["linear"](attn, self.o_proj.weight, residual=residual)
        return self.mlp(r, self.post_attention_layernorm)

    def forward(self, ids: torch.Tensor, x: torch.Tensor, positions: torch.Tensor, kv, ctx: AttnContext) -> torch.Tensor:
        """ids [B, T], hidden input x [B, T, D] over the head's paged cache (one layer) -> [B, T, D]."""
        q, k, v, residual = self.project(ids, x, positions)
        out = self.backend(q, k, v, kv.k[0], kv.v[0], ctx)
        return self.finish(out.reshape(*ids.shape, -1), residual)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """fp32 logits over the draft vocabulary [..., draft_vocab]."""
        h = KERNELS["rms_norm"](out, self.norm.weight, self.cfg.eps)
        return KERNELS["linear"](h, self.lm_head.weight).float()

    def target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]
