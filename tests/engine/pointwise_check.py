"""The rotary and SiLU kernels (cluster/engine/worker/pointwise.py) against the eager reference in
model.py, on CPU through Triton's interpreter: q and k head counts that fill their power-of-two
tiles and that do not, token rows as [B, T] and as a flat segment list; SiLU rows of one
partial column block and of several. Run by tests/engine/test_pointwise.py in a process of its
own (Triton reads TRITON_INTERPRET once, when it is first imported):

    TRITON_INTERPRET=1 python tests/engine/pointwise_check.py

float32 (the interpreter keeps bf16 as raw uint16, gemv_check.py says why): only the order of
fp32 operations may differ from the eager path, and a wrong head, half or column is far off.
Exit 0: all cases match; 77: the interpreter cannot run here.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from tests.engine.gemv_check import interpreter_works, numpy24_index  # noqa: E402


def main() -> int:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    numpy24_index()
    if not interpreter_works():
        return 77
    from cluster.engine.worker import model, pointwise

    cases = 0
    g = torch.Generator().manual_seed(0)
    for lead, heads, kv_heads, d in (((2, 3), 4, 2, 16), ((2, 3), 6, 2, 16), ((5,), 3, 1, 8)):
        qkv = torch.randn(*lead, heads + 2 * kv_heads, d, generator=g)
        angle = torch.randn(*lead, 1, d // 2, generator=g)
        q, k = pointwise.rope_qk(qkv, angle.cos(), angle.sin(), heads, kv_heads)
        q_ref, k_ref = model.rope_qk(qkv, angle.cos(), angle.sin(), heads, kv_heads)
        assert q.is_contiguous() and q.shape == q_ref.shape and k.shape == k_ref.shape
        torch.testing.assert_close(q, q_ref, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(k, k_ref, atol=1e-6, rtol=1e-6)
        cases += 1
    for shape in ((3, 80), (2, 3, 3000)):
        x = torch.randn(*shape, generator=g) * 4
        torch.testing.assert_close(pointwise.silu_mul(x), model.silu_mul(x), atol=1e-6, rtol=1e-6)
        cases += 1
    print(f"{cases} cases ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
