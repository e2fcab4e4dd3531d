"""The one list of drafters: config validation, the CLI, the router and the docs read it.

Each entry says where the drafter can run. `remote` drafters can live in their own Drafter
replicas (the draft request carries all they need: EAGLE-3's carries the target's hidden
states of its new tokens); the others read the target's own state (its last hidden state,
its KV cache or its lm_head) and run in the verifier's process.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class DrafterInfo:
    name: str
    module: str          # cluster.engine.drafters.<module>
    remote: bool         # can run in a Drafter replica of its own
    summary: str


DRAFTERS: dict[str, DrafterInfo] = {d.name: d for d in (
    DrafterInfo("model", "model", True, "a small draft model sharing the target's tokenizer"),
    DrafterInfo("ngram", "ngram", True, "prompt lookup: what followed the last n tokens earlier in the sequence"),
    DrafterInfo("medusa", "medusa", False, "Medusa heads on the target's last hidden state (a candidate tree)"),
    DrafterInfo("early-exit", "early_exit", False, "the target's first layers and its own head"),
    DrafterInfo("eagle3", "eagle3", True, "an EAGLE-3 head over the target's hidden states at three layers"),
)}


def drafter_names() -> list[str]:
    return list(DRAFTERS)
