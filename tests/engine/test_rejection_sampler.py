"""The rejection sampler's output has exactly the target's distribution."""

import zlib

import pytest
import torch
from scipy.stats import chisquare

from cluster.engine.sampling import SamplingParams, rejection_sample, target_probs

V = 6
PAIRS = {
    "close": ([0.3, 0.2, 0.2, 0.1, 0.1, 0.1], [0.25, 0.25, 0.2, 0.1, 0.1, 0.1]),
    "far": ([0.7, 0.1, 0.1, 0.05, 0.05, 0.0], [0.05, 0.05, 0.1, 0.1, 0.2, 0.5]),
    "disjoint": ([0.5, 0.5, 0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.3, 0.3, 0.4]),
    "one_hot_q": ([0.2, 0.3, 0.1, 0.1, 0.1, 0.2], [0.0, 0.0, 1.0, 0.0, 0.0, 0.0]),
}


def _draw(p, q, n, g, seed):
    """n independent rows: drafts sampled from q (G=g), target p at every position."""
    gen = torch.Generator().manual_seed(seed)
    p, q = torch.tensor(p), torch.tensor(q)
    drafts = torch.multinomial(q.expand(n, V), g, replacement=True, generator=gen)
    out, num_acc = rejection_sample(
        drafts, torch.full((n,), g), q.expand(n, g, V), p.expand(n, g + 1, V),
        torch.rand(n, g, generator=gen), torch.empty(n, V).exponential_(generator=gen))
    return out, num_acc


@pytest.mark.parametrize("name", list(PAIRS))
@pytest.mark.parametrize("g", [1, 3])
def test_first_and_second_token_follow_target(name, g):
    p, q = PAIRS[name]
    n = 60_000
    out, num_acc = _draw(p, q, n, g, seed=zlib.crc32(name.encode()))  # hash() of a str changes per process
    expected = torch.tensor(p) * n
    support = expected > 0
    for pos in range(2):  # every emitted position is a draw from p (positions are iid here)
        col = out[:, pos]
        have = col >= 0
        if have.sum() < 1000:  # disjoint supports: nothing is ever accepted, no second token
            assert name == "disjoint" and pos == 1
            continue
        counts = torch.bincount(col[have], minlength=V).double()
        assert counts[~support].sum() == 0, "a token outside the target's support was emitted"
        exp = torch.tensor(p, dtype=torch.float64)[support] * have.sum()
        stat = chisquare(counts[support], exp)
        assert stat.pvalue > 1e-4, f"{name} g={g} pos={pos}: chi-square p={stat.pvalue:.2e}"
    assert (num_acc <= g).all()


def test_acceptance_rate_matches_theory():
    """E[accept] = sum_x min(p, q) for a single draft."""
    p, q = PAIRS["far"]
    _, num_acc = _draw(p, q, 100_000, 1, seed=3)
    theory = sum(min(a, b) for a, b in zip(p, q))
    assert abs(num_acc.float().mean().item() - theory) < 0.01


def test_greedy_rows_accept_exactly_the_argmax_prefix():
    logits = torch.tensor([[0.0, 5, 1, 0], [3, 0, 0, 1], [0, 0, 0, 9]])
    p = target_probs(logits, [SamplingParams(temperature=0)], rows_per_param=3).view(1, 3, 4)
    q = torch.nn.functional.one_hot(torch.tensor([[1, 2]]), 4).float()
    out, n = rejection_sample(torch.tensor([[1, 2]]), torch.tensor([2]), q, p, torch.rand(1, 2), torch.ones(1, 4))
    assert n.tolist() == [1] and out.tolist() == [[1, 0, -1]]  # draft 1 matches argmax, then argmax 0


def test_zero_drafts_is_plain_sampling():
    p = torch.tensor([[[0.1, 0.2, 0.7]]])
    gen = torch.Generator().manual_seed(0)
    n = 30_000
    out, _ = rejection_sample(torch.empty(n, 0, dtype=torch.long), torch.zeros(n, dtype=torch.long),
                              torch.empty(n, 0, 3), p.expand(n, 1, 3), torch.empty(n, 0),
                              torch.empty(n, 3).exponential_(generator=gen))
    counts = torch.bincount(out[:, 0], minlength=3).double()
    assert chisquare(counts, torch.tensor([0.1, 0.2, 0.7], dtype=torch.float64) * n).pvalue > 1e-4


def test_top_k_and_top_p_processing():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    pk = target_probs(logits, [SamplingParams(temperature=1.0, top_k=2)])
    assert torch.allclose(pk, torch.tensor([[0.625, 0.375, 0, 0]]))
    pp = target_probs(logits, [SamplingParams(temperature=1.0, top_p=0.8)])
    assert torch.allclose(pp, torch.tensor([[0.625, 0.375, 0, 0]]))
    pt = target_probs(logits, [SamplingParams(temperature=2.0)])
    assert torch.allclose(pt, torch.softmax(logits / 2, -1))


def test_fill_draws_seeded_rows_from_their_generators_the_rest_at_once():
    """fill_draws: a seeded row's draws are its generator's stream (its first `widths[b]`), so its
    seed reproduces them; greedy rows keep their fill; unseeded rows get independent draws from
    the default generator, all in one call, Exp(1) distributed."""
    from scipy.stats import kstest

    from cluster.engine.sampling import SamplingParams, fill_draws

    sampled, greedy = SamplingParams(temperature=1.0), SamplingParams(temperature=0.0)
    params = [sampled, greedy, sampled] + [sampled] * 200
    gens = [torch.Generator().manual_seed(7), None, torch.Generator().manual_seed(8)] + [None] * 200
    torch.manual_seed(0)  # the unseeded rows' draws: the same every run, whatever ran before
    out = fill_draws(torch.ones(203, 64), params, gens, "exponential")
    assert torch.equal(out[0], torch.empty(64).exponential_(generator=torch.Generator().manual_seed(7)))
    assert torch.equal(out[1], torch.ones(64))
    assert kstest(out[3:].flatten().numpy(), "expon").pvalue > 1e-4
    assert len({tuple(r.tolist()) for r in out[3:]}) == 200  # independent rows, not one row's draws copied
    u = fill_draws(torch.zeros(3, 5), params[:3], [torch.Generator().manual_seed(9), None, None], "uniform", [2, 5, 5])
    assert torch.equal(u[0, :2], torch.rand(2, generator=torch.Generator().manual_seed(9))) and not u[0, 2:].any()
    assert not u[1].any() and bool((u[2] > 0).all())
