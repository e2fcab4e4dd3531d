"""Online step-cost fit for the goodput controller: y ~ theta . f, theta >= 0.

Exponentially weighted least squares over a handful of features (3 or 4), solved on
demand with plain Python (a 4x4 solve is ~15 us; no numpy on the hot path, and the controller re-solves only
every few steps).

Three things make it usable from the first steps on, on a noisy shared machine:
  * A small ridge, relative to each feature's own second moment (so it is scale-free),
    pulls every coefficient but the intercept towards 0. A direction the data cannot
    resolve (all steps at one batch size, or one gamma) then reads as "free", i.e. the
    cost stays flat: speculation's memory-bound premise until steps show otherwise.
  * Costs are never negative: a coefficient that comes out below 0 (noise) is fixed at 0
    and the rest refitted (an active-set loop of at most n rounds).
  * Once warm, an observation is clipped to within a factor of the prediction, so one
    step stalled by another process cannot drag the fit (least squares is not robust).
"""

from __future__ import annotations


class CostFit:
    def __init__(self, n: int, forget: float, ridge: list[float], clip: float = 0.0, warmup: int = 8):
        assert len(ridge) == n
        self.clip, self.warmup = clip, warmup
        self.keep = 1.0 - forget
        self.ridge = ridge  # per feature, relative to its second moment; 0 for the intercept
        self.S = [[0.0] * n for _ in range(n)]  # decayed sum of f f^T
        self.r = [0.0] * n  # decayed sum of f y
        self.n = 0  # observations seen (not decayed)
        self._theta = [0.0] * n
        self._pending = 0  # observations since the last solve

    def add(self, f: list[float], y: float) -> None:
        if self.clip and self.n >= self.warmup:
            # A step slowed several-fold by something else on the machine (another
            # process, a GC pause) says nothing about what the step costs: clip it to
            # within `clip` times what the fit expects. A real change still gets through,
            # a factor `clip` per step.
            p = sum(t * x for t, x in zip(self._theta, f))
            if p > 0.0:
                y = min(max(y, p / self.clip), p * self.clip)
        k = self.keep
        for i, fi in enumerate(f):
            self.r[i] = k * self.r[i] + fi * y
            row = self.S[i]
            for j, fj in enumerate(f):
                row[j] = k * row[j] + fi * fj
        self.n += 1
        self._pending += 1

    @property
    def theta(self) -> list[float]:
        """The fit with every observation in it."""
        return self.coef(0)

    def coef(self, max_stale: int) -> list[float]:
        """The fit, re-solved only once more than `max_stale` observations are new: a
        step's decision can use costs a few steps old, and the solve dominates its cost."""
        if self._pending > max_stale:
            self._theta = self._solve()
            self._pending = 0
        return self._theta

    def __call__(self, f: list[float]) -> float:
        return sum(t * x for t, x in zip(self.theta, f))

    def _solve(self) -> list[float]:
        n = len(self.r)
        active = [i for i in range(n) if self.S[i][i] > 0.0]
        while active:
            a = [[self.S[i][j] + (self.ridge[i] * self.S[i][i] + 1e-15 if i == j else 0.0) for j in active]
                 for i in active]
            x = _solve_spd(a, [self.r[i] for i in active])
            worst = min(range(len(active)), key=lambda k: x[k])
            if x[worst] >= 0.0:
                theta = [0.0] * n
                for i, v in zip(active, x):
                    theta[i] = v
                return theta
            active.pop(worst)
        return [0.0] * n


def _solve_spd(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting for a small, well-conditioned system."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(m[r][c]))
        m[c], m[p] = m[p], m[c]
        piv = m[c][c] or 1e-300
        for r in range(c + 1, n):
            f = m[r][c] / piv
            if f:
                for k in range(c, n + 1):
                    m[r][k] -= f * m[c][k]
    x = [0.0] * n
    for c in range(n - 1, -1, -1):
        x[c] = (m[c][n] - sum(m[c][k] * x[k] for k in range(c + 1, n))) / (m[c][c] or 1e-300)
    return x
