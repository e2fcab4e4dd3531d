"""The rotary and SiLU kernels (cluster/engine/worker/pointwise.py) match the eager reference, on
CPU through Triton's interpreter (tests/engine/pointwise_check.py)."""

import pytest

from tests.engine.interpreter import run_check

pytest.importorskip("triton")


def test_rotary_and_silu_kernels_match_eager_in_the_interpreter():
    run_check("pointwise_check.py", "5 cases ok")
