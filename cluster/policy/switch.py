"""What turning drafting on after plain decoding costs, and when it pays (the goodput controller's).

A draft model that sat out plain steps first runs over everything its rows missed, each new
prompt whole (126-261 ms at 55-64 rows on an H100 against 8-9 ms plain steps,
benchmarks/gpu/h100/sweep_2026-11-27; 430 ms at 188 rows 131k tokens behind on an H200,
benchmarks/gpu/h200/scale_2026-11-28). Each step up from plain decoding reads its drafting's
excess over a modelled draft, fitted as seconds fixed plus seconds a lagged token. A switch up is
rent or buy: it happens once the time speculation would have saved since it first looked better
covers the price, and only where the rows that pay it live long enough to win it back.
"""

from __future__ import annotations

from collections.abc import Callable

from cluster.policy.fit import CostFit

FADE = 0.9  # what a reading keeps at the next
READINGS = 8  # readings the snapshot shows


class SwitchPrice:
    def __init__(self, ridge: float):
        # One reading (or readings at one lag) reads as a fixed cost; readings at two lags
        # separate them. Not clipped: a lag far past those read is new information, not a
        # stalled step (an H100 read 4-5 ms at 1 row and 316 ms at 16 rows 11k tokens behind;
        # clipped to 4x the fit, that reading priced the next catch-up at 13 ms).
        self.fit = CostFit(2, 1.0 - FADE, [0.0, ridge], 0.0, 2)
        self.readings: list[tuple[int, int, float]] = []  # (rows, lag, excess ms), the last few
        self.bank = 0.0  # seconds speculating would have saved since it first looked better

    def read(self, rows: int, lag: int, excess_s: float) -> None:
        """A step up from plain decoding `lag` tokens behind: its drafting took `excess_s` more
        than a modelled draft."""
        self.fit.add([1.0, float(lag)], excess_s)
        self.readings = [*self.readings[1 - READINGS:], (rows, lag, round(1e3 * excess_s, 2))]

    def cost(self, lag: int | None) -> float:
        """Predicted seconds a drafting step adds catching up `lag` tokens (0 where the lag is
        not known, or before any reading)."""
        return self.fit([1.0, float(lag)]) if self.fit.n and lag else 0.0

    @staticmethod
    def won_back(saved: float, price: float, tokens_left: float | None) -> bool:
        """Whether saving `saved` seconds a step's worth of tokens wins back `price` before the
        rows that pay it end (`tokens_left` each on average; None: not known). A catch-up over
        rows about to finish, as a batch drains, is never won back."""
        return tokens_left is None or saved * tokens_left >= price

    def pays(self, saved: float, lag: Callable[[], int | None], tokens_left: Callable[[], float | None]) -> bool:
        """Rent or buy, one step at a time while speculating looks better by `saved` seconds a
        step's worth of tokens: a switch that is won back at once goes at once; one that
        speculation would never win back does not flap, and one on a wrong model is measured by
        the steps after it, which correct the model for the load. `lag` and `tokens_left` are
        asked only once the bank covers the price's fixed part (each goes over every row)."""
        self.bank += saved
        if self.bank < self.fit.theta[0] or (price := self.cost(lag())) > self.bank:
            return False
        if not self.won_back(saved, price, tokens_left()):
            return False
        self.bank = 0.0
        return True

    def snapshot(self) -> dict:
        return {"s": self.fit.theta[0], "s_per_token": self.fit.theta[1], "n": self.fit.n,
                "readings": [list(r) for r in self.readings]}
