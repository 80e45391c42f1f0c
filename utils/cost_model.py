"""The measured cost of verifying drafts, on the machine, model, dtype and thread count in use.

A speculative step verifies k drafts with one target pass over 1 + k new tokens. A draft pays only
if the tokens it is expected to add outweigh what that pass costs over a one-token pass, and that
cost is a property of the hardware and its kernels, not of the algorithm: with the same code a pass
over 2 tokens of SmolLM2-135M cost 1.05x a one-token pass on one 2-core CPU and 1.84x on another.
So nothing here is one machine's constant: `PassCosts` holds what `utils/calibration.py` measured
(pass costs over 1 + k tokens and the fastest CPU shortcuts for each k), and `PassCosts.observe`
refines the estimates online from the passes generation makes anyway (a clipped running average
per k, so that one burst of load moves nothing far). Those same observations check a stored
table: once `STALE_AFTER` passes of some k and of k = 0 were timed, a ratio that differs from the
table's by more than its own spread (at least `STALE_MIN`) calls `on_stale` (the calibration
deletes the cached file: the next start measures again). This module runs no model.

`PRIOR` is the documented stand-in before anything is measured (or when calibration is switched
off with SPECDEC_CALIBRATE=0): one CPU's measurement, used with transformers' own kernels.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field

from utils.cpu_passes import Shortcuts

__all__ = ["DRAFT_SIZES", "PRIOR", "PassCosts", "prior_cost", "prior_costs"]

DRAFT_SIZES = (1, 2, 3, 4, 6, 8, 12, 16, 24, 31)  # each small k measured: the 1 -> 2 step can jump

# Cost of a pass over 1 + k tokens / a one-token pass: SmolLM2-135M, fp32, 2 cores of one CPU
# (with the CPU shortcuts). Only a prior: another CPU measured 1.84x at k = 1.
PRIOR = {0: 1.0, 1: 1.06, 2: 1.24, 4: 1.33, 8: 1.69, 16: 2.54, 32: 4.2}

ONLINE_WEIGHT = 0.1  # weight of one new observation in the running average
ONLINE_CLIP = 2.0  # an observation counts as at most this factor away from the current estimate
ONLINE_MIN = 3  # observations of k (and of k = 0) before they replace the calibration
STALE_AFTER = 16  # observations of k and of k = 0 before they may call a stored table wrong
# Least relative disagreement that calls a stored table wrong, whatever its own spread: online
# passes run at other context lengths than the calibration's, and a running average is noisy too.
# A busy machine's table is off by far more (1.05x against 2.52x quiet at k = 31).
STALE_MIN = 0.5


def _interpolate(points: dict[int, float], k: float) -> float:
    """Piecewise-linear through `points` (k -> value), extended linearly past the largest k."""
    keys = sorted(points)
    for k0, k1 in zip(keys, keys[1:], strict=False):
        if k <= k1:
            return points[k0] + (points[k1] - points[k0]) * (k - k0) / (k1 - k0)
    k0, k1 = keys[-2], keys[-1]
    return points[k1] + (points[k1] - points[k0]) * (k - k1) / (k1 - k0)


def prior_cost(num_drafts: int) -> float:
    """Relative cost of verifying `num_drafts` drafts under `PRIOR`."""
    return _interpolate(PRIOR, num_drafts)


@dataclass
class PassCosts:
    """What a pass over 1 + k new tokens costs one model here, and which CPU shortcuts it uses.

    Call it with k for the relative cost (a pass over one token = 1.0): it is the `draft_cost`
    of the speculative methods. `seconds()` gives absolute times (a drafter's step is compared
    with the target's in seconds).
    """

    relative: dict[int, float]  # k -> cost of 1 + k tokens / cost of 1 token, at the measured k
    one_token_seconds: float | None  # the one-token pass, None when unmeasured (prior)
    shortcuts: dict[int, Shortcuts] = field(default_factory=dict)  # measured k -> fastest choice
    measured: bool = False
    spread: float | None = None  # the measurement's own (max - min) / median, widest over k; None: prior
    on_stale: Callable[[], None] | None = field(default=None, repr=False, compare=False)  # called once
    stale: bool = False  # online timings disagreed with the table
    _online: dict[int, list[float]] = field(default_factory=dict, repr=False)  # k -> [seconds, count]
    _warmed: set = field(default_factory=set, repr=False)  # the k whose first pass (a warm-up, never timed) ran
    # Batched passes, timed as they run: (rows, tokens per row) -> [seconds, count].
    _batches: dict[tuple[int, int], list[float]] = field(default_factory=dict, repr=False)

    def __call__(self, num_drafts: int) -> float:
        online = self._online
        if (
            num_drafts in online and 0 in online
            and online[num_drafts][1] >= ONLINE_MIN and online[0][1] >= ONLINE_MIN
        ):
            return online[num_drafts][0] / online[0][0]
        return _interpolate(self.relative, num_drafts)

    def seconds(self, num_drafts: int = 0) -> float | None:
        """Estimated seconds of a pass over 1 + `num_drafts` tokens (None before any timing): the one-token pass as
        timed online once it has been seen `ONLINE_MIN` times (as `__call__` takes the ratios), else as calibrated."""
        online = self._online.get(0)
        base = online[0] if online and (online[1] >= ONLINE_MIN or self.one_token_seconds is None) else self.one_token_seconds
        return None if base is None else base * self(num_drafts)

    def shortcuts_for(self, num_drafts: int) -> Shortcuts:
        """The CPU shortcuts to use for a pass over 1 + `num_drafts` tokens: those measured fastest
        at the nearest measured k below (none when nothing was measured)."""
        below = [k for k in self.shortcuts if k <= num_drafts]
        return self.shortcuts[max(below)] if below else Shortcuts()

    def observe(self, num_drafts: int, seconds: float) -> None:
        """A pass over 1 + `num_drafts` tokens took `seconds`: refine the running estimate, and
        check the table against it. The first pass of each width is a warm-up, not a cost: a model's first
        passes pay once for what is built or touched at first use (measured: the self-drafter's first one-token
        pass took 184 ms against 68 ms calibrated; taken as its cost, it priced every later draft out of paying
        and no draft was made again to correct it)."""
        if num_drafts not in self._warmed:
            self._warmed.add(num_drafts)
            return
        _refine(self._online, num_drafts, seconds)
        if not self.stale and self.spread is not None and self._disagrees(num_drafts):
            self.stale = True
            if self.on_stale is not None:
                self.on_stale()

    def _disagrees(self, num_drafts: int) -> bool:
        """Whether the timed ratio at `num_drafts` is off the table by more than it may be."""
        online = self._online
        if num_drafts == 0 or 0 not in online or online[num_drafts][1] < STALE_AFTER or online[0][1] < STALE_AFTER:
            return False
        timed = online[num_drafts][0] / online[0][0]
        tolerance = max(self.spread, STALE_MIN)
        return abs(math.log(timed / _interpolate(self.relative, num_drafts))) > math.log1p(tolerance)

    def observe_batch(self, rows: int, width: int, seconds: float) -> None:
        """A pass feeding `width` tokens to each of `rows` rows took `seconds`."""
        _refine(self._batches, (rows, width), seconds)

    def batch_ratio(self, rows: int, width: int) -> float:
        """What a pass of `rows` rows x `width` tokens costs against one of `rows` x 1: as timed
        (both seen `ONLINE_MIN` times), else from the one-row table (rows x width tokens in all)."""
        wide, plain = self._batches.get((rows, width)), self._batches.get((rows, 1))
        if wide and plain and wide[1] >= ONLINE_MIN and plain[1] >= ONLINE_MIN:
            return wide[0] / plain[0]
        return self(rows * width - 1) / self(rows - 1)

    def row_ratio(self, rows: int) -> float:
        """What a plain pass of `rows` - 1 rows costs against one of `rows` rows (1.0 where a pass
        costs the same whatever its rows): as timed, else from the one-row table."""
        fewer, plain = self._batches.get((rows - 1, 1)), self._batches.get((rows, 1))
        if rows > 2 and fewer and plain and fewer[1] >= ONLINE_MIN and plain[1] >= ONLINE_MIN:
            return min(1.0, fewer[0] / plain[0])
        return min(1.0, self(rows - 2) / self(rows - 1))

    def table(self) -> dict[int, float]:
        """The relative costs it uses now, at 0 and the measured k (for reports)."""
        return {k: round(self(k), 3) for k in (0, *DRAFT_SIZES)}

    def to_json(self) -> dict:
        return {"relative": self.relative, "one_token_seconds": self.one_token_seconds, "measured": self.measured,
                "spread": self.spread,
                "shortcuts": {k: [s.few_row_linear, s.gqa_without_repeat] for k, s in self.shortcuts.items()}}

    @classmethod
    def from_json(cls, data: dict) -> PassCosts:
        return cls(
            relative={int(k): v for k, v in data["relative"].items()},
            one_token_seconds=data["one_token_seconds"],
            shortcuts={int(k): Shortcuts(*v) for k, v in data["shortcuts"].items()},
            measured=data["measured"],
            spread=data.get("spread"),
        )


def _refine(online: dict, key, seconds: float) -> None:
    """A clipped running average per key: one burst of load moves nothing far."""
    entry = online.get(key)
    if entry is None:
        online[key] = [seconds, 1]
        return
    estimate = entry[0]
    clipped = min(max(seconds, estimate / ONLINE_CLIP), estimate * ONLINE_CLIP)
    entry[0] = estimate + ONLINE_WEIGHT * (clipped - estimate)
    entry[1] += 1


def prior_costs() -> PassCosts:
    return PassCosts(relative=dict(PRIOR), one_token_seconds=None)
