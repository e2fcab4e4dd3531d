"""Logits match transformers' own implementation on the same weights (fp32, CPU)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from cluster.engine.scheduling.kv_cache import KVCache
from cluster.engine.worker.loader import load_model
from cluster.engine.worker.runner import Runner


def _setup(path):
    ref = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ours = load_model(path, torch.float32, "cpu")
    s = ours.shape
    kv = KVCache.dense(s.layers, 4, 128, s.kv_heads, s.head_dim, torch.float32, "cpu")
    return ref, Runner(ours, kv, "sdpa")


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_prefill_logits_match_transformers(random_models, kind):
    ref, runner = _setup(random_models[kind])
    ids = torch.randint(0, 255, (2, 37), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expect = ref(ids).logits
    got = runner.forward([0, 1], [0, 0], ids.tolist(), last_only=False)
    rel = (got - expect).abs().max() / expect.abs().max()
    assert rel < 1e-4, f"relative error {rel:.2e}"


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_incremental_decode_and_verify_match_full_forward(random_models, kind):
    """Prefill, one-token decode and a multi-token verify chunk over the cache all agree
    with one full forward, also when rows of different lengths share a padded batch."""
    ref, runner = _setup(random_models[kind])
    ids = torch.randint(0, 255, (1, 30), generator=torch.Generator().manual_seed(2))[0].tolist()
    with torch.no_grad():
        expect = ref(torch.tensor([ids])).logits[0]
    runner.forward([2], [0], [ids[:20]], last_only=True)                   # prefill
    one = runner.forward([2], [20], [ids[20:21]], last_only=True)[0]       # decode
    # a verify chunk of 5, batched with a short unrelated row (padding)
    runner.forward([3], [0], [ids[:3]], last_only=True)
    chunk = runner.forward([2, 3], [21, 3], [ids[21:26], ids[3:4]], last_only=False)
    assert torch.allclose(one, expect[20], rtol=0, atol=1e-4 * expect.abs().max())
    assert torch.allclose(chunk[0, :5], expect[21:26], rtol=0, atol=1e-4 * expect.abs().max())
    # roll back 3 rejected positions: rewrite them with other tokens, logits follow the new ones
    alt = ids[:23] + [7, 8, 9]
    with torch.no_grad():
        expect_alt = ref(torch.tensor([alt])).logits[0]
    got = runner.forward([2], [23], [alt[23:]], last_only=False)[0]
    assert torch.allclose(got, expect_alt[23:], rtol=0, atol=1e-4 * expect_alt.abs().max())


def test_unsupported_model_type_is_refused(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "gpt2", "vocab_size": 10}')
    with pytest.raises(ValueError, match="not supported"):
        load_model(tmp_path, torch.float32, "cpu")
