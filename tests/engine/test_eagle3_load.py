"""EAGLE-3 heads in every published layout load to the same head; bad files name the bad key."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from cluster.engine.drafters.eagle3_load import HeadFormatError, load_head, save_head
from cluster.engine.scheduling.kv_cache import KVCache
from cluster.engine.worker.attention import AttnContext, make_backend
from cluster.engine.worker.loader import load_model
from tests.engine.eagle3_factory import random_head

DRAFT_VOCAB = 100


@pytest.fixture(scope="module")
def target(random_models):
    return load_model(random_models["llama"], torch.float32, "cpu")


@pytest.fixture(scope="module")
def head(target):
    return random_head(target, DRAFT_VOCAB, seed=1)


def _original(head, d):
    save_head(head, d)
    return d


def _repack(head, d):
    """LlamaForCausalLMEagle3 repack: model.-prefixed layers.0.*, its own embedding."""
    save_head(head, d)
    st = load_file(d / "model.safetensors")
    out = {("lm_head.weight" if k == "lm_head.weight" else k if k in ("d2t", "t2d")
            else "model." + k.replace("midlayer.", "layers.0.")): v for k, v in st.items()}
    out["model.embed_tokens.weight"] = head.embed_tokens.weight.detach().to(torch.bfloat16)
    save_file(out, d / "model.safetensors")
    return d


def _speculators(head, d):
    """vLLM speculators: config with transformer_layer_config, layers.0.*, fc with a bias."""
    save_head(head, d)
    st = load_file(d / "model.safetensors")
    out = {k.replace("midlayer.", "layers.0."): v for k, v in st.items()}
    out["embed_tokens.weight"] = head.embed_tokens.weight.detach().to(torch.bfloat16)
    out["fc.bias"] = torch.zeros(head.cfg.hidden, dtype=torch.bfloat16)
    save_file(out, d / "model.safetensors")
    layer = json.loads((d / "config.json").read_text())
    cfg = {"speculators_model_type": "eagle3", "architectures": ["Eagle3Speculator"],
           "transformer_layer_config": {k: v for k, v in layer.items() if k not in (
               "draft_vocab_size", "eagle_aux_hidden_state_layer_ids", "norm_before_residual")},
           "draft_vocab_size": layer["draft_vocab_size"], "norm_before_residual": False,
           "eagle_aux_hidden_state_layer_ids": layer["eagle_aux_hidden_state_layer_ids"],
           "speculators_config": {"algorithm": "eagle3", "proposal_methods": [{"proposal_type": "greedy",
                                                                               "speculative_tokens": 3}],
                                  "verifier": {"name_or_path": "random-llama", "architectures": ["LlamaForCausalLM"]}}}
    (d / "config.json").write_text(json.dumps(cfg))
    return d


LAYOUTS = {"original": _original, "repack": _repack, "speculators": _speculators}


def reference(head, ids, x):
    """The head written out with plain torch from vLLM's llama_eagle3 (causal, one sequence)."""
    c, sd = head.cfg, {k: v.float() for k, v in head.state_dict().items()}
    rms = lambda t, w: F.rms_norm(t, (t.shape[-1],), eps=c.eps) * w  # noqa: E731
    e = rms(sd["embed_tokens.weight"][ids], sd["input_layernorm.weight"])
    xn = rms(x, sd["hidden_norm.weight"])
    residual = xn if c.norm_before_residual else x
    qkv = torch.cat([e, xn], -1) @ sd["qkv_proj.weight"].T
    T = ids.shape[0]
    q, k, v = qkv.split([c.heads * c.head_dim, c.kv_heads * c.head_dim, c.kv_heads * c.head_dim], -1)
    q, k, v = (t.view(T, -1, c.head_dim).transpose(0, 1) for t in (q, k, v))
    cos, sin = head.rotary.cos[:T], head.rotary.sin[:T]

    def rot(t):
        a, b = t.chunk(2, -1)
        return torch.cat([a * cos - b * sin, b * cos + a * sin], -1)

    rep = c.heads // c.kv_heads
    a = F.scaled_dot_product_attention(rot(q), rot(k).repeat_interleave(rep, 0), v.repeat_interleave(rep, 0),
                                       is_causal=True)
    r = residual + a.transpose(0, 1).reshape(T, -1) @ sd["o_proj.weight"].T
    gate, up = (rms(r, sd["post_attention_layernorm.weight"]) @ sd["mlp.gate_up_proj.weight"].T).chunk(2, -1)
    r = r + (F.silu(gate) * up) @ sd["mlp.down_proj.weight"].T
    return r, rms(r, sd["norm.weight"]) @ sd["lm_head.weight"].T


def paged(head, ids, x):
    """The head through its paged-cache path (what the drafter runs)."""
    kv = KVCache.dense(1, 1, 64, head.cfg.kv_heads, head.cfg.head_dim, torch.float32, "cpu")
    head.backend = head.backend or make_backend("sdpa", torch.device("cpu"), torch.float32)
    ctx = AttnContext.build(kv, [0], [0], [len(ids)], "cpu")
    out = head(ids[None], x[None], ctx.positions, kv, ctx)[0]
    return out, head.logits(out)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_every_layout_loads_the_same_head(tmp_path, target, head, layout):
    d = LAYOUTS[layout](head, tmp_path / layout)
    got = load_head(d, target.shape.layers, embed=target.embed_tokens.weight, target_vocab=target.shape.vocab_size)
    assert got.cfg.aux_layers == head.cfg.aux_layers and got.cfg.draft_vocab == DRAFT_VOCAB
    want = {k: v.to(torch.bfloat16).float() for k, v in head.state_dict().items()}
    want["fc.bias"] = torch.zeros(head.cfg.hidden)  # the speculators file's own
    for name, t in got.state_dict().items():
        ref = want[name] if name != "embed_tokens.weight" or layout != "original" else head.embed_tokens.weight
        torch.testing.assert_close(t.float(), ref.float(), msg=f"{layout}: {name}")
    if layout == "original":  # no embedding in the file: the target's, shared
        assert got.embed_tokens.weight.data_ptr() == target.embed_tokens.weight.data_ptr()
    torch.manual_seed(0)
    ids, x = torch.randint(0, 256, (9,)), torch.randn(9, head.cfg.hidden)
    for a, b in zip(paged(got, ids, x), reference(got, ids, x)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert (got.target_ids(torch.arange(DRAFT_VOCAB)) == head.target_ids(torch.arange(DRAFT_VOCAB))).all()


def test_norm_before_residual_follows_the_checkpoint(tmp_path, target, head):
    d = _speculators(head, tmp_path / "nbr")
    cfg = json.loads((d / "config.json").read_text())
    cfg.pop("norm_before_residual")  # absent in a speculators config: vLLM's default, True
    (d / "config.json").write_text(json.dumps(cfg))
    got = load_head(d, target.shape.layers, target_vocab=target.shape.vocab_size)
    assert got.cfg.norm_before_residual
    ids, x = torch.randint(0, 256, (5,)), torch.randn(5, head.cfg.hidden) * 3
    for a, b in zip(paged(got, ids, x), reference(got, ids, x)):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def _edit(path, drop=(), add=None):
    st = load_file(path / "model.safetensors")
    for k in drop:
        st.pop(k)
    st.update(add or {})
    save_file(st, path / "model.safetensors")


@pytest.mark.parametrize("change,match", [
    ({"add": {"midlayer.self_attn.rotary_emb.inv_freq": torch.ones(4)}}, "unknown tensor 'midlayer.self_attn.rotary_emb.inv_freq'"),
    ({"add": {"verifier.lm_head.weight": torch.ones(4)}}, "unknown tensor 'verifier.lm_head.weight'"),
    ({"drop": ["fc.weight"]}, "weight 'fc.weight' missing"),
    ({"drop": ["norm.weight", "lm_head.weight"]}, "weight 'lm_head.weight' missing"),
    ({"drop": ["midlayer.self_attn.q_proj.weight"]}, "q_proj.weight missing"),
    ({"drop": ["d2t"]}, "d2t missing"),
])
def test_unknown_or_missing_keys_are_named(tmp_path, target, head, change, match):
    d = _original(head, tmp_path / "bad")
    _edit(d, **change)
    with pytest.raises(HeadFormatError, match=match):
        load_head(d, target.shape.layers, embed=target.embed_tokens.weight, target_vocab=target.shape.vocab_size)


def test_config_errors_are_named(tmp_path, target, head):
    d = _original(head, tmp_path / "cfg")
    with pytest.raises(HeadFormatError, match="no embed_tokens.weight"):
        load_head(d, target.shape.layers)  # nothing to share it from
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "eagle_aux_hidden_state_layer_ids": [0, 1, 7]}))
    with pytest.raises(HeadFormatError, match="outside the target's 0..1"):
        load_head(d, target.shape.layers, embed=target.embed_tokens.weight)
    (d / "config.json").write_text(json.dumps({"speculators_model_type": "medusa", "transformer_layer_config": {}}))
    with pytest.raises(HeadFormatError, match="'medusa' is not eagle3"):
        load_head(d, target.shape.layers, embed=target.embed_tokens.weight)
    with pytest.raises(FileNotFoundError, match="not an EAGLE-3 head directory"):
        load_head(tmp_path / "nowhere", target.shape.layers)
