"""What crosses the verifier -> drafter boundary, and the Drafter protocol.

A request carries everything a drafter needs, so a drafter holds no engine and any
drafter instance (in this process or a remote replica) can serve any call: the sequence's
full token list (state is keyed by seq_id and resynchronised from the tokens; rejected drafts
roll back by the common prefix), its sampling parameters, and, for drafters that say they
read the target, the target's hidden state or the location of its KV. The drafter is
disposable: losing its state costs a re-prefill, never correctness.

Proposals travel as sparse distributions (top-K ids and probabilities per position): a
drafter that samples from its own top-K-truncated distribution gives exactly the q each
draft came from, which is what rejection sampling needs.
"""

from __future__ import annotations

import abc
import random
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import torch

from cluster.engine.sampling import SamplingParams, device_values

TOPK = 32  # support kept for sampled proposals; greedy proposals are one-hot


@dataclass
class DraftRequest:
    seq_id: str
    token_ids: list[int]             # prompt + accepted output so far
    k: int                           # tokens to propose
    params: SamplingParams = field(default_factory=SamplingParams)
    confirmed: int | None = None     # of token_ids, how many are accepted (None: all); the rest
                                     # are drafts a look-ahead request assumes will be accepted
    # Filled only for drafters that ask (Drafter.reads_hidden): the target's final-normed
    # hidden state [D] at the last token, None when no target pass has produced it yet.
    hidden: torch.Tensor | None = None
    # Filled only for drafters that share the target's KV (Drafter.reads_target_kv): the
    # sequence's block-table row in the target's cache and the tokens cached there.
    target_kv: tuple[int, int] | None = None
    # Filled only for drafters that read the target's aux hidden states (Drafter.aux_layers,
    # EAGLE-3): those of positions aux_start .. aux_start + len - 1 ([len, A]), the ones the
    # drafter has not been sent yet (a drafter missing earlier ones starts from aux_start).
    aux: torch.Tensor | None = None
    aux_start: int = 0


@dataclass
class DraftOutput:
    tokens: list[list[int]]          # per request, at most k tokens (may be fewer, or none)
    q_ids: list[np.ndarray]          # per request [n, K] int32 support of each proposal
    q_probs: list[np.ndarray]        # per request [n, K] float32 probabilities on that support
    seconds: float = 0.0
    # per request, a tree instead of a chain: each draft's parent draft, -1 for the last
    # accepted token (parents first; see cluster.engine.worker.tree). None: every row is a chain.
    parents: list[list[int] | None] | None = None
    # per request, True where the drafter did not take what the request carried (a remote
    # drafter skipped while down, a replica that asked to resync): the verifier keeps those
    # aux states and sends them again, so the drafter's context has no hole. None: all taken.
    unread: list[bool] | None = None


class PendingDrafts:
    """Drafts a drafter left on the device (Drafter.launch): a verify pass can read them
    there (`device_ids`) before the host has them, and `finish` brings them to the host,
    waiting for the drafts alone, not for what was queued after them."""

    def __init__(self, ids: torch.Tensor, counts: list[int], ready, finish: Callable[[], DraftOutput]):
        self.ids = ids  # [requests, max count] int64 on the device, -1 past each row's drafts
        self.counts = counts  # drafts per request, known before the drafts are
        self.ready = ready  # a CUDA event after the drafts on the drafter's stream (None: no stream of its own)
        self.finish = finish
        self.waited = 0.0  # seconds finish waited and read (the planner's)

    def device_ids(self) -> torch.Tensor:
        """The drafts for a pass on the caller's stream, which waits for them on the device."""
        if self.ready is not None:
            stream = torch.cuda.current_stream()
            stream.wait_event(self.ready)
            self.ids.record_stream(stream)  # made on the drafter's stream, read on this one
        return self.ids


def spread(ids: torch.Tensor, rows: list[int], n: int) -> torch.Tensor:
    """Drafts [len(rows), k] of rows `rows` among n requests as [n, k], -1 in the others."""
    if len(rows) == n:
        return ids
    out = ids.new_full((n, ids.shape[1]), -1)
    out[device_values(rows, torch.int64, ids.device)] = ids  # pinned: no wait for the GPU
    return out


def host_copies(**tensors: torch.Tensor | None) -> tuple[dict, object | None]:
    """Copies of device tensors to pinned host memory, queued on the current stream, and an
    event recorded after them (wait on it, then read the copies as numpy). On a CPU the
    tensors themselves and no event."""
    if not any(t is not None and t.is_cuda for t in tensors.values()):
        return tensors, None
    out = {}
    for name, t in tensors.items():
        out[name] = None if t is None else torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        if t is not None:
            out[name].copy_(t, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    return out, done


def one_hot(tokens: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """A greedy proposal's support and probabilities: [n, 1] each."""
    return np.asarray(tokens, np.int32).reshape(-1, 1), np.ones((len(tokens), 1), np.float32)


class Drafter(abc.ABC):
    name = "drafter"
    # Whether the engine asks for the next step's drafts while this step verifies (assuming
    # every draft is accepted): "gated", a drafter in another process, whose queue makes a
    # wrong guess cost a step, so only while guesses pay; "free", one that drafts on its own
    # CUDA stream while the host would wait for the verify pass anyway; None, never.
    look_ahead: str | None = None
    reads_hidden = False     # requests carry the target's last hidden state (DraftRequest.hidden)
    reads_target_kv = False  # requests carry the target's KV location (DraftRequest.target_kv)
    # target layers whose inputs requests carry for new positions (DraftRequest.aux); () none
    aux_layers: tuple[int, ...] = ()

    @abc.abstractmethod
    def propose(self, requests: list[DraftRequest]) -> DraftOutput: ...

    def propose_async(self, requests: list[DraftRequest]) -> Future:
        """Remote drafters return a pending future; local ones compute now."""
        fut: Future = Future()
        fut.set_result(self.propose(requests))
        return fut

    def launch(self, requests: list[DraftRequest]) -> PendingDrafts | None:
        """The drafts left on the device, for a verify pass to read there; None where this
        drafter cannot (another process's, a tree's, a host-side one's): `propose` then."""
        return None

    def release(self, seq_ids: list[str]) -> None:
        """Forget per-sequence state (the sequence finished)."""

    def lag(self, rows: list[tuple[str, list[int]]]) -> int:
        """Tokens of these (seq_id, tokens) rows that this drafter would run over before drafting
        for them: its catch-up after plain steps. 0 where it keeps no state a row."""
        return 0

    def warm_up(self, max_draft: int = 0) -> None:
        """Compile, tune and capture what its steps need, before serving (GPU drafters);
        `max_draft`: the most tokens a step will ask of it (its engine's gamma_max + 1)."""


def empty_rows(tokens: list[list[int]], ids: list, probs: list) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Per-row proposals as [n, K] arrays; a row with no drafts gets [0, 1] arrays."""
    return ([np.asarray(i, np.int32).reshape(len(t), -1 if t else 1) for i, t in zip(ids, tokens)],
            [np.asarray(p, np.float32).reshape(len(t), -1 if t else 1) for p, t in zip(probs, tokens)])


def draft_keys(requests: list[DraftRequest]) -> list[int]:
    """Each row's key for its draft draws (draft_uniforms): its seed, or for an unseeded row a
    fresh random key each call (its draws need only be independent of everything before)."""
    return [r.params.seed % 2**63 if r.params.seed is not None else random.getrandbits(63) for r in requests]


_GOLDEN, _M1, _M2 = (c - 2**64 for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB))


def _lsr(x: torch.Tensor, s: int) -> torch.Tensor:
    return (x >> s) & ((1 << (64 - s)) - 1)  # a logical shift: torch's >> keeps int64's sign


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser on int64 (multiplication wraps as uint64's does)."""
    x = x + _GOLDEN
    x = (x ^ _lsr(x, 30)) * _M1
    x = (x ^ _lsr(x, 27)) * _M2
    return x ^ _lsr(x, 31)


def draft_uniforms(keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """One uniform in [0, 1) a row for the draft at `positions` (absolute token positions,
    int64), a hash of (key, position) rather than a draw from a stream. So a seeded row drafts
    the same tokens whichever drafter instance serves it and whether or not a look-ahead
    drafted its positions first. Lossless: a position's draft is tested at most once (it is
    then accepted or replaced), and a number is reused only by drafts that were never tested."""
    return _lsr(_mix(_mix(keys) + positions), 40).float() / 2**24


_ACCEPT_SALT = 0x5DEECE66D  # an acceptance test's key apart from its row's draft key


def accept_uniforms(params: list[SamplingParams], positions: torch.Tensor) -> torch.Tensor:
    """The uniforms of the acceptance tests of drafts at `positions` ([B, G] int64 on the
    device), as draft_uniforms gives the drafts': a hash of the row's seed and the position, not
    a draw from its generator (unseeded rows: a fresh key each call). A step then draws as many
    numbers from a row's generator (one Exp(1) vector) whatever its gamma, so a step launched
    before its row's gamma is known (cluster.engine.spec.ahead) keeps a seed's stream. Each
    position is tested at most once, and its draft was picked with another key."""
    keys = [(p.seed ^ _ACCEPT_SALT) % 2**63 if p.seed is not None else random.getrandbits(63) for p in params]
    return draft_uniforms(device_values(keys, torch.int64, positions.device)[:, None], positions)


def pick(top_p: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Each row's draw from its distribution top_p [B, K] (rows sum to 1) by the inverse CDF of
    u [B]: the first index whose cumulative probability passes u, never one of probability 0."""
    last = (top_p > 0).sum(-1) - 1
    return torch.minimum((top_p.cumsum(-1) <= u[:, None]).sum(-1), last)
