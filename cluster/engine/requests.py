"""The one check of what a request asks for, at the edge it enters by.

Served requests are checked by the router (cluster.serve.admission) and then trusted: the
engine core enqueues them (`Engine.enqueue`, which asserts only what its memory depends on).
Local users and benchmarks enter by `Engine.add_request`, which runs the same check. Both read
the same limits, so the two edges can never disagree. The parameters are checked apart from
the prompt, so an edge can refuse them before it spends time tokenizing.
"""

from __future__ import annotations

from dataclasses import dataclass

from cluster.engine.drafters.registry import DRAFTERS
from cluster.engine.sampling import InvalidRequest, SamplingParams
from cluster.engine.scheduling.sequence import SpecParams

SPEC_MODES = ("auto", "off", "fixed")


@dataclass(frozen=True)
class RequestLimits:
    max_model_len: int               # prompt + output tokens per sequence
    gamma_max: int                   # largest fixed speculation length
    vocab_size: int | None = None    # None: token ids are not checked (text prompts)
    drafters: tuple[str, ...] | None = None  # drafters this deployment has; None: any registered one


def validate_request(prompt_ids: list[int], params: SamplingParams, spec: SpecParams,
                     drafter: str | None, limits: RequestLimits) -> None:
    """Raise InvalidRequest naming the first field that is out of bounds."""
    validate_params(params, spec, limits.gamma_max)
    validate_drafter(drafter, limits.drafters)
    validate_prompt(prompt_ids, limits)


def validate_params(params: SamplingParams, spec: SpecParams, gamma_max: int) -> None:
    """Speculation and sampling: what needs neither tokens nor a verifier's answer."""
    if spec.mode not in SPEC_MODES:  # echoed cut short: the field may be anything a client sent
        raise InvalidRequest(f"unknown speculation mode {str(spec.mode)[:40]} (auto, off or fixed)")
    if spec.mode == "fixed" and not (isinstance(spec.gamma, int) and 0 <= spec.gamma <= gamma_max):
        raise InvalidRequest(f"speculation gamma must be in [0, {gamma_max}], got {spec.gamma!r}")
    params.validate()


def validate_drafter(drafter: str | None, drafters: tuple[str, ...] | None) -> None:
    """A named drafter must be one this deployment has (None: any registered one)."""
    if drafter is not None:
        known = tuple(DRAFTERS) if drafters is None else drafters
        if drafter not in known:
            shown = drafter if len(drafter) <= 40 else drafter[:40] + "..."
            raise InvalidRequest(f"unknown drafter {shown!r} (available: {', '.join(known) or 'none'})")


def validate_prompt(prompt_ids: list[int], limits: RequestLimits) -> None:
    """The prompt's tokens: there, within the length and the vocabulary."""
    if not prompt_ids:
        raise InvalidRequest("prompt is empty")
    if len(prompt_ids) >= limits.max_model_len:
        raise InvalidRequest(f"prompt has {len(prompt_ids)} tokens; the limit is {limits.max_model_len - 1} "
                             f"(max_model_len {limits.max_model_len})")
    if limits.vocab_size is not None and any(not 0 <= t < limits.vocab_size for t in prompt_ids):
        raise InvalidRequest("prompt token id out of vocabulary")
