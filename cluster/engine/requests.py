"""The one check of what a request asks for, shared by every ingress and the engine.

An ingress runs it before a request leaves for a verifier (so bad input gets its status at
the edge); the engine runs it again on `add_request`, because local users and benchmarks
call the engine directly. Both read the same limits, so the two can never disagree.
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
    params.validate()
    if spec.mode not in SPEC_MODES:
        raise InvalidRequest(f"speculation mode must be auto, off or fixed, got {spec.mode!r}")
    if spec.mode == "fixed" and not (isinstance(spec.gamma, int) and 0 <= spec.gamma <= limits.gamma_max):
        raise InvalidRequest(f"speculation gamma must be in [0, {limits.gamma_max}], got {spec.gamma!r}")
    if drafter is not None:
        known = tuple(DRAFTERS) if limits.drafters is None else limits.drafters
        if drafter not in known:
            shown = drafter if len(drafter) <= 40 else drafter[:40] + "..."
            raise InvalidRequest(f"unknown drafter {shown!r} (available: {', '.join(known) or 'none'})")
    if not prompt_ids:
        raise InvalidRequest("prompt is empty")
    if len(prompt_ids) >= limits.max_model_len:
        raise InvalidRequest(f"prompt has {len(prompt_ids)} tokens; the limit is {limits.max_model_len - 1} "
                             f"(max_model_len {limits.max_model_len})")
    if limits.vocab_size is not None and any(not 0 <= t < limits.vocab_size for t in prompt_ids):
        raise InvalidRequest("prompt token id out of vocabulary")
