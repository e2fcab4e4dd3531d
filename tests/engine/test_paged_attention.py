"""The paged-attention kernel (cluster/engine/paged_attention.py) against a float64
reference, on CPU through Triton's interpreter (tests/engine/paged_attention_check.py): decode,
verify and prefill widths, grouped-query heads, key splits, an fp8 cache, rows out of order.
In a process of its own: Triton reads TRITON_INTERPRET once, when first imported."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")


def test_paged_attention_matches_the_reference_in_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, str(Path(__file__).with_name("paged_attention_check.py"))], env=env,
                       capture_output=True, text=True, timeout=600)
    if r.returncode == 77:
        pytest.skip(r.stdout.strip())
    assert r.returncode == 0, r.stdout + r.stderr
    assert "5 cases ok" in r.stdout
