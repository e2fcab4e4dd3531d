"""Small, plausible values of the engine's boundary types, for tests (not on the types)."""

from __future__ import annotations

import numpy as np

from cluster.engine.drafters.base import DraftOutput, DraftRequest
from cluster.engine.observation import StepObservation


def draft_request(k: int = 4) -> DraftRequest:
    return DraftRequest("dummy", [1, 2, 3, 1, 2], k)


def draft_output() -> DraftOutput:
    """One row proposing [1, 2], one-hot."""
    return DraftOutput([[1, 2]], [np.array([[1], [2]], np.int32)], [np.ones((2, 1), np.float32)])


def step_observation(batch_size: int = 4, gamma: int = 4) -> StepObservation:
    """A verify step with acceptance 0.5 per position."""
    accepted, n = [], batch_size
    for _ in range(gamma):
        n //= 2
        accepted.append(n)
    return StepObservation(batch_size, gamma, batch_size * (gamma + 1), 0.010, 0.002,
                           batch_size * gamma, accepted, [batch_size] * gamma)
