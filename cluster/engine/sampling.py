"""Sampling parameters, logits processing, and lossless rejection sampling.

Greedy decoding is the limit of sampling: a greedy row's target distribution is one-hot on
the argmax, and a greedy drafter's proposal is one-hot on its token. With that, one
rejection-sampling function serves greedy and sampled rows alike, and plain decoding is the
same call with zero draft tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from cluster.engine.logprobs import MAX_LOGPROBS

MAX_STOP, MAX_STOP_CHARS = 16, 128


class InvalidRequest(ValueError):
    """A request the engine refuses; the message says which field and why."""


@dataclass
class SamplingParams:
    max_tokens: int = 128
    temperature: float = 0.0        # 0 = greedy
    top_p: float = 1.0              # in (0, 1]
    top_k: int = 0                  # 0 = off
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    # the target's log-probability of each emitted token and its `logprobs` most likely
    # alternatives (cluster.engine.logprobs); None: not computed
    logprobs: int | None = None

    def validate(self) -> None:
        def bad(name, why):
            raise InvalidRequest(f"{name} {why}")

        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            bad("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not isinstance(self.temperature, (int, float)) or not 0 <= self.temperature <= 100:
            bad("temperature", f"must be in [0, 100], got {self.temperature!r}")
        if not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            bad("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            bad("top_k", f"must be an integer >= 0, got {self.top_k!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 2**63):
            bad("seed", f"must be an integer in [0, 2^63), got {self.seed!r}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", "must be a list of non-empty strings")
        if len(self.stop) > MAX_STOP or any(len(s) > MAX_STOP_CHARS for s in self.stop):
            bad("stop", f"allows at most {MAX_STOP} strings of at most {MAX_STOP_CHARS} characters")
        if self.logprobs is not None and (isinstance(self.logprobs, bool) or not isinstance(self.logprobs, int)
                                          or not 0 <= self.logprobs <= MAX_LOGPROBS):
            bad("logprobs", f"must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def device_values(xs, dtype: torch.dtype, device) -> torch.Tensor:
    """`xs` (a list or a numpy array) as a tensor on `device` without waiting for the GPU: a
    plain torch.tensor(..., device=) copies from pageable memory, which synchronises the
    stream, so the host would wait for the pass it just launched (a verify pass, or a step
    launched ahead, cluster.engine.worker.pipeline) before it queues what follows."""
    t = torch.as_tensor(xs, dtype=dtype)
    return t.pin_memory().to(device, non_blocking=True) if torch.device(device).type == "cuda" else t


def target_probs(logits: torch.Tensor, params: list[SamplingParams], rows_per_param: int = 1) -> torch.Tensor:
    """logits: [N, V] -> processed fp32 probabilities [N, V]; row i uses params[i // rows_per_param].

    Greedy rows become one-hot on the argmax (ties go to the lowest id, as torch.argmax).
    Which steps to take is decided from `params` on the host, so nothing here waits for the GPU.
    """
    logits = logits.float()  # CUDA graphs hand over the head's bf16 output
    n, vocab = logits.shape
    rep = lambda xs, dt: device_values(xs, dt, logits.device).repeat_interleave(rows_per_param)  # noqa: E731
    if all(p.greedy for p in params):  # one-hot rows only: skip the softmax over the vocabulary
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    temp = rep([p.temperature if p.temperature > 0 else 1.0 for p in params], torch.float32)
    probs = torch.softmax(logits / temp[:, None], dim=-1)
    if any(0 < p.top_k < vocab or p.top_p < 1 for p in params):
        top_k = rep([p.top_k if p.top_k > 0 else vocab for p in params], torch.int64).clamp(max=vocab)
        top_p = rep([p.top_p for p in params], torch.float32)
        sorted_p, order = probs.sort(dim=-1, descending=True)
        rank = torch.arange(vocab, device=logits.device)[None, :]
        # keep a token if it is within top-k and the mass before it is below top-p
        keep = (rank < top_k[:, None]) & (sorted_p.cumsum(-1) - sorted_p < top_p[:, None])
        sorted_p = sorted_p * keep
        probs = torch.zeros_like(probs).scatter_(-1, order, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    if any(p.greedy for p in params):
        greedy = rep([p.greedy for p in params], torch.bool)
        onehot = torch.zeros_like(probs).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
        probs = torch.where(greedy[:, None], onehot, probs)
    return probs


def fill_draws(out: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
               kind: str, widths: list[int] | None = None) -> torch.Tensor:
    """Draws into the sampled rows of `out` [B, W] ("exponential" Exp(1) or "uniform" U[0, 1)),
    greedy rows left as they are: a seeded row's `widths[b]` (else W) from its own generator, on
    the device, so its seed reproduces its stream; every unseeded row's in one call from the
    device's default generator (a generator a row costs a kernel launch a row: 256 a draw at 256
    rows, for draws that need only be independent)."""
    free = []
    for b, (p, g) in enumerate(zip(params, generators)):
        if p.greedy:
            continue
        if g is None:
            free.append(b)
            continue
        row = out[b, : widths[b]] if widths is not None else out[b]
        row.exponential_(generator=g) if kind == "exponential" else row.uniform_(generator=g)
    if free:
        x = torch.empty((len(free), out.shape[1]), device=out.device)
        out[device_values(free, torch.int64, out.device)] = x.exponential_() if kind == "exponential" else x.uniform_()
    return out


def draw(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token a row from the target at `logits` [B, V], on the device ([B] int64): the argmax
    for greedy rows, an exponential race (one Exp(1) vector a row a token, `fill_draws`) for
    sampled ones. Plain steps draw with it whether the host waits for them or they run a step
    ahead (cluster.engine.worker.pipeline), so a seed gives the same tokens either way."""
    if all(p.greedy for p in params):
        return logits.argmax(-1)
    probs = target_probs(logits, params)
    noise = fill_draws(torch.ones_like(probs), params, generators, "exponential")
    return (probs / noise.clamp_(min=1e-20)).argmax(-1)


def rejection_sample(
    draft_ids: torch.Tensor,     # [B, G] int64, -1 past each row's num_draft
    num_draft: torch.Tensor,     # [B] int64
    draft_probs: torch.Tensor,   # [B, G, V] proposal q each draft was sampled from
    target_probs: torch.Tensor,  # [B, G+1, V] target p; row j: next-token dist after draft j
    uniform: torch.Tensor,       # [B, G] U[0, 1) for the accept tests
    noise: torch.Tensor,         # [B, V] Exp(1) noise for the one resample/bonus draw
) -> tuple[torch.Tensor, torch.Tensor]:
    """Leviathan et al. speculative sampling, batched. Returns (out [B, G+1], num_accepted [B]).

    Draft j is accepted with probability min(1, p_j(d)/q_j(d)); at the first rejection the
    token is drawn from normalise(max(0, p_j - q_j)); if all drafts pass, the bonus token is
    drawn from p_G. out[b, :n+1] holds the n accepted drafts and the drawn token, -1 after.
    """
    B, G = draft_ids.shape
    ids = draft_ids.clamp(min=0)[..., None]
    if G:
        p_d = target_probs[:, :G].gather(-1, ids).squeeze(-1)
        q_d = draft_probs.gather(-1, ids).squeeze(-1)
        valid = torch.arange(G, device=ids.device)[None, :] < num_draft[:, None]
        accept = (uniform * q_d < p_d) & valid
        num_acc = accept.int().cumprod(-1).sum(-1)
    else:
        num_acc = torch.zeros(B, dtype=torch.int64, device=draft_ids.device)
    rows = torch.arange(B, device=draft_ids.device)
    p = target_probs[rows, num_acc]                                        # [B, V]
    rejected = num_acc < num_draft
    if G:
        q = draft_probs[rows, num_acc.clamp(max=G - 1)]
        residual = (p - q).clamp(min=0)
        mass = residual.sum(-1, keepdim=True)
        # mass is 0 only when p == q, where the draft is accepted surely; keep p as a guard
        residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), p)
        p = torch.where(rejected[:, None], residual, p)
    token = (p / noise).argmax(-1)  # exponential race: a draw from p
    out = torch.where(torch.arange(G + 1, device=ids.device)[None, :] < num_acc[:, None],
                      torch.cat([draft_ids, draft_ids.new_full((B, 1), -1)], 1), -1)
    out[rows, num_acc] = token
    return out, num_acc.long()
