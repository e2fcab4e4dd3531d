"""Run by test_paged_attention.py in a process of its own, with TRITON_INTERPRET=1: the
paged-attention kernel against a float64 reference over keys gathered through block tables,
and the fused key/value write against writes through slots computed in PyTorch."""

import random
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from gemv_check import interpreter_works, numpy24_index  # noqa: E402

numpy24_index()
from cluster.engine.scheduling.kv_cache import slot_index  # noqa: E402
from cluster.engine.worker import fp8 as fp8_kv  # noqa: E402
from cluster.engine.worker.paged_attention import paged_attention, write_kv  # noqa: E402


def reference(q, kc, vc, tables, rows, cache_lens, q_lens, kv_scales):
    B, T, H, D = q.shape
    BS, HKV = kc.shape[1], kc.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float64)
    for b in range(B):
        pos = torch.arange(cache_lens[b] + q_lens[b])
        idx = tables[rows[b], pos // BS].long() * BS + pos % BS
        k, v = kc.reshape(-1, HKV, D)[idx].double(), vc.reshape(-1, HKV, D)[idx].double()
        if kv_scales:
            k, v = k * kv_scales[0], v * kv_scales[1]
        mask = pos[None, :] <= (cache_lens[b] + torch.arange(q_lens[b]))[:, None]
        o = F.scaled_dot_product_attention(q[b, :q_lens[b]].double().transpose(0, 1), k.transpose(0, 1),
                                           v.transpose(0, 1), attn_mask=mask, enable_gqa=True)
        out[b, :q_lens[b]] = o.transpose(0, 1)
    return out


def main() -> int:
    if not interpreter_works():
        print("the Triton interpreter cannot run here")
        return 77
    rng = random.Random(0)
    torch.manual_seed(0)
    cases = [  # B, T, H, HKV, D, block size, splits, fp8
        (2, 1, 4, 2, 16, 4, 1, False), (3, 5, 8, 2, 32, 8, 3, False), (2, 37, 4, 4, 16, 4, 1, False),
        (2, 3, 4, 1, 16, 16, 2, False), (4, 2, 8, 2, 16, 4, 4, True)]
    for B, T, H, HKV, D, BS, splits, fp8 in cases:
        blocks, max_blocks = 64, 40
        kc, vc = torch.randn(blocks + 1, BS, HKV, D), torch.randn(blocks + 1, BS, HKV, D)
        kv_scales = None
        if fp8:
            kv_scales = (0.02, 0.03)
            kc, vc = (kc / 0.02).to(torch.float8_e4m3fn), (vc / 0.03).to(torch.float8_e4m3fn)
        rows = torch.randperm(B + 2)[:B]  # rows need not be in order or dense
        cache_lens = torch.tensor([rng.randint(0, 60) for _ in range(B)])
        q_lens = torch.tensor([rng.randint(1, T) for _ in range(B)])
        tables = torch.full((B + 3, max_blocks), blocks, dtype=torch.int32)  # unused entries: scratch
        free = torch.randperm(blocks).tolist()
        for b in range(B):
            n = -(-int(cache_lens[b] + q_lens[b]) // BS)
            tables[rows[b], :n] = torch.tensor([free.pop() for _ in range(n)], dtype=torch.int32)
        q = torch.randn(B, T, H, D)
        out = torch.full_like(q, float("nan"))  # every real row must be written
        paged_attention(q, kc, vc, tables, rows, cache_lens, q_lens, splits, kv_scales, out=out)
        ref = reference(q, kc, vc, tables, rows.tolist(), cache_lens.tolist(), q_lens.tolist(), kv_scales)
        for b in range(B):
            got, want = out[b, :q_lens[b]].double(), ref[b, :q_lens[b]]
            err = ((got - want).norm() / want.norm()).item()
            if not err < 1e-5:
                print(f"case {(B, T, H, HKV, D, BS, splits, fp8)} row {b}: relative error {err}")
                return 1
    print(f"{len(cases)} attention cases ok")
    return check_writes()


def check_writes() -> int:
    """Each real new token lands in its slot (e4m3-quantized where the cache is fp8); padded
    tokens (t >= q_len) and every other slot stay untouched; k and v may be views of one
    projection with strides of their own."""
    torch.manual_seed(1)
    for B, T, HKV, D, BS, fp8 in ((3, 4, 2, 16, 4, False), (2, 1, 1, 32, 8, False), (4, 3, 2, 16, 4, True)):
        blocks, max_blocks = 32, 10
        dtype = torch.float8_e4m3fn if fp8 else torch.float32
        kc, vc = torch.zeros(blocks + 1, BS, HKV, D, dtype=dtype), torch.zeros(blocks + 1, BS, HKV, D, dtype=dtype)
        tables = torch.full((B + 1, max_blocks), blocks, dtype=torch.int32)
        tables[:B] = torch.randperm(blocks)[:B * max_blocks // 2].view(B, -1).repeat(1, 2)[:, :max_blocks].int()
        rows = torch.randperm(B)
        cache_lens = torch.randint(0, 4 * BS, (B,))
        q_lens = torch.randint(1, T + 1, (B,))
        qkv = torch.randn(B, T, 3 * HKV, D)  # k and v as views of one projection, as the model has them
        k, v = qkv[:, :, HKV:2 * HKV], qkv[:, :, 2 * HKV:]
        # fp8: scales of powers of two and values e4m3 holds exactly, so no rounding is asked
        # of the interpreter's e4m3 cast (it rounds some values near a binade's top one down
        # a whole binade: 7.9 -> 4; the GPU's cast does not)
        scales = (0.03125, 0.0625) if fp8 else None
        if fp8:
            qkv = qkv.clamp(-8, 8).to(torch.float8_e4m3fn).float() / 16
            k, v = qkv[:, :, HKV:2 * HKV], qkv[:, :, 2 * HKV:]
        write_kv(k, v, kc, vc, tables, rows, cache_lens, q_lens, scales)
        pos = cache_lens[:, None] + torch.arange(T)
        slots = slot_index(tables, rows, pos, BS)
        want_k, want_v = torch.zeros_like(kc).view(-1, HKV, D), torch.zeros_like(vc).view(-1, HKV, D)
        for b in range(B):
            n = int(q_lens[b])
            for new, want, s in ((k, want_k, 0.03125), (v, want_v, 0.0625)):
                want[slots[b, :n]] = fp8_kv.quantize(new[b, :n], torch.tensor(s)) if fp8 else new[b, :n]
        for got, want in ((kc, want_k), (vc, want_v)):
            if not torch.equal(got.view(-1, HKV, D).float(), want.float()):
                print(f"write case {(B, T, HKV, D, BS, fp8)}: cache differs from the reference")
                return 1
    print("write cases ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
