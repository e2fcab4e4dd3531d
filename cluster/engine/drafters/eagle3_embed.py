"""A trained small EAGLE-3 head embedded in a larger head's shape, over an embedded target.

cluster.engine.worker.embedded puts the demo target inside Llama-3.1-8B's shape so that a step
costs an 8B step while the function stays the trained demo's. This does the same for the demo
target's EAGLE-3 head: a head of an 8B head's shape (4096 wide, 32 heads of 128, 14336 MLP,
32,000 draft tokens), every weight read each draft step, whose drafts are the small head's
drafts over the embedded target. The same rules as the target's (see that module):
- the head's hidden state holds the small head's dims first and one `CONST` dim at the tiny
  constant A. fc copies it from the target's residual stream, where CONST holds A at every
  layer; no projection reads it, and the final norm scales it up for the padded draft rows.
- fc reads each aux layer's block at the small target's dims; aux layer j of the small target
  is the input of the embedded target's layer `real_layers[j]` (extra layers pass the residual
  through), so the head's aux ids move there.
- heads, head dims, q scale, norms (weights and eps) and the MLP are placed as a target
  layer's are; padded draft-vocabulary rows read -PAD_LOGIT from CONST and never win.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn
from transformers import LlamaConfig

from cluster.engine.drafters.eagle3_head import Eagle3Head, HeadConfig
from cluster.engine.worker.embedded import FINAL_SCALE, PAD_LOGIT, index_maps, place, real_layers
from cluster.engine.worker.model import Rotary

# an 8B EAGLE-3 head's layer (the published Llama-3.1-8B heads: one Llama-3.1-8B decoder layer,
# a 32,000-token draft vocabulary)
LLAMA_8B_HEAD = dict(hidden_size=4096, num_attention_heads=32, num_key_value_heads=8, head_dim=128,
                     intermediate_size=14336, draft_vocab_size=32000)
SHAPES = {"llama-3.1-8b-eagle3": LLAMA_8B_HEAD}
EMBED = "embed.json"


@torch.no_grad()
def embed_head(small: Eagle3Head, small_target_layers: int, embed: torch.Tensor, target_layers: int,
               big: dict = LLAMA_8B_HEAD, seed: int = 0) -> Eagle3Head:
    """`small` (fp32), the head of a target of `small_target_layers` layers, inside a head of
    shape `big` (LlamaConfig fields + draft_vocab_size) over that target embedded by embed_llama
    at `target_layers` layers, whose token embedding `embed` [V, D] the head shares; the head
    takes embed's device and dtype."""
    sc = small.cfg
    device, dtype = embed.device, embed.dtype
    vocab, target_hidden = embed.shape
    bc = replace(sc, hidden=big["hidden_size"], heads=big["num_attention_heads"], kv_heads=big["num_key_value_heads"],
                 head_dim=big["head_dim"], intermediate=big["intermediate_size"],
                 eps=sc.eps * sc.hidden / big["hidden_size"], vocab_size=vocab,
                 draft_vocab=big["draft_vocab_size"], target_hidden=target_hidden,
                 aux_layers=tuple(real_layers(small_target_layers, target_layers)[i] for i in sc.aux_layers))
    if bc.hidden != target_hidden:
        raise ValueError(f"the head's width {bc.hidden} must be its target's, {target_hidden} (it shares the embedding)")
    if sc.qkv_bias or sc.fc_bias or sc.draft_vocab > bc.draft_vocab or sc.target_hidden >= target_hidden:
        raise ValueError("the large head must contain the small one (and biases are not supported here)")
    rope = {k: v for k, v in small.hf_config.to_dict().items() if k.startswith("rope")}
    hf = LlamaConfig(hidden_size=bc.hidden, num_attention_heads=bc.heads, num_key_value_heads=bc.kv_heads,
                     head_dim=bc.head_dim, intermediate_size=bc.intermediate, rms_norm_eps=bc.eps,
                     max_position_embeddings=bc.max_positions, vocab_size=bc.vocab_size, **rope)
    with torch.device("meta"):
        head = Eagle3Head(bc, hf)
    head = head.to(dtype).to_empty(device=device)
    g = torch.Generator(device=device).manual_seed(seed)
    for name, w in head.named_parameters():
        if name != "embed_tokens.weight":
            w.fill_(1.0) if "norm" in name else w.normal_(0, 0.02, generator=g)
    head.embed_tokens.weight = embed if isinstance(embed, nn.Parameter) else nn.Parameter(embed, requires_grad=False)
    head.rotary = Rotary(hf, bc.max_positions).to(device)
    head.d2t = torch.zeros(bc.draft_vocab, dtype=torch.int64, device=device)
    _fill(head, small, sc, bc, device, dtype)
    return head.eval()


def is_embedded(path: str | Path) -> bool:
    return (Path(path) / EMBED).is_file()


def _spec(path: str | Path) -> tuple[dict, Path, Path]:
    """(embed.json, the small head's directory, the small target's directory)."""
    path = Path(path)
    spec = json.loads((path / EMBED).read_text())
    return spec, (path / spec["source"]).resolve(), (path / spec["target"]).resolve()


def embedded_aux_layers(path: str | Path, target_layers: int) -> tuple[int, ...]:
    """The aux layers an embedded head reads (its config only, no weights)."""
    from cluster.engine.drafters.eagle3_load import head_config

    _, source, small_target = _spec(path)
    small_layers = LlamaConfig.from_pretrained(small_target).num_hidden_layers
    return tuple(real_layers(small_layers, target_layers)[i] for i in head_config(source, small_layers)[0].aux_layers)


def load_embedded_head(path: str | Path, embed: torch.Tensor, target_layers: int,
                       max_positions: int | None = None) -> Eagle3Head:
    """A directory holding embed.json: {"source": the small head's directory, "target": its
    small target's directory (both relative to it), "shape": a name in SHAPES or the head's
    fields, "overrides": fields over the named shape, "seed": for the padding's random values}."""
    from cluster.engine.drafters.eagle3_load import load_head, target_embedding

    spec, source, small_target = _spec(path)
    small_layers = LlamaConfig.from_pretrained(small_target).num_hidden_layers
    small_embed = target_embedding(small_target, torch.float32)
    small = load_head(source, small_layers, torch.float32, "cpu", small_embed, small_embed.shape[0], max_positions)
    shape = spec["shape"]
    big = {**(SHAPES[shape] if isinstance(shape, str) else shape), **spec.get("overrides", {})}
    return embed_head(small, small_layers, embed, target_layers, big, spec.get("seed", 0))


def _fill(head: Eagle3Head, small: Eagle3Head, sc: HeadConfig, bc: HeadConfig, device, dtype) -> None:
    s, b = sc.shape(), bc.shape()
    sp = {k: v.float().to(device) for k, v in small.state_dict().items() if k != "embed_tokens.weight"}
    qkv_rows, attn_cols, q_scale = index_maps(s, b, device)
    hid = torch.arange(s.hidden, device=device)
    inter = torch.arange(s.intermediate, device=device)
    const, t_const = s.hidden, sc.target_hidden  # CONST in the head's stream, and in the target's
    norm_scale = math.sqrt(s.hidden / b.hidden)
    # fc: each aux block's real dims; CONST <- the first block's CONST (A); no row reads the
    # blocks' CONST otherwise (it would write A into padded dims)
    fc_cols = torch.cat([k * bc.target_hidden + torch.arange(sc.target_hidden, device=device)
                         for k in range(len(bc.aux_layers))])
    fc = head.fc.weight
    for k in range(len(bc.aux_layers)):
        fc[:, k * bc.target_hidden + t_const] = 0
    place(fc, sp["fc.weight"], hid, fc_cols, None)
    fc[const] = 0
    fc[const, t_const] = 1.0
    # qkv over [input_layernorm(embed) | hidden_norm(x)]: both halves' real dims, no CONST
    qkv = sp["qkv_proj.weight"].clone()
    qkv[: s.heads * s.head_dim] *= q_scale
    w = head.qkv_proj.weight
    w[:, const] = 0
    w[:, b.hidden + const] = 0
    place(w, qkv, qkv_rows, torch.cat([hid, b.hidden + hid]), None)
    head.o_proj.weight.zero_()  # padded q heads beside a real one read its values
    place(head.o_proj.weight, sp["o_proj.weight"], hid, attn_cols, None)
    mlp = head.mlp
    place(mlp.gate_up_proj.weight, sp["mlp.gate_up_proj.weight"], torch.cat([inter, b.intermediate + inter]), hid, const)
    place(mlp.down_proj.weight, sp["mlp.down_proj.weight"], hid, inter, None)
    for name in ("input_layernorm", "hidden_norm", "post_attention_layernorm", "norm"):
        nw = getattr(head, name).weight
        nw[hid] = sp[name + ".weight"].to(dtype) * norm_scale
        nw[const] = 0
    if sc.norm_before_residual:  # the residual is hidden_norm(x): keep CONST positive there
        head.hidden_norm.weight[const] = 1.0
    head.norm.weight[const] = FINAL_SCALE
    lm = head.lm_head.weight
    lm[:, hid] = 0
    lm[:, const] = -PAD_LOGIT
    lm[: sc.draft_vocab] = 0
    lm[: sc.draft_vocab, : s.hidden] = sp["lm_head.weight"].to(dtype)
    head.d2t[: sc.draft_vocab] = small.d2t.to(device)
