"""Per-position draft acceptance for the goodput controller, on two timescales.

a_j = P(draft j accepted | drafts before it accepted). Two decayed count estimates:

  recent    data only, decayed every step (drafted or not) by (1 - alpha): what the
            current requests accept. At a batch of b it holds about b/alpha samples.
  long-run  decayed only when position j is drafted, by (1 - alpha/10), and seeded with
            `prior_weight` pseudo-counts at the prior (which fade as data arrives): what
            this drafter/target pair accepts in general.

The estimate is the recent counts shrunk towards the long-run rate with LONG_RUN_WEIGHT
pseudo-counts. A big batch drafting every step reads almost only recent data; one stream
drafting every step holds about 1/alpha = 20 recent samples, which outweigh the long run
5 to 1. When gamma
sits at 0 (or below j) the recent data fades and the estimate returns to the long-run
rate, not to the configured prior: a stale low reading at one stream, say, cannot hold
gamma at 0 for good, and the first drafts after it are trusted against what the pair
usually does. A position never drafted takes the larger of the prior and the position
before's rate (the conditional rate is roughly flat in depth on real pairs; if it falls,
drafting there measures it).
"""

from __future__ import annotations

LONG_RUN_WEIGHT = 4.0  # pseudo-samples of the long-run rate in the estimate


class Acceptance:
    def __init__(self, positions: int, alpha: float, prior: float, prior_weight: float):
        self.keep, self.keep_long = 1.0 - alpha, 1.0 - alpha / 10.0
        self.prior, self.weight = prior, min(prior_weight, LONG_RUN_WEIGHT)
        self.acc = [0.0] * positions  # recent
        self.reached = [0.0] * positions
        self.acc_long = [0.0] * positions
        self.reached_long = [0.0] * positions
        self.prior_mass = [prior_weight] * positions

    def observe(self, proposed: list[int], accepted: list[int]) -> None:
        """One step: sequences proposing / accepting draft position j (StepObservation)."""
        k, kl = self.keep, self.keep_long
        self.acc = [k * x for x in self.acc]
        self.reached = [k * x for x in self.reached]
        prev = None
        for j in range(min(len(proposed), len(self.acc))):
            # Sequences that reached position j: proposed it and accepted all before it.
            # Exact when the step used one gamma; an upper bound on the denominator otherwise.
            reached = proposed[j] if prev is None else min(proposed[j], prev)
            acc = accepted[j] if j < len(accepted) else 0
            prev = acc
            if reached > 0:
                self.acc[j] += acc
                self.reached[j] += reached
                self.acc_long[j] = kl * self.acc_long[j] + acc
                self.reached_long[j] = kl * self.reached_long[j] + reached
                self.prior_mass[j] *= kl

    def long_run(self) -> list[float]:
        out, prev = [], self.prior
        for acc, r, m in zip(self.acc_long, self.reached_long, self.prior_mass):
            a = min(1.0, (acc + m * prev) / (r + m)) if r + m > 0 else prev
            out.append(a)
            prev = max(self.prior, a)
        return out

    def rates(self) -> list[float]:
        w = self.weight
        return [min(1.0, (acc + w * base) / (r + w)) if r + w > 0 else base
                for acc, r, base in zip(self.acc, self.reached, self.long_run())]
