"""Tree or chain: the shape a drafter model's step takes (`sampling/drafters/model_tree.py` drafts it).

Two checks, both needed for a tree to run:

1. **The planner** (`TreePlanner`, before drafting): the expected accepted tokens per unit of cost of
   the best tree a per-rank acceptance model allows against the best chain's, under the measured
   costs. A tree of depth d costs d + 1 drafter passes (the root's, then one per depth over the
   paths to the nodes it expands), each priced at the drafter's measured seconds for its width
   (`PassCosts`), times the measured ratio of a tree's drafting time to its passes' (the per-node
   work around them); then the target's pass over its 1 + n nodes. The chain costs what the chain
   drafter's steps were timed at (`CostAwareDraftLength.cost`: its cascade, several drafts from one
   pass, included). A tree is proposed only when it is expected to beat the chain by `TREE_MARGIN`.
2. **The record** (`ShapeRecord`, online): on the steps where the planner proposes a tree, the
   tokens per second that trees and chains gave when they ran there (each step timed whole, from
   drafting to the drafter's update, accepted tokens counted). Chains run first; a tree runs once
   in `EXPLORE_EVERY` steps until trees and chains have `WARMUP` steps each and trees have measured
   `TREE_MARGIN` better, and on most steps from then on; one step in `EXPLORE_EVERY` runs the other
   shape, so that a change is noticed. Where trees do not pay they cost at most that share of the
   steps (measured on HumanEval on the Xeon: trees first, as the cost model proposed them, made 0.84x
   of chains). One record per (drafter, target) pair and mode, kept
   across calls: a generation of 64 tokens is a few steps.

Either way only the shape of the drafts changes: each is verified by its own exact rule, and the
choice reads the past only (timings, judged drafts), never the step's own draws.
"""

from __future__ import annotations

import functools
import heapq
import time
import weakref

from sampling.policy.draft_confidence import ConfidenceAcceptance
from sampling.policy.draft_policy import CostAwarePolicy, best_draft_length
from sampling.policy.estimators import RunningAverage
from utils.cost_model import PassCosts

AUTO_BRANCHING = 3  # branching=None with adaptive_gamma: up to this many children per node, where trees pay
# Prior P(a child is accepted | its parent was reached) by its rank among its siblings (first,
# second, third and later), worth RANK_PRIOR_WEIGHT judged children; learned online from there.
RANK_PRIOR = (0.6, 0.12, 0.06)
RANK_PRIOR_WEIGHT = 2.0
RANK_FORGET = 0.99  # per judged child: the rates follow roughly the last 100
TREE_MARGIN = 0.05  # a tree must be expected (planner) and measured (record) this much better than a chain
OVERHEAD_WEIGHT = 0.2  # weight of one tree's drafting time in the ratio to its passes' priced seconds

clock = time.perf_counter  # the record's clock (a test sets its own)


def tree_branching(branching: int | None, costs_cut: bool) -> int:
    """The most children per node a drafter's tree may have: `branching`, or with None `AUTO_BRANCHING` where the
    cost model cuts the trees to what pays (`costs_cut`: a drafter model's `adaptive_gamma`, NASD's
    `stop_if_unknown`) and 1 (a chain) where nothing cuts them."""
    if branching is None:
        return AUTO_BRANCHING if costs_cut else 1
    return branching


class TreeAcceptance:
    """P(a child is accepted | its parent was reached), learned from every judged child: by rank
    (`rate`: the planner's positional model) and by rank and score factor (`__call__`: the reaches
    of a drafted tree's nodes)."""

    def __init__(self) -> None:
        self.by_confidence = [ConfidenceAcceptance() for _ in RANK_PRIOR]
        self.accepted = [a * RANK_PRIOR_WEIGHT for a in RANK_PRIOR]
        self.judged = [RANK_PRIOR_WEIGHT] * len(RANK_PRIOR)

    def rate(self, rank: int) -> float:
        r = min(rank, len(RANK_PRIOR) - 1)
        return self.accepted[r] / self.judged[r]

    def __call__(self, rank: int, factor: float) -> float:
        return self.by_confidence[min(rank, len(RANK_PRIOR) - 1)](factor)

    def observe(self, rank: int, accepted: bool, factor: float | None = None) -> None:
        """A child of a reached node was judged (`factor` None: a chain's draft, its rate only)."""
        r = min(rank, len(RANK_PRIOR) - 1)
        self.accepted[r] = self.accepted[r] * RANK_FORGET + accepted
        self.judged[r] = self.judged[r] * RANK_FORGET + 1.0
        if factor is not None:
            self.by_confidence[r].update([factor], int(accepted))


def positional_tree(acceptance: TreeAcceptance, branching: int,
                    max_nodes: int) -> tuple[list[tuple[int, int, int]], list[float]]:
    """The best tree of at most `max_nodes` nodes under the positional model (a child of rank r is accepted with
    `acceptance.rate(r)` once its parent is), nodes added best-first by reach, each with up to `branching`
    children -> ([(parent, depth, rank)] in the order added, their reaches)."""
    rates = [acceptance.rate(r) for r in range(branching)]
    heap = [(-rates[r], r, -1, r, 1) for r in range(branching)]
    nodes, reaches, order = [], [], branching
    while heap and len(nodes) < max_nodes:
        neg_reach, _, parent, rank, depth = heapq.heappop(heap)
        nodes.append((parent, depth, rank))
        reaches.append(-neg_reach)
        for r in range(branching):
            heapq.heappush(heap, (neg_reach * rates[r], order, len(nodes) - 1, r, depth + 1))
            order += 1
    return nodes, reaches


class TreePlanner:
    """Each step's node budget for a tree (0: draft a chain), from the measured costs (module
    docstring, point 1). The positional model: a child of rank r is accepted with
    `acceptance.rate(r)` once its parent is; the best tree of n nodes adds them best-first by
    reach. Costs are in one-token target passes; the chain's is `policy.cost(k, rows)` with the same
    first-rank rate."""

    def __init__(self, policy: CostAwarePolicy, drafter_costs: PassCosts, branching: int,
                 acceptance: TreeAcceptance) -> None:
        self.policy, self.drafter_costs, self.branching, self.acceptance = policy, drafter_costs, branching, acceptance
        self.overhead = RunningAverage(OVERHEAD_WEIGHT)  # a tree's timed drafting / its passes' priced seconds
        self.paths = False  # whether each depth's pass feeds whole paths (trees grown on the device)

    def shape(self, max_nodes: int) -> tuple[list[tuple[int, int, int]], list[float]]:
        """The positional model's best tree of at most `max_nodes` nodes (`positional_tree`)."""
        return positional_tree(self.acceptance, self.branching, max_nodes)

    def pass_seconds(self, tokens: int, rows: int) -> float | None:
        """The drafter's measured seconds for a pass feeding `tokens` tokens to each of `rows` rows
        None before anything was timed."""
        costs = self.drafter_costs
        base = costs.seconds(0)
        if base is None:
            return None
        if rows == 1:
            return base * costs(tokens - 1)
        return base * costs(rows - 1) * costs.batch_ratio(rows, tokens)

    def drafter_pass(self, tokens: int, rows: int) -> float:
        """That pass in one-token target passes, the per-node work around it included (as timed);
        before anything was timed, its relative cost times the policy's `prior_share` (the drafter's share of the
        bytes a pass reads)."""
        seconds, target = self.pass_seconds(tokens, rows), self.policy.target_costs.seconds(0)
        if seconds is None or not target:
            return self.drafter_costs(tokens - 1) * self.policy.prior_share
        return seconds / target * (self.overhead.value or 1.0)

    def observe_drafting(self, seconds: float, passes: list[int], rows: int) -> None:
        """A tree's drafting took `seconds` over passes whose widest blocks had `passes` tokens."""
        priced = [self.pass_seconds(tokens, rows) for tokens in passes]
        if passes and None not in priced and sum(priced) > 0:
            self.overhead.add(seconds / sum(priced))

    def drafting_costs(self, nodes: list[tuple[int, int, int]], rows: int = 1) -> list[float]:
        """The drafter's passes for each prefix of these nodes (in the order added), in one-token
        target passes: the root's pass, and per depth a pass over the root and the paths to that
        depth's expanded nodes: their union where the host grows the tree, each path whole where the
        device does (`paths`, `sampling/drafters/device_tree.py`)."""
        fed: dict[int, set[int]] = {}  # a depth -> the nodes its pass feeds after the root (`paths`: it expands)
        costs, root = [], self.drafter_pass(1, rows)
        for parent, _, _ in nodes:
            block = fed.setdefault(nodes[parent][1], set()) if parent >= 0 else set()
            while parent >= 0 and parent not in block:  # the parent is expanded: its pass feeds the path to it
                block.add(parent)
                parent = -1 if self.paths else nodes[parent][0]
            widths = [1 + (depth * len(block) if self.paths else len(block)) for depth, block in fed.items()]
            costs.append(root + sum(self.drafter_pass(width, rows) for width in widths))
        return costs

    def rates(self, max_drafts: int, rows: int = 1) -> tuple[float, int, float]:
        """(The best chain's expected tokens per unit of cost, the best branched tree's node count, its rate)."""
        top = self.acceptance.rate(0)
        k = best_draft_length([min(top, 0.99)] * max_drafts, functools.partial(self.policy.cost, rows=rows))
        chain_rate = (1.0 + sum(top ** j for j in range(1, k + 1))) / self.policy.cost(k, rows)
        nodes, reaches = self.shape(max_drafts)
        best, best_rate, branched, expected = 0, 0.0, False, 1.0
        for n, drafting in enumerate(self.drafting_costs(nodes, rows), start=1):
            branched = branched or nodes[n - 1][2] > 0
            expected += reaches[n - 1]
            rate = expected / (self.policy.verify_cost(n, rows) + drafting)
            if branched and rate > best_rate:
                best, best_rate = n, rate
        return chain_rate, best, best_rate

    def budget(self, max_drafts: int, rows: int = 1) -> int:
        """The tree's node budget this step (the loop's `max_drafts` at most), 0 for a chain: a tree
        only where it is expected to beat the best chain by `TREE_MARGIN`."""
        if max_drafts < 2 or self.branching < 2:
            return 0
        chain_rate, best, best_rate = self.rates(max_drafts, rows)
        return best if best_rate > chain_rate * (1.0 + TREE_MARGIN) else 0


class ShapeRecord:
    """Tokens per second measured for trees and for chains on the steps where the planner proposed
    a tree (module docstring, point 2): each shape's accepted tokens and seconds, decayed by
    `FORGET` per step of that shape, so that the rates follow the recent steps."""

    WARMUP = 3  # steps of each shape before the rates are compared (chains first: trees must earn their place)
    EXPLORE_EVERY = 32  # one step of the other shape in this many (trees, while they have not paid)
    FORGET = 0.9  # per step of a shape: its rate follows roughly its last 10 steps

    def __init__(self) -> None:
        self.tokens = {True: 0.0, False: 0.0}  # tree? -> decayed tokens
        self.seconds = {True: 0.0, False: 0.0}
        self.steps = {True: 0, False: 0}
        self.since_explored = 0
        self._started: tuple[bool, float] | None = None  # the timed step: (tree?, its start)

    def rate(self, tree: bool) -> float | None:
        """Measured tokens per second of that shape (None before any step of it)."""
        return self.tokens[tree] / self.seconds[tree] if self.seconds[tree] > 0 else None

    def trees_pay(self) -> bool:
        """Whether trees measured `TREE_MARGIN` better than chains, each over `WARMUP` steps at least."""
        if min(self.steps.values()) < self.WARMUP:
            return False
        tree, chain = self.rate(True), self.rate(False)
        return tree is not None and chain is not None and tree > chain * (1.0 + TREE_MARGIN)

    def choose(self) -> bool:
        """The planner proposes a tree this step: whether to draft it. Chains until trees have measured
        better: a tree runs once in `EXPLORE_EVERY` steps until then (at most that share of the steps is
        lost where trees do not pay), and on most steps after."""
        if self.steps[False] < self.WARMUP:
            return False
        self.since_explored += 1
        winner = self.trees_pay()
        if self.since_explored >= self.EXPLORE_EVERY:
            self.since_explored = 0
            return not winner
        return winner

    def begin(self, tree: bool) -> None:
        """A step of this shape starts now (timed until `end`)."""
        self._started = (tree, clock())

    def end(self, tokens: int) -> None:
        """The timed step gave `tokens` tokens (its accepted drafts and the target's own, all rows)."""
        if self._started is None:
            return
        tree, start = self._started
        self._started = None
        self.tokens[tree] = self.tokens[tree] * self.FORGET + tokens
        self.seconds[tree] = self.seconds[tree] * self.FORGET + max(clock() - start, 0.0)
        self.steps[tree] += 1


_RECORDS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # drafter -> target -> mode -> ShapeRecord


def use_shape_records(store: weakref.WeakKeyDictionary) -> weakref.WeakKeyDictionary:
    """The pairs' `ShapeRecord`s kept in `store` from now on -> the store kept until now (`use_pair_records`'s twin)."""
    global _RECORDS
    previous, _RECORDS = _RECORDS, store
    return previous


def shape_record(drafter, target, mode: tuple) -> ShapeRecord:
    """The record of this (drafter, target) pair in `mode` (what changes a step's rate: the
    sampling rule, the batch), shared by every call with them; it lives as long as the models."""
    by_target = _RECORDS.setdefault(drafter, weakref.WeakKeyDictionary())
    return by_target.setdefault(target, {}).setdefault(mode, ShapeRecord())
