"""The paged-attention kernel (cluster/engine/worker/paged_attention.py) against a float64
reference, on CPU through Triton's interpreter (tests/engine/paged_attention_check.py): decode,
verify and prefill widths, grouped-query heads, key splits, an fp8 cache, rows out of order;
and its fused key/value write against writes through slots computed in PyTorch."""

import pytest

from tests.engine.interpreter import run_check

pytest.importorskip("triton")


def test_paged_attention_matches_the_reference_in_the_interpreter():
    run_check("paged_attention_check.py", "write cases ok")


def test_engine_on_the_paged_kernel_matches_sdpa_in_the_interpreter():
    """The whole engine with the Triton kernel as its attention (greedy plain, speculation,
    a pool that preempts) emits what the SDPA engine emits (tests/engine/engine_triton_check.py)."""
    run_check("engine_triton_check.py", "8 runs identical")
