"""EAGLE-3 heads as they are published: reading the three layouts, writing the original one.

- The original release (EAGLE3-LLaMA3.1-Instruct-8B and kin): config.json is the layer's Llama
  config (architectures LlamaForCausalLMEagle3, draft_vocab_size), weights `midlayer.*`, `fc`,
  `norm`, `lm_head`, `d2t`/`t2d`; no embedding (the target's is shared).
- `LlamaForCausalLMEagle3` repacks: the same config, weights under `model.` and/or
  `layers.0.` instead of `midlayer.`, sometimes with their own `embed_tokens`.
- The speculators layout (vLLM's `speculators` library): config.json has
  `speculators_model_type: eagle3`, the layer config under `transformer_layer_config`, a
  `speculators_config`; weights `layers.0.*`, `fc` (with a bias), `embed_tokens`, ...

Which target layers feed fc: `eagle_aux_hidden_state_layer_ids` (top level or in
`eagle_config`) where given, else low/middle/high as vLLM picks them, (2, L//2, L-3). An id
names the input of that layer (vLLM's reading; SGLang reads an explicit id as the output of
that layer, one later). norm_before_residual: the checkpoint's value; absent, False, except
in the speculators layout, where vLLM takes True.

Every tensor of a file must be known and every weight the head needs present: an unknown or
missing name is an error that names it, never a silently random weight.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch

from cluster.engine.drafters.eagle3_head import Eagle3Head, HeadConfig

CONFIG, WEIGHTS = "config.json", "model.safetensors"
ARCH = "LlamaForCausalLMEagle3"
_LAYER = {  # published name (after the prefixes are normalised) -> Eagle3Head parameter
    "layers.0.input_layernorm.weight": "input_layernorm.weight",
    "layers.0.hidden_norm.weight": "hidden_norm.weight",
    "layers.0.post_attention_layernorm.weight": "post_attention_layernorm.weight",
    "layers.0.self_attn.o_proj.weight": "o_proj.weight",
    "layers.0.mlp.down_proj.weight": "mlp.down_proj.weight",
    "fc.weight": "fc.weight", "fc.bias": "fc.bias", "norm.weight": "norm.weight",
    "lm_head.weight": "lm_head.weight", "embed_tokens.weight": "embed_tokens.weight",
}
_FUSED = {"layers.0.self_attn.q_proj": "qkv", "layers.0.self_attn.k_proj": "qkv", "layers.0.self_attn.v_proj": "qkv",
          "layers.0.mlp.gate_proj": "gate_up", "layers.0.mlp.up_proj": "gate_up"}


class HeadFormatError(ValueError):
    """A head directory that is not an EAGLE-3 head we can load; the message names the key."""


def default_aux_layers(target_layers: int) -> tuple[int, ...]:
    """Low, middle and high layers, as vLLM chooses them (clamped for very shallow targets)."""
    return tuple(min(max(i, 0), target_layers - 1) for i in (2, target_layers // 2, target_layers - 3))


def read_config(path: str | Path) -> tuple[dict, dict, str]:
    """(the whole config.json, the decoder layer's config, layout: 'eagle3' or 'speculators')."""
    path = Path(path)
    if not (path / CONFIG).is_file():
        raise FileNotFoundError(f"{path} is not an EAGLE-3 head directory (no {CONFIG})")
    cfg = json.loads((path / CONFIG).read_text())
    if "speculators_model_type" in cfg:
        if cfg["speculators_model_type"] != "eagle3":
            raise HeadFormatError(f"{path}: speculators_model_type {cfg['speculators_model_type']!r} is not eagle3")
        if not isinstance(cfg.get("transformer_layer_config"), dict):
            raise HeadFormatError(f"{path}: speculators config without transformer_layer_config")
        return cfg, cfg["transformer_layer_config"], "speculators"
    if "hidden_size" not in cfg:
        raise HeadFormatError(f"{path}/{CONFIG}: neither a Llama layer config (hidden_size) nor a speculators one")
    return cfg, cfg, "eagle3"


def aux_layer_ids(cfg: dict, target_layers: int) -> tuple[int, ...]:
    ids = cfg.get("eagle_aux_hidden_state_layer_ids") or (cfg.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids")
    if not ids:
        return default_aux_layers(target_layers)
    bad = [i for i in ids if not 0 <= int(i) < target_layers]
    if bad:
        raise HeadFormatError(f"eagle_aux_hidden_state_layer_ids {ids} name layers outside the target's 0..{target_layers - 1}")
    return tuple(int(i) for i in ids)


def head_config(path: str | Path, target_layers: int, target_vocab: int | None = None,
                max_positions: int | None = None):
    """(HeadConfig, the layer's transformers LlamaConfig) of a head directory."""
    from transformers import LlamaConfig

    cfg, layer, layout = read_config(path)
    hf = LlamaConfig(**{k: v for k, v in layer.items() if k not in ("architectures", "model_type")})
    vocab = target_vocab or layer["vocab_size"]
    draft_vocab = cfg.get("draft_vocab_size") or layer.get("draft_vocab_size") or vocab
    nbr = cfg.get("norm_before_residual", layer.get("norm_before_residual", layout == "speculators"))
    heads = layer["num_attention_heads"]
    hc = HeadConfig(hidden=layer["hidden_size"], heads=heads, kv_heads=layer.get("num_key_value_heads") or heads,
                    head_dim=layer.get("head_dim") or layer["hidden_size"] // heads,
                    intermediate=layer["intermediate_size"], eps=layer.get("rms_norm_eps", 1e-6), vocab_size=vocab,
                    draft_vocab=draft_vocab, target_hidden=cfg.get("target_hidden_size") or layer["hidden_size"],
                    aux_layers=aux_layer_ids({**layer, **cfg}, target_layers), norm_before_residual=bool(nbr),
                    qkv_bias=bool(layer.get("attention_bias", False)),
                    max_positions=max_positions or layer.get("max_position_embeddings", 2048))
    return hc, hf


def _normalise(name: str) -> str:
    name = name.removeprefix("model.")
    return "layers.0." + name.removeprefix("midlayer.") if name.startswith("midlayer.") else name


def convert_state(state: dict[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
    """Published names -> Eagle3Head's (q/k/v and gate/up fused); unknown names refused."""
    out: dict[str, torch.Tensor] = {}
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for raw, t in state.items():
        name = _normalise(raw)
        stem, _, kind = name.rpartition(".")
        if name in _LAYER:
            out[_LAYER[name]] = t
        elif stem in _FUSED and kind in ("weight", "bias"):
            parts.setdefault(f"{_FUSED[stem]}.{kind}", {})[stem.rpartition(".")[2]] = t
        elif name in ("d2t", "t2d"):
            out[name] = t
        else:
            raise HeadFormatError(f"{where}: unknown tensor {raw!r} in an EAGLE-3 head")
    for key, names in (("qkv", ("q_proj", "k_proj", "v_proj")), ("gate_up", ("gate_proj", "up_proj"))):
        for kind in ("weight", "bias"):
            got = parts.get(f"{key}.{kind}")
            if got is None:
                continue
            missing = [n for n in names if n not in got]
            if missing:
                raise HeadFormatError(f"{where}: {missing[0]}.{kind} missing beside {sorted(got)}")
            dest = "qkv_proj" if key == "qkv" else "mlp.gate_up_proj"
            out[f"{dest}.{kind}"] = torch.cat([got[n] for n in names])
    return out


def load_head(path: str | Path, target_layers: int, dtype: torch.dtype = torch.float32, device="cpu",
              embed: torch.Tensor | None = None, target_vocab: int | None = None,
              max_positions: int | None = None) -> Eagle3Head:
    """A head from `path` in any published layout. `embed`: the target's [V, D] embedding,
    used (shared, not copied) where the head has none of its own."""
    from safetensors.torch import load_file

    path = Path(path)
    hc, hf = head_config(path, target_layers, target_vocab, max_positions)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path}")
    raw: dict[str, torch.Tensor] = {}
    for f in files:
        raw.update(load_file(f))
    state = convert_state(raw, str(path))
    # biases are the files' to say (the speculators layout's fc has one)
    hc = replace(hc, fc_bias="fc.bias" in state, qkv_bias=hc.qkv_bias or "qkv_proj.bias" in state)
    t2d = state.pop("t2d", None)
    if "d2t" not in state:
        if hc.draft_vocab != hc.vocab_size:
            raise HeadFormatError(f"{path}: d2t missing for a draft vocabulary of {hc.draft_vocab} < {hc.vocab_size}")
        state["d2t"] = torch.zeros(hc.draft_vocab, dtype=torch.int64)
    if t2d is not None and int(t2d.sum()) != hc.draft_vocab:
        raise HeadFormatError(f"{path}: t2d marks {int(t2d.sum())} target ids, draft_vocab_size is {hc.draft_vocab}")
    if "embed_tokens.weight" not in state:
        if embed is None:
            raise HeadFormatError(f"{path}: no embed_tokens.weight and no target embedding to share")
        state["embed_tokens.weight"] = embed
    with torch.device("meta"):
        head = Eagle3Head(hc, hf)
    expected = {n for n, _ in head.named_parameters()} | {"d2t"}
    missing = sorted(expected - set(state))
    if missing:
        raise HeadFormatError(f"{path}: weight {missing[0]!r} missing (the head needs {', '.join(missing)})")
    state["d2t"] = state["d2t"].long()
    shared = state["embed_tokens.weight"] is embed
    head.load_state_dict({k: v if (k == "d2t" or (shared and k == "embed_tokens.weight")) else v.to(dtype)
                          for k, v in state.items()}, strict=True, assign=True)
    head.rotary = type(head.rotary)(hf, hc.max_positions)  # buffers were on meta
    return head.to(device).eval()


def target_embedding(target_dir: str | Path, dtype: torch.dtype) -> torch.Tensor:
    """The target's token embedding alone, read from its safetensors (a drafter replica shares
    no memory with the target, and needs nothing else of it)."""
    from safetensors import safe_open

    for f in sorted(Path(target_dir).glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            for key in ("model.embed_tokens.weight", "embed_tokens.weight"):
                if key in st.keys():  # noqa: SIM118 - safe_open is not a dict
                    return st.get_tensor(key).to(dtype)
    raise FileNotFoundError(f"no embed_tokens.weight in the safetensors of {target_dir}")


def save_head(head: Eagle3Head, path: str | Path, meta: dict | None = None) -> Path:
    """Write the original release's layout (midlayer.*, d2t/t2d, no embedding: the target's is
    shared) in bf16, config.json beside it; `meta` goes under its `spec_cluster` key."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    c = head.cfg
    sd = {k: v.detach() for k, v in head.state_dict().items()}
    q, k, v = sd.pop("qkv_proj.weight").split([c.heads * c.head_dim, c.kv_heads * c.head_dim, c.kv_heads * c.head_dim])
    gate, up = sd.pop("mlp.gate_up_proj.weight").chunk(2)
    out = {"midlayer.self_attn.q_proj.weight": q, "midlayer.self_attn.k_proj.weight": k,
           "midlayer.self_attn.v_proj.weight": v, "midlayer.mlp.gate_proj.weight": gate,
           "midlayer.mlp.up_proj.weight": up}
    inverse = {mine: pub.replace("layers.0.", "midlayer.") for pub, mine in _LAYER.items()}
    for name, t in sd.items():
        if name in inverse and name != "embed_tokens.weight":
            out[inverse[name]] = t
    out = {k: t.to(torch.bfloat16).contiguous() for k, t in out.items()}
    d2t = head.d2t.cpu()
    t2d = torch.zeros(c.vocab_size, dtype=torch.bool)
    t2d[torch.arange(c.draft_vocab) + d2t] = True
    out.update(d2t=d2t.contiguous(), t2d=t2d)
    save_file(out, path / WEIGHTS)
    cfg = head.hf_config.to_dict()
    cfg.update(architectures=[ARCH], model_type="llama", num_hidden_layers=1, vocab_size=c.vocab_size,
               draft_vocab_size=c.draft_vocab, eagle_aux_hidden_state_layer_ids=list(c.aux_layers),
               norm_before_residual=c.norm_before_residual, tie_word_embeddings=False, torch_dtype="bfloat16")
    cfg.pop("dtype", None)
    if meta:
        cfg["spec_cluster"] = meta
    (path / CONFIG).write_text(json.dumps(cfg, indent=1) + "\n")
    return path / WEIGHTS
