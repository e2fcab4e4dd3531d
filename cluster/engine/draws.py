"""Every random number a request's tokens depend on, as a hash of (its key, a token position,
what the number is for) rather than a draw from a stream.

A request's key is its seed (or, unseeded, a random one). A draft, the accept test of the
draft at position p and the token drawn at p (a resample or a plain step) each take the
uniform of their own (key, p, use). So a seeded request's output does not depend on how many
numbers anything else drew: a look-ahead whose drafts were dropped, another drafter replica,
a launch thrown away, its batch. And a row's numbers are made for the whole batch by a few
vector operations instead of a generator call a row.

Still exact: each (use, position) number decides at most one thing that reaches the output.
A position is drafted, tested and drawn at most once before it is final (accepted or
replaced), and numbers are reused only by drafts that were never tested, which shape nothing.
"""

from __future__ import annotations

import random

import torch

DRAFT, ACCEPT, TOKEN = 0, 1, 2  # what a number is for

_GOLDEN, _M1, _M2 = (c - 2**64 for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def key_of(seed: int | None) -> int:
    """A request's key: its seed, or a random one (its numbers need only be independent)."""
    return seed % 2**63 if seed is not None else random.getrandbits(63)


def _lsr(x: torch.Tensor, s: int) -> torch.Tensor:
    return (x >> s) & ((1 << (64 - s)) - 1)  # a logical shift: torch's >> keeps int64's sign


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 (multiplication wraps as uint64's does)."""
    x = x + _GOLDEN
    x = (x ^ _lsr(x, 30)) * _M1
    x = (x ^ _lsr(x, 27)) * _M2
    return x ^ _lsr(x, 31)


def uniforms(keys: torch.Tensor, positions: torch.Tensor, use: int) -> torch.Tensor:
    """U[0, 1) float32 of the shape of positions (int64 absolute token positions); keys
    broadcast against them (int64)."""
    return _lsr(_mix(_mix(_mix(keys) + use) + positions), 40).float() / 2**24


def inverse_cdf(probs: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Each row's draw from probs [N, V] (rows need not sum to 1) by the uniform u [N]: the
    first index whose cumulative mass passes u of the row's total, never one of mass 0
    (float64 sums: a 128k vocabulary's float32 sums lose the tail's resolution)."""
    cdf = probs.double().cumsum(-1)
    x = (u.double() * cdf[:, -1])[:, None]
    return torch.searchsorted(cdf, x, right=True)[:, 0].clamp_(max=probs.shape[-1] - 1)
