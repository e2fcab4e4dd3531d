"""The one block hash shared by verifier, router and KV directory.

A prefix block is named by a chained hash over fixed-size token blocks, seeded by the
model's identity, so equal hashes mean "same model, same tokens from position 0".
Only full blocks are hashed: a partial tail block is never shared.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence


def model_seed(identity: str) -> int:
    """64-bit seed from a model identity string (name plus config fingerprint)."""
    return int.from_bytes(hashlib.blake2b(identity.encode(), digest_size=8).digest(), "little")


def block_hashes(token_ids: Sequence[int], block_size: int, seed: int) -> list[int]:
    """Chained 64-bit hashes of the full blocks of `token_ids`.

    hash[i] = H(hash[i-1], tokens[i*bs:(i+1)*bs]) with hash[-1] = seed.
    """
    out: list[int] = []
    prev = seed
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        block = token_ids[start : start + block_size]
        h = hashlib.blake2b(struct.pack(f"<Q{block_size}I", prev, *block), digest_size=8)
        prev = int.from_bytes(h.digest(), "little")
        out.append(prev)
    return out
