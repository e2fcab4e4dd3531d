"""The GEMV kernels (cluster/engine/gemv.py) matches the eager composition, on CPU
through Triton's interpreter (tests/engine/gemv_check.py). In a process of its own: Triton
reads TRITON_INTERPRET once, when first imported, and other tests import it earlier."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")


def test_fused_linear_matches_eager_in_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1", "GEMV_CONFIGS": "one"}
    r = subprocess.run([sys.executable, str(Path(__file__).with_name("gemv_check.py"))], env=env,
                       capture_output=True, text=True, timeout=600)
    if r.returncode == 77:
        pytest.skip(r.stdout.strip())
    assert r.returncode == 0, r.stdout + r.stderr
    assert "38 cases ok" in r.stdout
