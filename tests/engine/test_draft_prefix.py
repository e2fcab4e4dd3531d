"""Where a draft model resumes a row: cluster.engine.drafters.model._common_prefix."""

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
