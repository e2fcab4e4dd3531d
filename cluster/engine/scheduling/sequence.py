"""One `Sequence` carries all per-request state through the engine."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from cluster.engine.logprobs import TokenLogprob
from cluster.engine.sampling import SamplingParams
from cluster.engine.scheduling.kv_cache import KVHandle


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class SpecParams:
    """Per-request speculation override: mode 'auto' (the controller decides), 'off', or 'fixed'."""
    mode: str = "auto"
    gamma: int = 0

    @property
    def label(self) -> str:
        """"auto", "off", or a fixed gamma as a number ("4")."""
        return str(self.gamma) if self.mode == "fixed" else self.mode


@dataclass
class SeqStats:
    drafted: int = 0
    accepted: int = 0
    verify_steps: int = 0           # target passes that produced tokens after the first
    last_gamma: int = 0
    proposed_per_pos: list[int] = field(default_factory=list)
    accepted_per_pos: list[int] = field(default_factory=list)
    preemptions: int = 0
    arrival: float = field(default_factory=time.perf_counter)
    first_token: float | None = None
    token_times: list[float] = field(default_factory=list)  # one per step that emitted tokens
    prefix_hit_tokens: int = 0

    def record(self, num_draft: int, num_acc: int) -> None:
        self.drafted += num_draft
        self.accepted += num_acc
        self.verify_steps += 1
        self.last_gamma = num_draft
        while len(self.proposed_per_pos) < num_draft:
            self.proposed_per_pos.append(0)
            self.accepted_per_pos.append(0)
        for j in range(num_draft):
            self.proposed_per_pos[j] += 1
            self.accepted_per_pos[j] += j < num_acc

    def summary(self, requested: str = "auto") -> dict:
        """`requested`: the request's speculation (SpecParams.label), beside what it got."""
        itl = sorted(b - a for a, b in zip(self.token_times, self.token_times[1:]))
        pct = lambda q: 1e3 * itl[min(len(itl) - 1, int(q * len(itl)))] if itl else 0.0  # noqa: E731
        end = self.token_times[-1] if self.token_times else self.arrival
        return {
            "spec": {
                "drafted": self.drafted,
                "accepted": self.accepted,
                "acceptance_rate": self.accepted / self.drafted if self.drafted else 0.0,
                "mean_accepted_len": (self.accepted + self.verify_steps) / self.verify_steps if self.verify_steps else 0.0,
                "per_position": [a / p if p else 0.0 for a, p in zip(self.accepted_per_pos, self.proposed_per_pos)],
                "last_gamma": self.last_gamma,
                "verify_steps": self.verify_steps,
                "requested": requested,
            },
            "timing": {
                "ttft_ms": 1e3 * ((self.first_token or end) - self.arrival),
                "itl_ms_p50": pct(0.5),
                "itl_ms_p99": pct(0.99),
                "total_ms": 1e3 * (end - self.arrival),
            },
        }


@dataclass(eq=False)  # identity: the scheduler's membership tests must not compare token lists
class Sequence:
    seq_id: str
    prompt_ids: list[int]
    params: SamplingParams
    spec: SpecParams = field(default_factory=SpecParams)
    drafter: str | None = None       # None: the engine's default drafter
    token_ids: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    kv: KVHandle | None = None       # its row and blocks in the target's KV cache, while it holds them
    num_cached: int = 0              # tokens whose KV is in the cache
    finish_reason: str | None = None
    sent_tokens: int = 0             # output tokens already streamed
    generator: torch.Generator | None = None
    stats: SeqStats = field(default_factory=SeqStats)
    # (len(token_ids) when taken, the target's last hidden state [D] there): kept only while a
    # drafter reads hidden states (Drafter.reads_hidden), and only fresh while the length still matches
    hidden: tuple[int, torch.Tensor] | None = None
    # one per output token while params.logprobs is set (a preemption recomputes KV, never these)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    # (first position, [n, A]): the target's aux hidden states not yet sent to an EAGLE-3
    # drafter (cluster.engine.spec.aux_hidden); kept only while this sequence's drafter reads them
    aux: tuple[int, torch.Tensor] | None = None
    # positions past its last token a step launched ahead writes while the host reads the step
    # before (cluster.engine.spec.ahead): blocks settle keeps
    reserve: int = 0

    def __post_init__(self):
        self.token_ids = list(self.prompt_ids)

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - len(self.prompt_ids)

    @property
    def prefill_target(self) -> int:
        """Tokens to compute before verify steps: the whole prompt (its last position gives the
        first token), or, recomputing after preemption, all but the last token (which the next
        verify step feeds, as it would have without the preemption)."""
        return len(self.token_ids) - 1 if self.num_output else self.num_prompt

    @property
    def prefilled(self) -> bool:
        n = len(self.token_ids)  # prefill_target inlined: read for every row several times a step
        return self.num_cached >= (n - 1 if n > len(self.prompt_ids) else n)

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def stop_reason(self, token: int, eos: int | None, max_model_len: int) -> str | None:
        """Why `token`, just appended, ends this sequence (None: it goes on)."""
        if token == eos and not self.params.ignore_eos:
            return "eos"
        if self.detok.add(token):
            return "stop"
        n = len(self.token_ids)
        return "length" if n - len(self.prompt_ids) >= self.params.max_tokens or n >= max_model_len else None

    def output(self, detokenize: bool) -> "RequestOutput":
        """What this sequence produced since its last output (a streaming delta); text only
        with `detokenize` or stop strings."""
        ids = self.token_ids[self.num_prompt + self.sent_tokens:]
        self.sent_tokens += len(ids)
        text = self.detok.delta(final=self.finished) if detokenize or self.params.stop else None
        out = RequestOutput(self.seq_id, ids, text, self.finished, self.finish_reason, self.num_prompt)
        if self.params.logprobs is not None:
            out.logprobs = self.logprobs[self.sent_tokens - len(ids):self.sent_tokens]
        if self.finished:
            # a preempted row readmitted may hit on its own output's blocks: count the prompt's only
            cached = min(self.stats.prefix_hit_tokens, self.num_prompt)
            out.stats = {**self.stats.summary(self.spec.label), "cached_tokens": cached}
        return out


@dataclass
class RequestOutput:
    """What one engine step produced for one request (a streaming delta)."""
    seq_id: str
    token_ids: list[int]
    text: str | None  # None: left undecoded (Engine.detokenize off); its consumer decodes it
    finished: bool
    finish_reason: str | None = None
    num_prompt: int = 0
    stats: dict | None = None       # SeqStats.summary() on the final output
    logprobs: list[TokenLogprob] | None = None  # one per token_ids entry, when the request asked

    def then(self, later: RequestOutput) -> RequestOutput:
        """This delta followed by a later one of the same request, as one delta."""
        lps = None if self.logprobs is None and later.logprobs is None else (self.logprobs or []) + (later.logprobs or [])
        return RequestOutput(self.seq_id, self.token_ids + later.token_ids, self.text + later.text, later.finished,
                             later.finish_reason, later.num_prompt, later.stats, lps)


def tokens_left(seqs: list[Sequence], max_model_len: int) -> float | None:
    """The tokens each of `seqs` may still produce (its max_tokens, the model's length), on
    average; None for no rows."""
    if not seqs:
        return None
    return sum(min(s.params.max_tokens - s.num_output, max_model_len - len(s.token_ids)) for s in seqs) / len(seqs)
