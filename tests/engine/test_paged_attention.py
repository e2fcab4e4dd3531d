"""The paged-attention kernel (cluster/engine/paged_attention.py) against a float64
reference, on CPU through Triton's interpreter (tests/engine/paged_attention_check.py): decode,
verify and prefill widths, grouped-query heads, key splits, an fp8 cache, rows out of order."""

import pytest

from tests.engine.interpreter import run_check

pytest.importorskip("triton")


def test_paged_attention_matches_the_reference_in_the_interpreter():
    run_check("paged_attention_check.py", "5 cases ok")
