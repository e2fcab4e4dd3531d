"""FP8 (e4m3) KV cache on the demo pair: close to the full-precision target, lossless
speculation relative to the quantized target, saturation instead of NaN, bad configs refused.
On CPU, and (marked gpu) on a CUDA GPU in fp32, where attention is SDPA over a dequantized
cache: the path a non-Hopper GPU takes (FA3 runs bf16 only, which is not bit-exact between
verify and decode shapes, so losslessness is asserted in fp32)."""

import pytest
import torch

from cluster.bench.workloads import code_prompts
from cluster.config import parse_config
from cluster.engine.config import EngineConfig
from cluster.engine.sampling import SamplingParams
from cluster.engine.scheduling.sequence import SpecParams
from cluster.engine.worker import fp8
from cluster.serve.build import build_engine

ENGINE = {"max_num_seqs": 8, "max_model_len": 512}


@pytest.fixture(scope="module", params=["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def engines(demo_pair, request):
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    models = {"device": request.param}
    full = build_engine(parse_config({"models": models, "engine": ENGINE}))
    quant = build_engine(parse_config({"models": models, "engine": {**ENGINE, "kv_cache_dtype": "fp8"}}))
    return full, quant


@pytest.fixture(scope="module")
def prompts():
    return code_prompts(4, chars=300, seed=5)


def _logits(engine, ids):
    h = engine.kv.open()
    try:
        engine.kv.grow(h, len(ids))
        return engine.runner.forward([h.row], [0], [ids], last_only=False)[0]
    finally:
        engine.kv.close(h)


def test_cache_is_e4m3_with_calibrated_scales(engines):
    full, quant = engines
    assert quant.kv.k.dtype == torch.float8_e4m3fn and quant.kv.k.element_size() == 1
    assert full.kv.scales is None and full.kv.k.dtype == torch.float32
    s = quant.kv.scales
    assert s.shape == (quant.model.shape.layers, 3) and s.device.type == "cpu"  # numbers for the kernels
    assert torch.isfinite(s).all() and (s > 0).all()


def test_logits_close_to_full_precision(engines, prompts):
    full, quant = engines
    for p in prompts:
        ids = full.tokenizer(p)["input_ids"]
        a, b = _logits(full, ids), _logits(quant, ids)
        kl = torch.nn.functional.kl_div(b.log_softmax(-1), a.log_softmax(-1), log_target=True, reduction="none").sum(-1)
        assert (a.argmax(-1) == b.argmax(-1)).float().mean() >= 0.95
        assert kl.mean() < 0.02, kl.mean()
        assert not torch.equal(a, b)  # the cache really is quantized


@pytest.mark.parametrize("drafter", ["model", "ngram"])
def test_speculation_lossless_against_fp8_target(engines, prompts, drafter):
    _, quant = engines
    plain = quant.generate(prompts, SamplingParams(max_tokens=48), SpecParams("off"))
    spec = quant.generate(prompts, SamplingParams(max_tokens=48), SpecParams("fixed", 4), drafter)
    assert [r["token_ids"] for r in spec] == [r["token_ids"] for r in plain]
    assert quant.kv.held() == (0, 0)


def test_prefix_cache_hit_serves_same_tokens(engines, prompts):
    _, quant = engines
    hits = quant.kv.pool.stats.hits
    first = quant.generate(prompts[:1], SamplingParams(max_tokens=24), SpecParams("off"))
    again = quant.generate(prompts[:1], SamplingParams(max_tokens=24), SpecParams("off"))
    assert quant.kv.pool.stats.hits > hits
    assert again[0]["token_ids"] == first[0]["token_ids"]


def test_quantize_saturates_instead_of_nan():
    x = torch.tensor([1e6, -1e6, 3.0, 0.0])
    y = fp8.quantize(x, torch.tensor(2.0)).float()
    assert torch.equal(y, torch.tensor([448.0, -448.0, 1.5, 0.0]))


def test_bad_kv_cache_dtype_refused():
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="int4")
    with pytest.raises(Exception, match="kv_cache_dtype"):
        parse_config({"engine": {"kv_cache_dtype": "fp4"}})
