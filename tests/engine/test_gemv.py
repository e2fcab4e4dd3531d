"""fused_linear (cluster/engine/gemv.py, the batch-1 decode projection) against the eager
composition in model.py, on CPU through Triton's interpreter: every prologue, with and
without bias and residual.

float32, not bfloat16: the interpreter keeps bf16 as raw uint16 and its tl.dot multiplies
those bits as integers, so a bf16 run would test the interpreter. In fp32 only summation
order differs from the eager path, and a wrong row or column mapping is far off 1e-4.

TRITON_INTERPRET=1 is set before triton is imported: Triton reads it when triton.language and
each kernel are defined, so it holds for the whole pytest process (run Triton GPU tests in a
separate process). GEMV_CONFIGS=one gives each kernel one config: the interpreter would
otherwise run and time every autotune config.
Triton 3.6's interpreter turns a scalar into an int by int(1-element array), which numpy >=
2.4 refuses (`range(K // BLOCK_K)` fails); `_numpy24_index` applies the upstream fix
(triton-lang/triton#9171, #9172).
"""

from __future__ import annotations

import os
import sys

import pytest

if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("triton was imported before TRITON_INTERPRET=1 could be set", allow_module_level=True)
os.environ["TRITON_INTERPRET"] = "1"
os.environ["GEMV_CONFIGS"] = "one"
pytest.importorskip("triton")

import torch  # noqa: E402

from cluster.engine import model  # noqa: E402

K, N, EPS = 256, 40, 1e-5  # N = 40: the last BLOCK_N = 16 tile is part masked


def _numpy24_index():
    from triton.runtime import interpreter

    patch = interpreter._patch_lang_tensor
    if getattr(patch, "numpy24", False):
        return

    def patched(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patched.numpy24 = True
    interpreter._patch_lang_tensor = patched


@pytest.fixture(scope="module")
def gemv():
    import triton
    import triton.language as tl

    @triton.jit
    def _double(src, dst, n, BLOCK: tl.constexpr):
        for i in range(0, n // BLOCK):  # a runtime loop bound, as the kernels have
            r = i * BLOCK + tl.arange(0, BLOCK)
            tl.store(dst + r, tl.load(src + r) * 2)

    try:
        _numpy24_index()
        src, dst = torch.arange(32, dtype=torch.float32), torch.zeros(32)
        _double[(1,)](src, dst, 32, BLOCK=16)
        assert torch.equal(dst, src * 2)
    except Exception as e:  # noqa: BLE001
        pytest.skip(f"triton cannot run in interpreter mode here: {e!r}")
    from cluster.engine import gemv as g

    assert len(g._gemv.configs) == 1  # imported here first, with GEMV_CONFIGS set
    return g


def eager(x, w, bias, norm, silu, residual):
    if norm is not None:
        x = model.rms_norm(x, norm, EPS)
    if silu:
        x = model.silu_mul(x)
    y = torch.nn.functional.linear(x, w, bias)
    return y if residual is None else residual + y


@pytest.mark.parametrize("m", (1,))
@pytest.mark.parametrize("pro", ("none", "rmsnorm", "silu"))
@pytest.mark.parametrize("bias", (False, True))
@pytest.mark.parametrize("res", (False, True))
def test_fused_linear_matches_eager(gemv, m, pro, bias, res):
    g = torch.Generator().manual_seed(m * 100 + len(pro) * 10 + bias * 2 + res)
    x = torch.randn(1, m, 2 * K if pro == "silu" else K, generator=g)
    w = torch.randn(N, K, generator=g) / K ** 0.5
    b = torch.randn(N, generator=g) if bias else None
    nw = 1 + 0.1 * torch.randn(K, generator=g) if pro == "rmsnorm" else None
    r = torch.randn(1, m, N, generator=g) if res else None
    y = gemv.fused_linear(x, w, b, nw, EPS, pro == "silu", r)
    assert y.shape == (1, m, N)
    torch.testing.assert_close(y, eager(x, w, b, nw, pro == "silu", r), atol=1e-4, rtol=1e-4)


def test_more_rows_than_the_kernel_takes(gemv):
    with pytest.raises(AssertionError):
        gemv.fused_linear(torch.randn(gemv.MAX_ROWS + 1, K), torch.randn(N, K))
