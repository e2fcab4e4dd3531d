"""fused_linear (cluster/engine/worker/gemv.py: the one-row GEMV and the 2..16-row tensor-core kernel)
against the eager composition in model.py, on CPU through Triton's interpreter: 1 and 5 rows,
every prologue, with and without bias and residual; 2 and 16 rows of different scales; 5 and
16 rows with K split in two (GEMV_SPLIT_K). Run by tests/engine/test_gemv.py in a process of its own, since
Triton reads TRITON_INTERPRET once, when it is first imported:

    TRITON_INTERPRET=1 GEMV_CONFIGS=one python tests/engine/gemv_check.py

float32, not bfloat16: the interpreter keeps bf16 as raw uint16 and its tl.dot multiplies
those bits as integers, so a bf16 run would test the interpreter. In fp32 only summation
order differs from the eager path, and a wrong row or column mapping is far off 1e-4.
GEMV_CONFIGS=one gives the kernel one config: the interpreter would otherwise run and time
every autotune config. Exit 0: all cases match; 77: the interpreter cannot run here.
"""

from __future__ import annotations

import itertools
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from cluster.bench.harness import triton_interpreter_numpy24  # noqa: E402

K, N, EPS = 256, 40, 1e-5  # N = 40: the last BLOCK_N = 16 tile is part masked


numpy24_index = triton_interpreter_numpy24  # the interpreter's numpy >= 2.4 fix, shared with scripts


def interpreter_works() -> bool:
    import triton
    import triton.language as tl

    @triton.jit
    def _double(src, dst, n, BLOCK: tl.constexpr):
        for i in range(0, n // BLOCK):  # a runtime loop bound, as the kernels have
            r = i * BLOCK + tl.arange(0, BLOCK)
            tl.store(dst + r, tl.load(src + r) * 2)

    try:
        src, dst = torch.arange(32, dtype=torch.float32), torch.zeros(32)
        _double[(1,)](src, dst, 32, BLOCK=16)
        return torch.equal(dst, src * 2)
    except Exception as e:  # noqa: BLE001
        print(f"triton cannot run in interpreter mode here: {e!r}")
        return False


def eager(model, x, w, bias, norm, silu, residual):
    if norm is not None:
        x = model.rms_norm(x, norm, EPS)
    if silu:
        x = model.silu_mul(x)
    y = torch.nn.functional.linear(x, w, bias)
    return y if residual is None else residual + y


def main() -> int:
    assert os.environ.get("TRITON_INTERPRET") == "1" and os.environ.get("GEMV_CONFIGS") == "one"
    numpy24_index()
    if not interpreter_works():
        return 77
    from cluster.engine.worker import gemv, model

    assert len(gemv._gemv.configs) == 1
    cases = 0
    assert len(gemv._gemm_rows.configs) == 1
    gemv.SPLIT_K = 0  # the unsplit kernel first (the default splits K > 2N, as here)
    for rows, pro, bias, res in itertools.product((1, 5), ("none", "rmsnorm", "silu"), (False, True), (False, True)):
        g = torch.Generator().manual_seed(rows * 100 + len(pro) * 10 + bias * 2 + res)
        x = torch.randn(1, rows, 2 * K if pro == "silu" else K, generator=g)
        w = torch.randn(N, K, generator=g) / K ** 0.5
        b = torch.randn(N, generator=g) if bias else None
        nw = 1 + 0.1 * torch.randn(K, generator=g) if pro == "rmsnorm" else None
        r = torch.randn(1, rows, N, generator=g) if res else None
        y = gemv.fused_linear(x, w, b, nw, EPS, pro == "silu", r)
        assert y.shape == (1, rows, N)
        torch.testing.assert_close(y, eager(model, x, w, b, nw, pro == "silu", r), atol=1e-4, rtol=1e-4,
                                   msg=lambda m: f"{rows=} {pro=} {bias=} {res=}: {m}")
        cases += 1
    for rows in (2, 16):  # the fewest and the most rows _gemm_rows takes; rows of different scale
        g = torch.Generator().manual_seed(rows)
        x = torch.randn(rows, K, generator=g) * torch.arange(1, rows + 1)[:, None]
        w, nw = torch.randn(N, K, generator=g) / K ** 0.5, 1 + 0.1 * torch.randn(K, generator=g)
        r = torch.randn(rows, N, generator=g)
        torch.testing.assert_close(gemv.fused_linear(x, w, None, nw, EPS, False, r),
                                   eager(model, x, w, None, nw, False, r), atol=1e-4, rtol=1e-4)
        cases += 1
    gemv.SPLIT_K = 2  # K (256) > 2N (80): 5 and 16 rows through the split-K path
    assert gemv._splits(N, K) == 2 and gemv.supported(5, N, K) and gemv._splits(K, K) == 1
    for rows, pro, res in itertools.product((5, 16), ("none", "rmsnorm", "silu"), (False, True)):
        g = torch.Generator().manual_seed(1000 + rows * 10 + len(pro) + res)
        x = torch.randn(rows, 2 * K if pro == "silu" else K, generator=g) * torch.arange(1, rows + 1)[:, None]
        w, b = torch.randn(N, K, generator=g) / K ** 0.5, torch.randn(N, generator=g)
        nw = 1 + 0.1 * torch.randn(K, generator=g) if pro == "rmsnorm" else None
        r = torch.randn(rows, N, generator=g) if res else None
        torch.testing.assert_close(gemv.fused_linear(x, w, b, nw, EPS, pro == "silu", r),
                                   eager(model, x, w, b, nw, pro == "silu", r), atol=1e-4, rtol=1e-4,
                                   msg=lambda m: f"split {rows=} {pro=} {res=}: {m}")
        cases += 1
    gemv.SPLIT_K = 0
    try:
        gemv.fused_linear(torch.randn(gemv.MAX_ROWS + 1, K), torch.randn(N, K))
        raise SystemExit("more rows than the kernel takes were accepted")
    except AssertionError:
        pass
    print(f"{cases} cases ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
