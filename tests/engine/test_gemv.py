"""The GEMV kernels (cluster/engine/worker/gemv.py) match the eager composition, on CPU through
Triton's interpreter (tests/engine/gemv_check.py)."""

import pytest

from tests.engine.interpreter import run_check

pytest.importorskip("triton")


def test_fused_linear_matches_eager_in_the_interpreter():
    run_check("gemv_check.py", "38 cases ok", GEMV_CONFIGS="one")
