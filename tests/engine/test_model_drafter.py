"""The draft model (cluster.engine.drafters.model): where it resumes a row, and how it samples."""

import random

from cluster.engine.drafters.model import _common_prefix


def test_model_drafter_finds_the_common_prefix_wherever_the_rows_part():
    """The draft model resumes a row after the longest prefix it holds KV for: exact for a
    difference at any position, for equal rows, for one row a prefix of the other and empty."""
    def reference(a, b):
        i = 0
        while i < min(len(a), len(b)) and a[i] == b[i]:
            i += 1
        return i

    rng = random.Random(0)
    base = [rng.randrange(4096) for _ in range(700)]
    cases = [([], []), ([], base), (base, base), (base[:10], base), (base, base[:699])]
    for at in [0, 1, 7, 8, 9, 63, 64, 65, 300, 511, 512, 513, 640, 691, 692, 698, 699]:
        for n in (at + 1, 700):
            changed = base[:at] + [base[at] + 1] + base[at + 1:n]
            cases += [(base, changed), (changed, base), (base[:n + 4], changed)]
    for a, b in cases:
        assert _common_prefix(a, b) == reference(a, b), (len(a), len(b), reference(a, b))


def test_held_tokens_resume_where_a_growing_row_parts_from_its_drafts():
    """A row's held tokens keep the engine's own list, not a copy: as it grows (accepted
    drafts, then the verifier's token), the common prefix is the whole-row comparison's; a
    different list (a look-ahead's, a remote call's) is compared whole."""
    from cluster.engine.drafters.model import _Held

    rng = random.Random(1)
    for _ in range(200):
        row = [rng.randrange(50) for _ in range(rng.randrange(1, 30))]
        drafts = [rng.randrange(50) for _ in range(rng.randrange(0, 6))]
        held = _Held(row, len(row), drafts)
        copy = list(row)
        row += drafts[: rng.randrange(len(drafts) + 1)] + [rng.randrange(50) for _ in range(rng.randrange(3))]
        copy += row[len(copy):]
        assert held.common_prefix(row) == _common_prefix(held.tokens(), row)
        assert held.common_prefix(copy) == _common_prefix(held.tokens(), copy)


def test_model_drafter_samples_each_draft_from_the_q_it_reports(random_models):
    """Rejection sampling is exact only if each draft was drawn from the proposal q sent with
    it: 1,000 rows of one context, each with its own seed, draw their first draft; the counts
    follow the reported q (chi-square, 31 degrees of freedom, far below a 1e-4 tail), no draft
    has probability 0, and the same seeds draw the same drafts again."""
    import numpy as np
    import torch

    from cluster.engine.drafters.base import DraftRequest
    from cluster.engine.drafters.model import ModelDrafter
    from cluster.engine.sampling import SamplingParams
    from cluster.engine.worker.loader import load_model

    draft = load_model(random_models["llama_draft"], torch.float32, "cpu")
    n, prompt = 1000, list(range(5, 17))

    def drafts():
        d = ModelDrafter(draft, n, 64)
        out = d.propose([DraftRequest(f"s{i}", prompt, 1, SamplingParams(temperature=0.5, seed=i)) for i in range(n)])
        return out, [t[0] for t in out.tokens]

    out, first = drafts()
    ids, probs = out.q_ids[0][0], out.q_probs[0][0]
    assert all(np.array_equal(i[0], ids) and np.allclose(p[0], probs) for i, p in zip(out.q_ids, out.q_probs))
    q = {int(t): float(p) for t, p in zip(ids, probs)}
    assert all(q.get(t, 0.0) > 0 for t in first)
    counts = {t: first.count(t) for t in q}
    chi2 = sum((counts[t] - n * p) ** 2 / (n * p) for t, p in q.items() if p > 0)
    assert chi2 < 80, chi2
    assert drafts()[1] == first


def test_seeded_sampled_drafts_do_not_depend_on_drafting_ahead(random_models, tokenizer):
    """A seeded sampled request gives the same tokens whether or not its drafter also drafted
    ahead (calls whose drafts were then dropped): a draft's draw is keyed by the seed and the
    draft's position, not taken from a stream that extra calls would move on. Also the same
    tokens with drafts from a drafter that lost its state (a replica restarted) each step."""
    import torch

    from cluster.engine.config import EngineConfig
    from cluster.engine.drafters.model import ModelDrafter
    from cluster.engine.engine import Engine
    from cluster.engine.sampling import SamplingParams
    from cluster.engine.scheduling.sequence import SpecParams
    from cluster.engine.worker.loader import load_model
    from tests.engine.test_engine import PROMPTS

    target = load_model(random_models["llama"], torch.float32, "cpu")
    draft = load_model(random_models["llama_draft"], torch.float32, "cpu")
    cfg = EngineConfig(max_num_seqs=8, max_model_len=256, block_size=4, max_batch_tokens=64)
    spec = SpecParams("fixed", 3)

    def run(drafter, forget=False):
        e = Engine(target, tokenizer, cfg, {"model": drafter}, "model")
        if forget:  # every call finds no state: the drafter re-prefills each row
            launch = drafter.launch  # propose and the engine's drafts on the device both call it
            drafter.launch = lambda reqs: (drafter.release([r.seq_id for r in reqs]), launch(reqs))[1]
        out = [e.generate([p], SamplingParams(max_tokens=32, temperature=0.9, seed=i, ignore_eos=True), spec)[0]
               for i, p in enumerate(PROMPTS)]  # single streams: the "free" drafter looks ahead
        return [r["token_ids"] for r in out], e.planner.counts

    ahead = ModelDrafter(draft, 8, 256, look_ahead="free")
    tokens, counts = run(ahead)
    assert counts["ahead_hits"] + counts["ahead_misses"] > 10, counts
    assert run(ModelDrafter(draft, 8, 256, look_ahead=None))[0] == tokens
    assert run(ModelDrafter(draft, 8, 256, look_ahead=None), forget=True)[0] == tokens
