"""When a drafter model should stop drafting: its own confidence, learned into acceptance odds.

A fixed draft length (or one chosen from a single acceptance rate) drafts as long after a token the
drafter is unsure of as after one it is sure of. But the drafter's probability of its own draft,
c = q(x), says much about whether the target will accept it: on a real pair code is drafted sure
for long stretches and prose unsure (docs/results.md, "Figures behind the code's rules"). transformers stops
drafting below a fixed c (`assistant_confidence_threshold`, 0.4); here the threshold follows from
the measured costs instead:

- `ConfidenceAcceptance` maps c to P(accepted | the drafts before it were), per bucket of c, from
  a prior (the bucket's own c: a calibrated drafter) refined online by what the target accepted.
- `ChainRecord` (`sampling/policy/draft_policy.py`) says whether starting a chain pays, as measured: the tokens the
  chains a pair started gave against what plain steps would have given in their cost, learned here
  (`ConfidenceStop.observe_step`). The draft-length policy starts chains by it (`CostAwareDraftLength`):
  a single acceptance rate, priced as if every chain drafted alike, says little of chains the stop sizes (on a
  drafter at 0.4-0.5 of a target pass its prior sat on the break-even point, and the timings of the moment decided
  whether a generation drafted at all: docs/results.md, "The start of a chain, and the self-drafter as it is
  called").
- `pair_record` keeps both, the odds and the record, per drafter, target and decoding kind across generations: a
  generation of 64 tokens judges a few dozen drafts, too few to move a prior far, and a drafter's calibration is its
  own (the four-bit self-drafter is right more often than its confidence says: it is the target, rounded).
- `ConfidenceStop` drafts token after token while the drafts' expected accepted tokens per unit of
  cost can still grow (looking ahead over further drafts as likely as the last), then keeps the
  best prefix: the tokens drafted are paid for, so only the verification's cost counts there.
  Where a host read waits for the drafter's device, the rule is not asked draft by draft: a chain of
  `planned_length` drafts is drafted on the device, read once, and judged then; its length is the cost model's best
  for the pair's recent acceptance by position (`PositionAcceptance`), the confidences unseen until it is drafted.
"""

from __future__ import annotations

import functools
import weakref
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass, field

from sampling.policy.draft_policy import ChainRecord, CostAwarePolicy, best_draft_length, best_tree_size
from sampling.policy.estimators import DecayedRate

EDGES = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95, 0.99)  # bucket b holds c in [EDGES[b-1], EDGES[b])


class ConfidenceAcceptance:
    """P(draft accepted | its drafter probability c, the drafts before it accepted), learned online."""

    PRIOR_WEIGHT = 2.0
    FORGET = 0.995  # per judged draft: the estimates follow roughly the last 200 drafts

    def __init__(self) -> None:
        lows, highs = (0.0, *EDGES), (*EDGES, 1.0)
        self.buckets = [DecayedRate((low + high) / 2, self.PRIOR_WEIGHT) for low, high in zip(lows, highs, strict=True)]

    def __call__(self, c: float) -> float:
        return self.buckets[bisect_right(EDGES, c)].rate

    def update(self, confidences: Sequence[float], num_accepted: int) -> None:
        """A chain whose drafts had these confidences; the first `num_accepted` were accepted, the
        next (if any) rejected, the rest never judged."""
        judged = confidences[: num_accepted + 1]
        for i, c in enumerate(judged):
            for bucket in self.buckets:  # one clock for every bucket: a judged draft ages them all
                bucket.decay(self.FORGET)
            self.buckets[bisect_right(EDGES, c)].add(float(i < num_accepted), 1.0)


class PositionAcceptance:
    """P(draft j accepted | the drafts before it were), per position j of a chain, learned online from the judged
    drafts of chains (what sizes a chain drafted before any of its confidences is read: `ConfidenceStop.planned_length`).
    A position's prior is the rate of the position before it (the first's, a half), worth `PRIOR_WEIGHT` judged
    drafts: a position no chain has reached yet is taken as likely as the last one reached, so that chains accepted
    whole grow by more than one draft a step."""

    FIRST_PRIOR, PRIOR_WEIGHT = 0.5, 2.0
    FORGET = 0.8  # per judged chain: the estimates follow roughly the last five (a stretch of code, then prose)

    def __init__(self, positions: int) -> None:
        self.accepted, self.judged = [0.0] * positions, [0.0] * positions

    def rates(self, count: int) -> list[float]:
        """The first `count` positions' rates (a position past those learned: the last one's)."""
        rates, prior = [], self.FIRST_PRIOR
        for j in range(count):
            at = min(j, len(self.judged) - 1)
            prior = (self.accepted[at] + self.PRIOR_WEIGHT * prior) / (self.judged[at] + self.PRIOR_WEIGHT)
            rates.append(prior)
        return rates

    def update(self, kept: int, num_accepted: int) -> None:
        """A chain of `kept` judged drafts, its first `num_accepted` accepted, the next (if any) rejected."""
        self.accepted = [a * self.FORGET for a in self.accepted]
        self.judged = [n * self.FORGET for n in self.judged]
        for j in range(min(kept, num_accepted + 1, len(self.judged))):
            self.accepted[j] += float(j < num_accepted)
            self.judged[j] += 1.0


POSITIONS = 32  # a chain's positions learned apart: a chain drafts at most 31 (gamma's bound)


@dataclass
class PairRecord:
    """What a drafter learns drafting for a target in one decoding kind, kept across its generations."""

    odds: ConfidenceAcceptance = field(default_factory=ConfidenceAcceptance)
    chains: ChainRecord = field(default_factory=ChainRecord)
    # What sizes a chain judged only once drafted (`ConfidenceStop.planned_length`).
    positions: PositionAcceptance = field(default_factory=lambda: PositionAcceptance(POSITIONS))


_LEARNED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # drafter -> target -> greedy -> its record


def pair_record(drafter, target, greedy: bool) -> PairRecord:
    """What `drafter` has learned drafting for `target` (greedy or sampled) in this process so far, shared by every
    generation of the pair (forgotten with either model)."""
    by_target = _LEARNED.setdefault(drafter, weakref.WeakKeyDictionary())
    return by_target.setdefault(target, {}).setdefault(greedy, PairRecord())


def use_pair_records(store: weakref.WeakKeyDictionary) -> weakref.WeakKeyDictionary:
    """What pairs learn kept in `store` (drafter -> target -> greedy -> `PairRecord`) from now on -> the store kept
    until now (a benchmark gives each method its own: `benchmarks/learned.py`, `learned_apart`)."""
    global _LEARNED
    previous, _LEARNED = _LEARNED, store
    return previous


def forget_pair_records() -> None:
    """Every pair's learning back to the prior: the next generations draft as a process's first ones do (to compare
    two runs under the same conditions)."""
    _LEARNED.clear()


class ConfidenceStop:
    """The per-token stopping rule of an adaptive model drafter (one instance per generation).

    It reads the step's prices through its `CostAwarePolicy` only: `cost(k, rows)`, a step with k drafts
    per row, drafter passes included; `verify_cost(k, rows)`, the target's pass over 1 + k tokens alone
    (what keeping a drafted token costs); `max_budget`, the longest chain. `rows`: the rows drafting
    (and verified) together this step. `on_discard()`: called when a chain was
    drafted and none of it kept (its passes bought nothing: the policy counts it as a rejected draft,
    or it would go on starting chains that never reach the target and never teach it their acceptance).
    `observe_step` tells it a step's outcome: its odds learn the judged drafts, its `ChainRecord` the step's yield.
    """

    def __init__(self, policy: CostAwarePolicy, record: PairRecord | None = None) -> None:
        self.policy = policy
        # What it reads and moves: a pair's, shared across its generations (`pair_record`), or its own.
        record = PairRecord() if record is None else record
        self.acceptance, self.chains, self.positions = record.odds, record.chains, record.positions

    def on_discard(self) -> None:
        self.policy.discard()

    def reaches(self, confidences: Sequence[float]) -> list[float]:
        """P(draft j and every draft before it accepted), for each draft of a chain."""
        reaches, survive = [], 1.0
        for c in confidences:
            survive *= self.acceptance(c)
            reaches.append(survive)
        return reaches

    def keep_drafting(self, confidences: Sequence[float], rows: int) -> bool:
        """Whether one more draft (and a drafter pass for it) can raise the rate (1 + E) / cost,
        supposing the drafts to come as likely to be accepted as the last one."""
        j = len(confidences)
        if j >= self.policy.max_budget:
            return False
        reaches = self.reaches(confidences)
        expected = 1.0 + sum(reaches)
        now = max((1.0 + sum(reaches[:k])) / self.policy.cost(k, rows) for k in range(j + 1))
        a, reach = self.acceptance(confidences[-1]), reaches[-1]
        for k in range(j + 1, self.policy.max_budget + 1):  # a cost table can be flat after a step: look past it
            reach *= a
            expected += reach
            if expected / self.policy.cost(k, rows) > now:
                return True
        return False

    def planned_length(self, rows: int) -> int:
        """How many drafts a chain gets where none of its confidences is read until it is drafted (on a device): the
        length that maximises its expected tokens per unit of cost, drafter passes included, by the pair's recent
        acceptance at each position; at least one (the policy chose to start a chain)."""
        rates = self.positions.rates(self.policy.max_budget)
        return max(1, best_draft_length(rates, functools.partial(self.policy.cost, rows=rows)))

    def observe_step(self, confidences: Sequence[Sequence[float]], kept: Sequence[int], accepted: Sequence[int]) -> None:
        """A step that started chains: each row's drafts' `confidences` (all it drafted), how many the stop `kept`
        and the target `accepted`. The odds learn the judged drafts; the record, the step's tokens against what plain
        steps would have given in its cost (its drafter passes, priced by the policy, and its verification)."""
        rows = len(confidences)
        for c, k, n in zip(confidences, kept, accepted, strict=True):
            if k:
                self.acceptance.update(c[:k], n)
                self.positions.update(k, n)
        drafted = max(map(len, confidences))
        cost = (self.policy.verify_cost(max(kept), rows)
                + self.policy.cost(drafted, rows) - self.policy.verify_cost(drafted, rows))
        self.chains.add(sum(accepted) + rows, rows * cost / self.policy.cost(0, rows))

    def keep(self, confidences: Sequence[float], rows: int) -> int:
        """How many of the drafted tokens to send to the target: they are drafted already, so only
        the verification pass's cost decides."""
        return best_tree_size(self.reaches(confidences), functools.partial(self.policy.verify_cost, rows=rows))
