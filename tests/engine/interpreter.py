"""Run a kernel check script in a process of its own under Triton's interpreter (Triton reads
TRITON_INTERPRET once, when first imported, and other tests import it earlier)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest


def run_check(script: str, expect: str, **env: str) -> None:
    """Run tests/engine/<script>; exit 77 skips (no interpreter here); `expect` must be printed."""
    r = subprocess.run([sys.executable, str(Path(__file__).with_name(script))],
                       env={**os.environ, "TRITON_INTERPRET": "1", **env}, capture_output=True, text=True, timeout=600)
    if r.returncode == 77:
        pytest.skip(r.stdout.strip())
    assert r.returncode == 0, r.stdout + r.stderr
    assert expect in r.stdout
