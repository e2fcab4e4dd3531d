"""Keyed draws (cluster.engine.draws): the hash itself, the inverse CDF, and what keying by
position buys a seeded request: the same tokens resumed mid-way as in one piece."""

import torch

from cluster.engine import draws


def test_uniforms_are_splitmix64_of_key_use_and_position():
    """int64 products must wrap as uint64's: checked against Python's big integers."""
    m = 2**64 - 1

    def mix(x):
        x = (x + 0x9E3779B97F4A7C15) & m
        x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & m
        x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & m
        return x ^ (x >> 31)

    keys = [0, 1, 7, 2**62 + 12345, 2**63 - 1]
    for use in (draws.DRAFT, draws.ACCEPT, draws.TOKEN):
        for pos in (0, 1, 640, 2**20):
            got = draws.uniforms(torch.tensor(keys), torch.tensor(pos), use).tolist()
            want = [(mix((mix((mix(k) + use) & m) + pos) & m) >> 40) / 2**24 for k in keys]
            assert got == want


def test_uniforms_are_uniform_and_uses_independent():
    n = 200_000
    keys, pos = torch.arange(n), torch.full((n,), 5)
    a, b = draws.uniforms(keys, pos, draws.ACCEPT), draws.uniforms(keys, pos, draws.TOKEN)
    counts = torch.histc(a, bins=20, min=0, max=1)
    assert (counts - n / 20).abs().max() < 5 * (n / 20) ** 0.5
    assert abs(torch.corrcoef(torch.stack([a, b]))[0, 1]) < 0.01
    assert 0 <= a.min() and a.max() < 1


def test_inverse_cdf_never_draws_zero_mass_and_follows_the_distribution():
    probs = torch.tensor([[0.0, 0.25, 0.0, 0.75, 0.0]]).expand(40_000, 5)
    u = draws.uniforms(torch.arange(40_000), torch.zeros(40_000, dtype=torch.int64), draws.TOKEN)
    got = draws.inverse_cdf(probs, u)
    counts = torch.bincount(got, minlength=5)
    assert counts[[0, 2, 4]].sum() == 0
    assert abs(counts[1].item() / 40_000 - 0.25) < 0.01
    edge = draws.inverse_cdf(torch.tensor([[0.5, 0.5, 0.0]]), torch.tensor([1 - 2**-24]))
    assert edge.item() == 1  # the top of [0, 1) stays inside the support


def test_a_seeded_request_resumed_midway_gives_the_tokens_of_one_piece(random_models, tokenizer):
    """What a verifier failover does (cluster.serve.calls.continuation): the first 10 tokens,
    then a new request of prompt + those tokens with the same seed, plain decoding. (With
    speculation a token's draws depend on whether a draft stood at its position, so a resumed
    speculative request is another draw from the same distribution, not the same tokens.)"""
    from cluster.engine.config import EngineConfig
    from cluster.engine.engine import Engine
    from cluster.engine.sampling import SamplingParams
    from cluster.engine.scheduling.sequence import SpecParams
    from cluster.engine.worker.loader import load_model

    target = load_model(random_models["llama"], torch.float32, "cpu")
    cfg = EngineConfig(max_num_seqs=8, max_model_len=256, block_size=4, max_batch_tokens=64)
    e = Engine(target, tokenizer, cfg, {}, None)
    prompts = [tokenizer.encode(t) for t in ("def f(x):\n    return", "the quick brown fox", "abcabcabc")]
    sampled = lambda n: [SamplingParams(max_tokens=n, temperature=1.0, seed=s, ignore_eos=True)  # noqa: E731
                         for s in range(len(prompts))]
    off = SpecParams("off")
    whole = [r["token_ids"] for r in e.generate(prompts, sampled(30), off)]
    head = [w[:10] for w in whole]
    tail = [r["token_ids"] for r in e.generate([p + h for p, h in zip(prompts, head)], sampled(20), off)]
    assert [h + t for h, t in zip(head, tail)] == whole
    assert len({tuple(w) for w in whole}) == len(prompts)
    other = [r["token_ids"] for r in e.generate([p + h for p, h in zip(prompts, head)],
                                                [SamplingParams(max_tokens=20, temperature=1.0, seed=s + 100,
                                                                ignore_eos=True) for s in range(3)], off)]
    assert other != tail  # the seed, not the prompt alone, decides the draws
