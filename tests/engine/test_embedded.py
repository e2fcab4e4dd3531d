"""The demo pair embedded in a larger Llama shape computes the demo pair's function: the
large benchmark's acceptance is then the trained pair's, measured at the large size."""

from __future__ import annotations

import pytest
import torch

from cluster.engine.config import EngineConfig
from cluster.engine.engine import Engine
from cluster.engine.sampling import SamplingParams
from cluster.engine.scheduling.kv_cache import KVCache
from cluster.engine.scheduling.sequence import SpecParams
from cluster.engine.worker.embedded import embed_llama
from cluster.engine.worker.loader import load_model
from cluster.engine.worker.runner import Runner

# a small stand-in for the 8B shape: wider, deeper, more heads, wider heads, more vocabulary
BIG = dict(vocab_size=5000, hidden_size=512, num_hidden_layers=9, num_attention_heads=32,
           num_key_value_heads=8, head_dim=64, intermediate_size=1024, max_position_embeddings=2048)
PROMPT = [5, 17, 300, 42, 99, 1000, 7, 7, 8, 2048, 3]


def _logits(model, ids):
    s = model.shape
    kv = KVCache.dense(s.layers, 1, 64, s.kv_heads, s.head_dim, torch.float32, "cpu")
    return Runner(model, kv, "sdpa").forward([0], [0], [ids], last_only=False)[0]


def test_embedded_target_keeps_the_small_models_logits(demo_pair):
    small = load_model(demo_pair[0], torch.float32, "cpu")
    big = embed_llama(small, BIG, "cpu", torch.float32)
    assert big.shape.layers == 9 and big.shape.vocab_size == 5000
    a, b = _logits(small, PROMPT), _logits(big, PROMPT)
    assert torch.allclose(a, b[:, :4096], atol=1e-4)
    assert b[:, 4096:].max() < a.min() - 100  # padded tokens are never picked


def test_embedded_pair_decodes_like_the_demo_pair(demo_pair):
    tok = __import__("transformers").AutoTokenizer.from_pretrained(demo_pair[0])
    cfg = EngineConfig(max_num_seqs=2, max_model_len=256, device="cpu", dtype="float32")
    prompts = ["def fibonacci(n):", "class Stack:\n    def push(self, x):"]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    runs = []
    for build in (lambda p: load_model(p, torch.float32, "cpu"),
                  lambda p: embed_llama(load_model(p, torch.float32, "cpu"),
                                        {**BIG, "hidden_size": 512 if p == demo_pair[0] else 256,
                                         "num_hidden_layers": 9 if p == demo_pair[0] else 3}, "cpu", torch.float32)):
        from cluster.engine.drafters.model import ModelDrafter

        target, draft = build(demo_pair[0]), build(demo_pair[1])
        eng = Engine(target, tok, cfg, {"model": ModelDrafter(draft, 4, 256)}, "model")
        out = eng.generate(prompts, params, SpecParams("fixed", 4))
        runs.append(([r["token_ids"] for r in out], eng.totals["accepted"] / eng.totals["drafted"]))
    (small_ids, small_acc), (big_ids, big_acc) = runs
    assert big_ids == small_ids
    assert abs(big_acc - small_acc) < 0.05 and big_acc > 0.3  # the trained pair's acceptance survives


def test_embed_json_directory_loads_through_load_model(demo_pair, tmp_path):
    """A directory with embed.json is a model for load_model (so for the serving path)."""
    import json

    (tmp_path / "embed.json").write_text(json.dumps({"source": str(demo_pair[0]), "shape": BIG}))
    small = load_model(demo_pair[0], torch.float32, "cpu")
    big = load_model(tmp_path, torch.float32, "cpu")
    assert big.shape.hidden == 512
    assert torch.allclose(_logits(small, PROMPT), _logits(big, PROMPT)[:, :4096], atol=1e-4)


def test_embedded_model_directory_uses_its_sources_tokenizer():
    """demo-8b-* hold only embed.json: the tokenizer is the demo pair's, read through it."""
    from cluster.config import resolve_model_path
    from cluster.engine.worker.loader import load_tokenizer

    text = "def fibonacci(n):\n    return n"
    big = load_tokenizer(resolve_model_path("demo-8b-target"))
    assert big.encode(text) == load_tokenizer(resolve_model_path("demo-target")).encode(text)
    assert big.eos_token_id is not None


def test_demo_70b_target_is_the_demo_target_in_llama_70b_dimensions():
    """demo-70b-target (embed.json only) names the Llama-3.1-70B shape over the demo target,
    with the demo pair's tokenizer; the shape is read, not built (140 GB in bf16)."""
    import json
    from pathlib import Path

    from cluster.config import resolve_model_path
    from cluster.engine.worker.embedded import SHAPES
    from cluster.engine.worker.loader import load_tokenizer

    path = Path(resolve_model_path("demo-70b-target"))
    spec = json.loads((path / "embed.json").read_text())
    assert (path / spec["source"]).resolve() == Path(resolve_model_path("demo-target")).resolve()
    big = SHAPES[spec["shape"]]()
    assert (big["hidden_size"], big["num_hidden_layers"], big["num_attention_heads"], big["num_key_value_heads"],
            big["intermediate_size"], big["vocab_size"]) == (8192, 80, 64, 8, 28672, 128256)
    text = "def fibonacci(n):\n    return n"
    assert load_tokenizer(path).encode(text) == load_tokenizer(resolve_model_path("demo-target")).encode(text)


def test_demo_70b_construction_keeps_the_demo_logits_at_reduced_size(demo_pair, tmp_path):
    """The 70B construction (64 q heads over 8 KV heads of 128 dims, the 128k vocabulary)
    loaded through load_model with fewer layers and a narrower residual stream, so it fits a
    CPU test: the demo target's logits on its own tokens, padded tokens far below."""
    import json

    overrides = {"hidden_size": 512, "num_hidden_layers": 7, "intermediate_size": 1024, "head_dim": 128}
    (tmp_path / "embed.json").write_text(json.dumps({"source": str(demo_pair[0]), "shape": "llama-3.1-70b",
                                                     "overrides": overrides}))
    small, big = load_model(demo_pair[0], torch.float32, "cpu"), load_model(tmp_path, torch.float32, "cpu")
    s = big.shape
    assert (s.heads, s.kv_heads, s.head_dim, s.vocab_size, s.layers) == (64, 8, 128, 128256, 7)
    a, b = _logits(small, PROMPT), _logits(big, PROMPT)
    assert torch.allclose(a, b[:, :4096], atol=1e-4)
    assert b[:, 4096:].max() < a.min() - 100


@pytest.mark.parametrize("size", [2, 4])
def test_each_rank_builds_its_slice_of_the_embedded_model(demo_pair, size):
    """A tensor-parallel rank's embedded model is exactly its checkpoint slice
    (cluster.engine.worker.sharding) of the one-process model: a real layer, a padding layer, the
    vocabulary-split embedding and head (the last slice zero-padded), the replicated norm."""
    from cluster.engine.distributed.parallel import Group
    from cluster.engine.worker.embedded import embed_llama_shard, hf_layer_weights
    from cluster.engine.worker.sharding import local_shape, take, weight_slice

    small = load_model(demo_pair[0], torch.float32, "cpu")
    full = embed_llama(small, BIG, "cpu", torch.float32)
    b = full.shape
    ends = {"model.embed_tokens.weight": lambda m: m.embed_tokens.weight, "lm_head.weight": lambda m: m.lm_head.weight,
            "model.norm.weight": lambda m: m.norm.weight}
    for rank in range(size):
        part = embed_llama_shard(small, BIG, "cpu", torch.float32, 0, Group(rank, size, torch.device("cpu")))
        assert part.shape == local_shape(b, size)
        for i in (0, 1):  # layer 0 holds a demo layer; layer 1 is padding (9 layers over the demo's 6)
            mine = hf_layer_weights(part.layers[i], part.shape)
            for name, t in hf_layer_weights(full.layers[i], b).items():
                want = take(t, list(t.shape), weight_slice(f"model.layers.{i}.{name}", b, rank, size))
                assert torch.equal(mine[name], want), (rank, i, name)
        for name, get in ends.items():
            t = get(full)
            assert torch.equal(get(part), take(t, list(t.shape), weight_slice(name, b, rank, size))), (rank, name)


def test_fusing_frees_each_part_it_fuses(demo_pair):
    """Fusing q/k/v and gate/up consumes the Hugging Face-named parts: each is freed once its
    fused tensor exists, so a rank never holds its weights twice (the TP 2 70B shard, 66 GiB a
    rank, ran out of an H100's memory while fusing when the parts stayed alive)."""
    import weakref

    from cluster.engine.worker.embedded import hf_layer_weights
    from cluster.engine.worker.model import _fuse

    small = load_model(demo_pair[0], torch.float32, "cpu")
    s = small.shape
    state = {f"model.layers.{i}.{n}": t.clone() for i, layer in enumerate(small.layers)
             for n, t in hf_layer_weights(layer, s).items()}
    state |= {"model.embed_tokens.weight": small.embed_tokens.weight.clone(),
              "lm_head.weight": small.lm_head.weight.clone(), "model.norm.weight": small.norm.weight.clone()}
    parts = [f"model.layers.{i}.{n}" for i in range(s.layers)
             for n in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
                       "mlp.gate_proj.weight", "mlp.up_proj.weight")]
    alive = [weakref.ref(state[p]) for p in parts]
    fused = _fuse(state, s)
    assert not state and not any(r() is not None for r in alive)
    for i, layer in enumerate(small.layers):
        assert torch.equal(fused[f"layers.{i}.self_attn.qkv_proj.weight"], layer.self_attn.qkv_proj.weight)
        assert torch.equal(fused[f"layers.{i}.mlp.gate_up_proj.weight"], layer.mlp.gate_up_proj.weight)


def test_demo_8b_draft_1b_is_the_demo_drafter_in_llama_1b_dimensions(demo_pair):
    """demo-8b-draft-1b: the demo drafter in Llama-3.2-1B's shape (32 q heads over 8 KV heads of
    64 dims, 16 layers, the 128k vocabulary), read through its embed.json; built with fewer
    layers and a narrower stream here, it keeps the demo drafter's logits."""
    import json
    from pathlib import Path

    from cluster.config import resolve_model_path
    from cluster.engine.worker.embedded import SHAPES

    path = Path(resolve_model_path("demo-8b-draft-1b"))
    spec = json.loads((path / "embed.json").read_text())
    assert (path / spec["source"]).resolve() == Path(demo_pair[1]).resolve()
    big = SHAPES[spec["shape"]]()
    assert (big["hidden_size"], big["num_hidden_layers"], big["num_attention_heads"], big["num_key_value_heads"],
            big["head_dim"], big["intermediate_size"], big["vocab_size"]) == (2048, 16, 32, 8, 64, 8192, 128256)
    small = load_model(demo_pair[1], torch.float32, "cpu")
    reduced = embed_llama(small, {**big, "hidden_size": 256, "num_hidden_layers": 3, "intermediate_size": 512},
                          "cpu", torch.float32, seed=1)
    a, b = _logits(small, PROMPT), _logits(reduced, PROMPT)
    assert torch.allclose(a, b[:, :4096], atol=1e-4)
    assert b[:, 4096:].max() < a.min() - 100
