"""The two online estimators every policy learns with: a running average (of a timing, of a rate)
and a rate that forgets (a share of judged drafts accepted, from a prior).

One home for both, so that "how fast it forgets" and "how much the prior counts" mean the same in
the draft-length policy, the per-token stop, the cascade, the hybrid and the model drafter's timing.
"""

from __future__ import annotations


class RunningAverage:
    """An exponential running average: the first observation, then each new one weighted `weight`
    (0.2: roughly the last five count). `value` is None before any observation."""

    def __init__(self, weight: float) -> None:
        self.weight = weight
        self.value: float | None = None
        self._last_weight = 1.0  # the weight the last observation had (1.0: it was the first)

    def add(self, x: float) -> float:
        """One observation -> the new average."""
        self._last_weight = 1.0 if self.value is None else self.weight
        self.value = x if self.value is None else self.value + self.weight * (x - self.value)
        return self.value

    def amend(self, extra: float) -> None:
        """The last observation was `extra` larger than given (a cost measured after it)."""
        if self.value is not None:
            self.value += self._last_weight * extra


class DecayedRate:
    """accepted / judged, learned online from a prior worth `prior_weight` judged drafts at rate
    `prior`; `decay(factor)` multiplies what was learned so far (prior included) by `factor`, so
    that the rate follows the recent drafts (factor 0.97 per judged draft: roughly the last 30)."""

    def __init__(self, prior: float, prior_weight: float) -> None:
        self.accepted, self.judged = prior * prior_weight, prior_weight

    @property
    def rate(self) -> float:
        return self.accepted / self.judged

    def decay(self, factor: float) -> None:
        self.accepted *= factor
        self.judged *= factor

    def add(self, accepted: float, judged: float) -> None:
        self.accepted += accepted
        self.judged += judged
