"""How many tokens to draft: the one cost-aware rule both drafters follow (chains and trees).

A step that drafts k tokens costs `cost(k)` (in one-token target passes: the verification pass over
1 + k tokens, plus the drafter's own passes) and yields 1 + E_k tokens, where E_k is the expected
number of accepted drafts. Draft j is accepted only if every draft before it was, so with
a_i = P(draft i accepted | drafts before it accepted), E_k = sum_{j <= k} prod_{i <= j} a_i.
The best k maximises tokens per unit of cost; k = 0 is a plain step, so a drafter that cannot pay
drafts nothing and generation runs at plain-decoding speed (the vLLM dynamic-speculation and
llama.cpp rule, here with costs measured on the machine in use: `utils/cost_model.py`).
"""

from __future__ import annotations

import functools
import numbers
from collections.abc import Callable, Sequence
from typing import Protocol

from sampling.policy.estimators import DecayedRate
from utils.cost_model import PassCosts

MAX_ADAPTIVE_GAMMA = 16  # with adaptive_gamma, each step drafts 0 .. max(gamma, this) tokens


def best_tree_size(reaches: Sequence[float], cost: Callable[[int], float]) -> int:
    """The number of nodes n maximising (1 + E_n) / cost(n), for n in [0, len(reaches)], where
    `reaches` are the nodes' probabilities of being accepted (of their whole path being accepted),
    in the order they would be added, and E_n the sum of the first n: the expected accepted drafts."""
    best_n, best_rate = 0, 1.0 / cost(0)
    expected = 0.0
    for n, reach in enumerate(reaches, start=1):
        expected += reach
        rate = (1.0 + expected) / cost(n)
        if rate > best_rate:
            best_n, best_rate = n, rate
    return best_n


def best_draft_length(estimates: Sequence[float], cost: Callable[[int], float]) -> int:
    """The chain length k maximising (1 + E_k) / cost(k), for k in [0, len(estimates)]: a chain's
    draft j is reached with probability prod_{i <= j} a_i."""
    reaches, survive = [], 1.0
    for a in estimates:
        survive *= a
        reaches.append(survive)
    return best_tree_size(reaches, cost)


class DraftPolicy(Protocol):
    """How many nodes the loop lets each row draft in a step (`sampling.loop.speculative_loop.speculative_loop`):
    all the loop reads, and all your own policy needs (`speculative_generate(..., draft_policy=...)`).

    `budget(num_rows)` is asked once per step, before drafting, with the number of rows verified
    together in that step's pass -> the step's budget, `max_drafts` nodes per row (0: a plain step).
    `update` is told each row's outcome: `num_drafts` nodes drafted, `num_accepted` of them accepted."""

    def budget(self, num_rows: int) -> int: ...

    def update(self, num_drafts: int, num_accepted: int) -> None: ...


class CostAwarePolicy(DraftPolicy, Protocol):
    """A `DraftPolicy` that prices steps: what the drafters that size their drafts by cost read
    (the confidence stop, `sampling/policy/draft_confidence.py`; the tree planner, `sampling/policy/tree_choice.py`,
    and the model's trees, `sampling/drafters/model_tree.py`; the hybrid, `sampling/drafters/hybrid.py`), each
    through these members only. Costs are in one-token target passes, for a step verifying `rows` rows
    together (a pure function of its arguments and what the policy has learned)."""

    max_budget: int  # the most nodes per row `budget` ever gives
    target_costs: PassCosts  # the target's measured passes (the tree planner prices drafter passes against them)

    @property
    def acceptance_rate(self) -> float:
        """P(a drafted token accepted | the drafts before it were), learned online."""

    def cost(self, k: int, rows: int) -> float:
        """A step with k drafts per row, the drafter's passes included."""

    def verify_cost(self, k: int, rows: int) -> float:
        """The target's pass over 1 + k tokens per row alone."""

    def discard(self) -> None:
        """A chain was drafted and none of it kept: count it as a rejected draft."""


def check_policy(policy: object) -> None:
    """A TypeError naming every missing part, unless `policy` has the `DraftPolicy` protocol."""
    missing = [f"{name}()" for name in ("budget", "update") if not callable(getattr(policy, name, None))]
    if missing:
        raise TypeError(f"draft_policy must be an object with the DraftPolicy protocol (sampling.policy.draft_policy."
                        f"DraftPolicy: budget(num_rows), update(num_drafts, num_accepted)) or None; "
                        f"{type(policy).__name__} lacks {', '.join(missing)}")


def budget_of(policy: DraftPolicy, num_rows: int) -> int:
    """`policy.budget(num_rows)`, checked: a policy of your own that answers anything but an int >= 0
    gets a TypeError naming it, not a failure deep inside a drafter."""
    budget = policy.budget(num_rows)
    if isinstance(budget, bool) or not isinstance(budget, numbers.Integral) or budget < 0:
        raise TypeError(f"draft_policy.budget({num_rows}) must return an int >= 0 (nodes per row), "
                        f"got {budget!r} from {type(policy).__name__}")
    return int(budget)


class DraftLength:
    """A fixed draft length: `gamma` nodes every step (the user asked for it, or a drafter that
    sizes its own drafts is given this cap: an n-gram pool, a hybrid, your own `Drafter`)."""

    def __init__(self, gamma: int) -> None:
        self.gamma = gamma

    def budget(self, num_rows: int) -> int:
        return self.gamma

    def update(self, num_drafts: int, num_accepted: int) -> None:
        pass


class ChainRecord:
    """Whether starting a chain pays, measured on the chains a pair started (each step whole: the drafter's passes,
    the tokens the stop kept, what the target accepted): their tokens against `plain`, the tokens plain steps would
    have given in the same cost, both decayed by `FORGET` per step. None until `WARMUP` chains were measured: a chain
    whose first draft is doubtful costs one drafter pass (the stop ends it there), so finding out is cheap."""

    WARMUP = 3
    FORGET = 0.8  # per chain step: the record follows roughly its last five (a prompt that stops paying is seen soon)

    def __init__(self) -> None:
        self.tokens = self.plain = 0.0
        self.chains = 0

    def add(self, tokens: float, plain: float) -> None:
        """A step that started chains gave `tokens` (all rows) where plain steps would have given `plain`."""
        self.tokens = self.tokens * self.FORGET + tokens
        self.plain = self.plain * self.FORGET + plain
        self.chains += 1

    def pays(self) -> bool | None:
        """Whether the chains measured gave more tokens than plain steps would have (None: too few measured yet)."""
        return None if self.chains < self.WARMUP else self.tokens > self.plain


class CostAwareDraftLength:
    """A model drafter's draft length, chosen each step by `best_draft_length` (with a per-token stop and a
    `ChainRecord`: whether to start a chain, which the stop then sizes, by the record).

    The acceptance rate of the drafter's tokens is learned online (a running count that
    forgets old steps, from a weak prior), so it follows the text and the sampling mode it runs in;
    the cost of k drafts is the target's measured pass over 1 + k tokens plus k times what a drafted
    token really costs, in one-token target passes: `draft_seconds()` (the drafter's timed
    drafting steps, catch-up pass included), or before any was timed the drafter's measured pass; where
    either model's pass is unmeasured (a calibration too noisy to keep), `prior_share()`: the drafter's share of
    the weight bytes a pass reads (`model_info.pass_bytes`). Priced at a whole target pass there, no chain could
    pay, so such a drafter never drafted and was never timed.
    After `probe_after` plain steps in a row one token is drafted anyway, so that a drafter that
    became useful again is noticed, but only if drafting could pay at all (at an acceptance rate of
    0.99 under the measured costs: a drafter too dear to pay even then is never probed), only if it
    has drafted in this generation (a cold drafter's first draft costs a pass over the whole prompt;
    with the per-token stop, one cold probe per generation is allowed),
    and every probe that is not followed by drafting doubles the wait (up to `MAX_PROBE_AFTER`): a
    probe costs a catch-up pass over every token the drafter missed.

    With the per-token stop (`sampling.policy.draft_confidence`) the single rate prices a chain badly: the
    stop ends a doubtful chain after one drafter pass and lets a sure one run long, so the rate's k = 1 chain
    is neither. There, given `chains` (the pair's `ChainRecord`), a chain starts while the chains measured gave
    more tokens than plain steps would have in their cost, and until a few were measured, wherever drafting
    could pay at all; a probe then starts a chain, not one token.
    """

    PRIOR_RATE, PRIOR_WEIGHT = 0.6, 2.0
    FORGET = 0.97  # per judged draft: the estimate follows roughly the last 30 drafts
    PROBE_AFTER, MAX_PROBE_AFTER = 16, 256

    def __init__(self, max_budget: int, target_costs: PassCosts, drafter_costs: PassCosts | None,
                 draft_seconds: Callable[[], float | None] = lambda: None,
                 warm: Callable[[], bool] = lambda: True, per_token_stop: bool = False,
                 chains: ChainRecord | None = None, prior_share: Callable[[], float] = lambda: 1.0) -> None:
        self.max_budget = max_budget
        self._prior_share = prior_share
        self.per_token_stop = per_token_stop
        self.chains = chains if per_token_stop else None  # what started chains gave (None: the single rate decides)
        # One probe before the drafter has drafted in this generation: without it a prior that says
        # "does not pay" is never tested, and a drafter that would pay is never found out (measured:
        # docs/results.md, "Figures behind the code's rules"). The confidence stop makes it cheap: a
        # doubtful first draft costs one drafter pass and is not verified.
        self.cold_probe = per_token_stop
        self.target_costs = target_costs
        self.drafter_costs = drafter_costs
        self.draft_seconds = draft_seconds
        self.warm = warm  # whether the drafter has drafted in this generation (its cache holds the prompt)
        self.acceptance = DecayedRate(self.PRIOR_RATE, self.PRIOR_WEIGHT)
        self.plain_steps = 0
        self.probe_after = self.PROBE_AFTER

    @property
    def acceptance_rate(self) -> float:
        """The drafter's tokens accepted / judged, learned online (not the `alpha` a generation returns)."""
        return self.acceptance.rate

    @functools.cached_property
    def prior_share(self) -> float:
        """A drafted token in target passes until both passes are timed (asked where needed only: it reads every
        weight's size)."""
        return self._prior_share()

    def drafter_step_cost(self) -> float:
        """One drafted token in units of one target pass: as timed, else `prior_share` (the drafter's share of the
        bytes a pass reads, where the caller knows both models: a pass costs its weights' reading)."""
        target = self.target_costs.seconds(0)
        drafter = self.draft_seconds() or (self.drafter_costs.seconds(0) if self.drafter_costs is not None else None)
        if not drafter and self.drafter_costs is None:
            return 0.0  # a drafter without a model (your own): free until its drafting is timed
        return drafter / target if target and drafter else self.prior_share

    def verify_cost(self, k: int, rows: int) -> float:
        """The verification pass over 1 + k tokens per row (`rows` rows), in one-token target passes."""
        return self.cost(k, rows) - k * self.drafter_step_cost()

    def cost(self, k: int, rows: int) -> float:
        """A step with k drafts per row over `rows` rows, drafter passes included, in one-token target passes."""
        if rows == 1:
            return self.target_costs(k) + k * self.drafter_step_cost()
        plain = self.target_costs(rows - 1)  # a batch: its pass as timed, relative to a plain one
        return plain * self.target_costs.batch_ratio(rows, 1 + k) + k * self.drafter_step_cost()

    def budget(self, num_rows: int) -> int:
        """This step's draft length for `num_rows` rows verified together (0: a plain step)."""
        cost = functools.partial(self.cost, rows=num_rows)
        def could_pay() -> bool:  # at an acceptance of 0.99 (asked only where it decides)
            return best_draft_length([0.99] * self.max_budget, cost) > 0

        if self.chains is not None:
            k = self.max_budget if self.chains.pays() is not False and could_pay() else 0
        else:
            k = best_draft_length([min(self.acceptance_rate, 0.99)] * self.max_budget, cost)
        if k == 0 and self.plain_steps >= self.probe_after and (self.warm() or self.cold_probe) and could_pay():
            self.probe_after = min(2 * self.probe_after, self.MAX_PROBE_AFTER)
            self.cold_probe = False
            return self.max_budget if self.chains is not None else 1
        if k:
            self.probe_after = self.PROBE_AFTER
        # With a per-token stop the drafter's confidence sizes the chain: the policy only decides whether to start one.
        return self.max_budget if k and self.per_token_stop else k

    def discard(self) -> None:
        """A chain was drafted and the per-token stop kept none of it: its passes were paid for
        nothing, as for a rejected draft (the step itself is counted by `update` as a plain one)."""
        self.acceptance.decay(self.FORGET)
        self.acceptance.add(0.0, 1.0)

    def update(self, num_drafts: int, num_accepted: int) -> None:
        if num_drafts == 0:
            self.plain_steps += 1
            return
        self.plain_steps = 0
        judged = min(num_accepted + 1, num_drafts)  # drafts after the first rejection were not judged
        for _ in range(judged):
            self.acceptance.decay(self.FORGET)
        self.acceptance.add(num_accepted, judged)
