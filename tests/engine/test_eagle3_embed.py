"""The demo target's EAGLE-3 head embedded in a larger head's shape drafts what the small head
drafts, over the demo target embedded the same way: the 8B-shape runs get the trained head's
acceptance at an 8B head's cost."""

from __future__ import annotations

import json

import pytest
import torch

from cluster.config import parse_config, resolve_model_path
from cluster.engine.config import EngineConfig
from cluster.engine.drafters.eagle3 import Eagle3Drafter
from cluster.engine.drafters.eagle3_embed import SHAPES, embed_head, embedded_aux_layers
from cluster.engine.drafters.eagle3_load import load_head
from cluster.engine.engine import Engine
from cluster.engine.sampling import SamplingParams
from cluster.engine.scheduling.sequence import SpecParams
from cluster.engine.worker.embedded import embed_llama
from cluster.engine.worker.loader import load_model, load_tokenizer

# small stand-ins for the 8B target and head: wider, deeper, more and wider heads, more vocabulary
BIG = dict(vocab_size=5000, hidden_size=512, num_hidden_layers=9, num_attention_heads=32,
           num_key_value_heads=8, head_dim=64, intermediate_size=1024, max_position_embeddings=2048)
BIG_HEAD = dict(hidden_size=512, num_attention_heads=16, num_key_value_heads=8, head_dim=64,
                intermediate_size=1024, draft_vocab_size=4500)  # above the head's 4,096
PROMPTS = ["def fibonacci(n):", "class Stack:\n    def push(self, x):"]
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


def _run(target, head, tok):
    cfg = EngineConfig(max_num_seqs=2, max_model_len=256, device="cpu", dtype="float32")
    eng = Engine(target, tok, cfg, {"eagle3": Eagle3Drafter(head, 4, 300)}, "eagle3")
    out = eng.generate(PROMPTS, GREEDY, SpecParams("fixed", 4))
    return [r["token_ids"] for r in out], eng.totals["drafted"], eng.totals["accepted"]


def test_embedded_head_drafts_what_the_small_head_drafts(demo_pair):
    tok = load_tokenizer(demo_pair[0])
    small_t = load_model(demo_pair[0], torch.float32, "cpu")
    small_h = load_head(demo_pair[0] / "eagle3", small_t.shape.layers, embed=small_t.embed_tokens.weight,
                        target_vocab=small_t.shape.vocab_size)
    big_t = embed_llama(small_t, BIG, "cpu", torch.float32)
    big_h = embed_head(small_h, small_t.shape.layers, big_t.embed_tokens.weight, big_t.shape.layers, BIG_HEAD)
    assert (big_h.cfg.hidden, big_h.cfg.heads, big_h.cfg.draft_vocab) == (512, 16, 4500)
    assert big_h.cfg.aux_layers == (2, 5, 8)  # the demo's layers 1, 3, 5 sit at 2, 5, 8 of 9
    small, big = _run(small_t, small_h, tok), _run(big_t, big_h, tok)
    assert big[0] == small[0]
    assert big[1:] == small[1:]  # the same drafts accepted, step for step
    assert small[2] > 0


def test_embedded_head_keeps_the_small_heads_fc_and_logits(demo_pair):
    """fc writes the small head's input, A in CONST and exactly 0 elsewhere; the draft logits
    are the small head's, padded draft tokens far below every real one."""
    from cluster.engine.worker.embedded import A

    small_t = load_model(demo_pair[0], torch.float32, "cpu")
    small_h = load_head(demo_pair[0] / "eagle3", small_t.shape.layers, embed=small_t.embed_tokens.weight,
                        target_vocab=small_t.shape.vocab_size)
    big_t = embed_llama(small_t, BIG, "cpu", torch.float32)
    big_h = embed_head(small_h, small_t.shape.layers, big_t.embed_tokens.weight, big_t.shape.layers, BIG_HEAD)
    d_s, d_b = small_h.cfg.hidden, big_h.cfg.hidden
    g = torch.Generator().manual_seed(0)
    aux_s = torch.randn(5, 3, d_s, generator=g)
    aux_b = torch.zeros(5, 3, d_b)
    aux_b[..., :d_s], aux_b[..., d_s] = aux_s, A  # the target's stream: real dims, then CONST
    x_s, x_b = small_h.combine(aux_s.flatten(1)), big_h.combine(aux_b.flatten(1))
    assert torch.allclose(x_b[:, :d_s], x_s, atol=1e-5)
    assert torch.all(x_b[:, d_s] == A) and torch.all(x_b[:, d_s + 1:] == 0)
    out_b = torch.zeros(5, d_b)
    out_b[:, :d_s], out_b[:, d_s] = x_s, A
    a, b = small_h.logits(x_s), big_h.logits(out_b)
    assert torch.allclose(b[:, : a.shape[1]], a, atol=1e-3)
    assert b[:, a.shape[1]:].max() < a.min() - 100


def test_embedded_head_directory_serves_through_build_engine(demo_pair, tmp_path):
    """embed.json directories for the target and the head: build_engine builds both, the
    target's passes capture the moved aux layers, and greedy drafting stays lossless."""
    from cluster.serve.build import build_engine, eagle3_aux_layers

    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "embed.json").write_text(json.dumps({"source": str(demo_pair[0]), "shape": BIG}))
    (tmp_path / "head").mkdir()
    (tmp_path / "head" / "embed.json").write_text(json.dumps(
        {"source": str(demo_pair[0] / "eagle3"), "target": str(demo_pair[0]), "shape": BIG_HEAD}))
    cfg = parse_config({"models": {"target": str(tmp_path / "target"), "draft": None, "eagle3": str(tmp_path / "head"),
                                   "drafter": "eagle3", "device": "cpu", "dtype": "float32"},
                        "engine": {"max_num_seqs": 4, "max_model_len": 256}})
    assert eagle3_aux_layers(cfg, 9) == (2, 5, 8)
    e = build_engine(cfg)
    assert e.drafters["eagle3"].head.cfg.hidden == 512 and e.runner.model.aux_layers == (2, 5, 8)
    plain = e.generate(PROMPTS, GREEDY, SpecParams("off"))
    spec = e.generate(PROMPTS, GREEDY, SpecParams("fixed", 4), "eagle3")
    assert [r["token_ids"] for r in spec] == [r["token_ids"] for r in plain]
    assert sum(r["spec"]["accepted"] for r in spec) > 0


def test_demo_8b_eagle3_is_an_8b_heads_shape():
    """demo-8b-eagle3 (embed.json only) names an 8B EAGLE-3 head's shape over the demo head;
    its aux layers are where demo-8b-target holds the demo's layers 1, 3 and 5."""
    from pathlib import Path

    path = Path(resolve_model_path("demo-8b-eagle3"))
    spec = json.loads((path / "embed.json").read_text())
    assert (path / spec["source"]).resolve() == (Path(resolve_model_path("demo-target")) / "eagle3").resolve()
    big = SHAPES[spec["shape"]]
    assert (big["hidden_size"], big["num_attention_heads"], big["num_key_value_heads"], big["head_dim"],
            big["intermediate_size"], big["draft_vocab_size"]) == (4096, 32, 8, 128, 14336, 32000)
    assert embedded_aux_layers(path, 32) == (6, 19, 31)


@pytest.mark.parametrize("field,value", [("draft_vocab_size", 1000), ("hidden_size", 256)])
def test_a_head_that_cannot_hold_the_small_one_is_refused(demo_pair, field, value):
    small_t = load_model(demo_pair[0], torch.float32, "cpu")
    small_h = load_head(demo_pair[0] / "eagle3", small_t.shape.layers, embed=small_t.embed_tokens.weight,
                        target_vocab=small_t.shape.vocab_size)
    big_t = embed_llama(small_t, BIG, "cpu", torch.float32)
    with pytest.raises(ValueError):
        embed_head(small_h, small_t.shape.layers, big_t.embed_tokens.weight, big_t.shape.layers,
                   {**BIG_HEAD, field: value})
