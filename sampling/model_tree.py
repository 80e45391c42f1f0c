"""Token trees drafted by the drafter model (`speculative_generate(..., branching=)`).

EAGLE-2's dynamic tree (Li et al. 2024) with SpecInfer's one-pass tree verification (Miao et al.
2024): every node's score is the product of the drafter's confidences along its path (its
cumulative confidence, which approximates the chance that the whole path is accepted); each step
the drafter runs one pass per depth over the frontier's most promising candidates (up to
`branching` of them, each given up to `branching` children), the candidates are reranked and the
best `budget` kept (a prefix of the ranking is a tree: a child never outranks its parent), and the
target verifies the whole tree in one pass with the tree mask.

- **Greedy**: children are the drafter's top-k; the target walks the argmax path: the output is
  greedy decoding's, token for token.
- **Sampling** (the standard rule): children are drawn from q without replacement and verified by
  recursive rejection sampling (`sampling/tree_sampling.py`, Jeon et al. 2024). For that rule to
  keep the target's law, whether a child is in the tree must not depend on its own value nor on its
  later siblings': so in sampling a child's score factor is the rank-th largest probability of q
  (known before it is drawn), not q of the drawn token, and the tree is cut only to the budget
  chosen before drafting (a cost cut after drafting would look at the drawn values).
- **Drafter-invariant sampling** (`drafter_invariant`, the default with `adaptive_gamma`): the first
  child is the chain's coupled draft (the inverse CDF of q at the target's own number of that
  position), the others the next most likely tokens; the coupled rule verifies them, and the output
  is plain seeded sampling's.

The drafter's runner takes the tree through the `Runner` protocol only: after the root's pass (what
the cache has not seen, a chain) each depth's pass rolls the row back to its accepted tokens less
the last one and feeds that token with the candidates on the paths to the nodes it expands (a tree
block, `forward_rows` with parents): a node must see its own ancestors and no other branch, and the
protocol's cache shows a new block everything it holds. After verification `keep_path_row` keeps
the accepted nodes the last block holds.

Shape and size (`TreePlanner`, with `adaptive_gamma`): the expected accepted tokens of the best
tree a per-rank acceptance model allows, against the measured costs (the target's pass over 1 + n
tokens, `PassCosts`, and the drafter's passes over each depth's block), compared with the best chain
under the same model: a tree where it is expected to give more tokens per unit of cost, else a
chain step by the chain drafter (its cascade and per-token stop included), never slower. A fixed
gamma with `branching` >= 2: a tree of `gamma` nodes every step, no cost cut.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch
from torch import Tensor

from sampling.draft_confidence import ConfidenceAcceptance
from sampling.draft_policy import CostAwarePolicy, best_draft_length, best_tree_size
from sampling.drafters import DraftTree, ModelDrafter
from sampling.randomness import DRAFT
from sampling.tree_sampling import step_generator
from utils.cost_model import PassCosts
from utils.logits_processors import inverse_cdf

AUTO_BRANCHING = 3  # branching=None with adaptive_gamma: up to this many children per node, where trees pay
# Prior P(a child is accepted | its parent was reached) by its rank among its siblings (first,
# second, third and later), worth RANK_PRIOR_WEIGHT judged children; learned online from there.
RANK_PRIOR = (0.6, 0.12, 0.06)
RANK_PRIOR_WEIGHT = 2.0
RANK_FORGET = 0.99  # per judged child: the rates follow roughly the last 100


def tree_branching(branching: int | None, adaptive_gamma: bool) -> int:
    """The most children per node a drafter model's tree may have: `branching`, or with None
    `AUTO_BRANCHING` where the cost model chooses (adaptive_gamma) and 1 (a chain of `gamma`) with
    a fixed gamma."""
    if branching is None:
        return AUTO_BRANCHING if adaptive_gamma else 1
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


class TreePlanner:
    """Each step's node budget for a tree (0: draft a chain), from the measured costs.

    The positional model: a child of rank r is accepted with `acceptance.rate(r)` once its parent
    is; the best tree of n nodes adds them best-first by reach. A step of n nodes costs the
    target's pass over 1 + n tokens (`policy.verify_cost`) plus the drafter's passes: one over the
    root, then per depth one over the root and the paths to the nodes it expands (the drafter's
    `PassCosts`), in units of one-token target passes. The chain: `policy.cost(k)` with the same
    first-rank rate. A tree is drafted when its best rate beats the chain's best."""

    def __init__(self, policy: CostAwarePolicy, drafter_costs: PassCosts, branching: int,
                 acceptance: TreeAcceptance) -> None:
        self.policy, self.drafter_costs, self.branching, self.acceptance = policy, drafter_costs, branching, acceptance

    def shape(self, max_nodes: int) -> tuple[list[tuple[int, int, int]], list[float]]:
        """The positional model's best tree, nodes in the order added -> ([(parent, depth, rank)], reaches)."""
        rates = [self.acceptance.rate(r) for r in range(self.branching)]
        heap = [(-rates[r], r, -1, r, 1) for r in range(self.branching)]
        nodes, reaches, order = [], [], self.branching
        while heap and len(nodes) < max_nodes:
            neg_reach, _, parent, rank, depth = heapq.heappop(heap)
            nodes.append((parent, depth, rank))
            reaches.append(-neg_reach)
            for r in range(self.branching):
                heapq.heappush(heap, (neg_reach * rates[r], order, len(nodes) - 1, r, depth + 1))
                order += 1
        return nodes, reaches

    def drafting_costs(self, nodes: list[tuple[int, int, int]]) -> list[float]:
        """The drafter's passes for each prefix of these nodes (in the order added), in one-token
        target passes: the root's pass, and per depth a pass over the root and the paths to that
        depth's expanded nodes."""
        step = self.policy.drafter_step_cost()
        fed: dict[int, set[int]] = {}  # a depth -> the nodes its pass feeds after the root
        costs = []
        for parent, _, _ in nodes:
            if parent >= 0:  # the parent is expanded: its pass feeds the path to it
                block = fed.setdefault(nodes[parent][1], set())
                while parent >= 0 and parent not in block:
                    block.add(parent)
                    parent = nodes[parent][0]
            costs.append(step * (1.0 + sum(self.drafter_costs(len(block)) for block in fed.values())))
        return costs

    def budget(self, max_drafts: int) -> int:
        """The tree's node budget this step (the loop's `max_drafts` at most), 0 for a chain."""
        if max_drafts < 2 or self.branching < 2:
            return 0
        top = self.acceptance.rate(0)
        k = best_draft_length([min(top, 0.99)] * max_drafts, self.policy.cost)
        chain_rate = (1.0 + sum(top ** j for j in range(1, k + 1))) / self.policy.cost(k)
        nodes, reaches = self.shape(max_drafts)
        best, best_rate, branched, expected = 0, chain_rate, False, 1.0
        for n, drafting in enumerate(self.drafting_costs(nodes), start=1):
            branched = branched or nodes[n - 1][2] > 0
            expected += reaches[n - 1]
            rate = expected / (self.policy.verify_cost(n) + drafting)
            if branched and rate > best_rate:
                best, best_rate = n, rate
        return best


@dataclass
class Candidate:
    """A drafted token of a row's tree this step."""

    token: int
    parent: int  # the parent's candidate index, -1: the root (the row's last accepted token)
    depth: int  # 1 for the root's children
    rank: int  # among its siblings, in draw order
    factor: float  # q of it (greedy, coupled), or the rank-th largest probability of q (sampled)
    score: float  # the product of the factors on its path: the cumulative confidence


class RowTree:
    """The candidates one row drafted this step, and what its drafter's cache holds of them."""

    def __init__(self, sequence: list[int]) -> None:
        self.sequence = list(sequence)  # the accepted sequence when the step began
        self.candidates: list[Candidate] = []
        self.q: dict[int, Tensor] = {}  # sampled: candidate (-1 the root) -> the q its children were drawn from
        self.fed: list[int] = []  # the candidates in the cache after the root, in block order
        self.nodes: list[int] = []  # the verified tree's nodes (candidate indices, node order)

    def path(self, c: int) -> list[int]:
        tokens = []
        while c >= 0:
            tokens.append(self.candidates[c].token)
            c = self.candidates[c].parent
        return tokens[::-1]

    def ranked(self) -> list[int]:
        """Candidates best first; a parent before its children, siblings in draw order on ties."""
        return sorted(range(len(self.candidates)), key=lambda c: (-self.candidates[c].score, self.candidates[c].depth, c))

    def to_expand(self, depth: int, budget: int, width: int) -> list[int]:
        """The `width` best candidates at `depth` that leave room for a child in the top `budget`."""
        ranked = self.ranked()[: budget - 1]
        return [c for c in ranked if self.candidates[c].depth == depth][:width]

    def closure(self, picks: list[int]) -> list[int]:
        """The picks' ancestors (parents first), then the picks: a depth pass's block after the root."""
        ancestors: set[int] = set()
        for c in picks:
            c = self.candidates[c].parent
            while c >= 0 and c not in ancestors:
                ancestors.add(c)
                c = self.candidates[c].parent
        return sorted(ancestors) + list(picks)


class ModelTreeDrafter:
    """A `Drafter` that drafts token trees with a `ModelDrafter`'s model and runner (module
    docstring), and chain steps with the `ModelDrafter` itself where the planner says a tree does
    not pay. `planner` None: a tree of `max_drafts` nodes every step (a fixed gamma)."""

    def __init__(self, chain: ModelDrafter, branching: int, planner: TreePlanner | None,
                 acceptance: TreeAcceptance) -> None:
        assert branching >= 2 and chain.runner.supports_trees
        self.chain, self.branching, self.planner, self.acceptance = chain, branching, planner, acceptance
        self._trees: list[RowTree] = []  # this step's trees, one per row; empty on a chain step
        self._chain_lengths: list[int] = []
        self.tree_steps = 0  # steps drafted as trees (for reports)

    @property
    def forward_passes(self) -> int:
        return self.chain.forward_passes

    @property
    def cascade(self):
        return self.chain.cascade

    def counters(self) -> dict[str, float]:
        """The chain drafter's counters (its cascade's, the other tokenizer's): `Drafting.counters`."""
        return self.chain.counters()

    def start(self, sequences: list[list[int]]) -> None:
        self.chain.start(sequences)
        self._trees = []

    def draft(self, sequences, max_drafts, max_depths):
        budget = max_drafts if self.planner is None else self.planner.budget(max_drafts)
        if budget == 0 or not any(max_depths):
            self._trees = []
            drafts = self.chain.draft(sequences, max_drafts, max_depths)
            self._chain_lengths = [len(tree) for tree, _ in drafts]
            return drafts
        self.tree_steps += 1
        depths = [max(0, min(depth, budget)) for depth in max_depths]
        self._trees = self._grow(sequences, budget, depths)
        cut = self.planner is not None and self._deterministic
        return [self._tree(tree, budget, cut) for tree in self._trees]

    @property
    def _deterministic(self) -> bool:
        return self.chain.processor.is_greedy or self.chain.coupled

    def _grow(self, sequences: list[list[int]], budget: int, depths: list[int]) -> list[RowTree]:
        """Every row's candidates: the root's pass, then one pass per depth (all rows together)."""
        runner, trees = self.chain.runner, [RowTree(sequence) for sequence in sequences]
        sampled = not self._deterministic
        generators = [step_generator(self.chain.uniforms[b], len(s) - self.chain.uniforms[b].prefix_length, DRAFT)
                      if sampled and depths[b] else None for b, s in enumerate(sequences)]
        # 1. The root: each drafting row feeds what its cache has not seen (a chain).
        pending = [s[runner.row_length(b) :] if depths[b] else [] for b, s in enumerate(sequences)]
        logits = runner.forward_rows([(tokens, None) for tokens in pending], [int(bool(t)) for t in pending])
        for b, tokens in enumerate(pending):
            if tokens:
                self._expand(trees[b], b, -1, logits[b][-1], generators[b])
        # 2. One pass per depth over the frontier's best candidates, each row's block a tree.
        for depth in range(1, max(depths, default=0)):
            picks = [tree.to_expand(depth, budget, self.branching) if depth < depths[b] else []
                     for b, tree in enumerate(trees)]
            if not any(picks):
                break
            blocks = []
            for b, (tree, chosen) in enumerate(zip(trees, picks, strict=True)):
                if chosen:
                    tree.fed = tree.closure(chosen)
                    runner.rollback_row(b, len(tree.sequence) - 1)  # the root is fed again, with its tree
                    index = {c: 1 + j for j, c in enumerate(tree.fed)}
                    parents = [index[tree.candidates[c].parent] if tree.candidates[c].parent >= 0 else 0 for c in tree.fed]
                    blocks.append(([tree.sequence[-1]] + [tree.candidates[c].token for c in tree.fed], [-1, *parents]))
                else:
                    blocks.append(([], None))
            logits = runner.forward_rows(blocks, [len(chosen) for chosen in picks])
            for b, chosen in enumerate(picks):
                for j, c in enumerate(chosen):
                    self._expand(trees[b], b, c, logits[b][j], generators[b])
        return trees

    def _expand(self, tree: RowTree, b: int, parent: int, logits: Tensor, generator: torch.Generator | None) -> None:
        """Give candidate `parent` (-1: the root) its children from the drafter's logits after it."""
        chain = self.chain
        history = tree.sequence + tree.path(parent) if chain.processor.needs_history else None
        depth = 1 + (tree.candidates[parent].depth if parent >= 0 else 0)
        score = tree.candidates[parent].score if parent >= 0 else 1.0
        if chain.processor.is_greedy:  # the drafter's confidence: the softmax of its processed scores
            q = chain.processor.scores(logits[None, : chain.vocab_size], history)[0].softmax(dim=-1)
            tokens, factors = self._top(q, self.branching)
        else:
            q = chain.distribution(logits, history)
            if generator is None:  # coupled: the chain's own draft first, then the next most likely
                first = chain.sample(q, b, len(tree.sequence) + depth - 1)
                tokens, factors = self._top(q.index_fill(0, torch.tensor([first], device=q.device), 0.0),
                                            self.branching - 1)
                tokens, factors = [first, *tokens], [float(q[first]), *factors]
            else:  # sampled without replacement, scored by the order statistics of q
                tree.q[parent] = q
                factors = self._top(q, self.branching)[1]
                u = torch.rand(len(factors), generator=generator, dtype=torch.float64)
                remaining, tokens = q, []
                for i in range(len(factors)):
                    tokens.append(int(inverse_cdf(remaining, float(u[i]))))
                    remaining = remaining.index_fill(0, torch.tensor([tokens[-1]], device=q.device), 0.0)
        for rank, (token, factor) in enumerate(zip(tokens, factors, strict=True)):
            tree.candidates.append(Candidate(token, parent, depth, rank, factor, score * factor))

    @staticmethod
    def _top(q: Tensor, k: int) -> tuple[list[int], list[float]]:
        """The k most likely tokens of q with their probabilities, those with mass only."""
        if k <= 0:
            return [], []
        values, tokens = q.topk(min(k, q.shape[-1]))
        pairs = [(t, v) for t, v in zip(tokens.tolist(), values.tolist(), strict=True) if v > 0]
        return [t for t, _ in pairs], [v for _, v in pairs]

    def _tree(self, tree: RowTree, budget: int, cut: bool) -> tuple[DraftTree, Tensor | None]:
        """The row's best `budget` candidates as a `DraftTree` (with `cut`, only as many as pay
        for the verification pass), nodes in candidate order: parents first, siblings in draw order."""
        ranked = tree.ranked()[:budget]
        if cut and ranked:
            reach: dict[int, float] = {-1: 1.0}
            for c in ranked:
                cand = tree.candidates[c]
                reach[c] = reach[cand.parent] * self.acceptance(cand.rank, cand.factor)
            ranked = ranked[: best_tree_size([reach[c] for c in ranked], self.planner.policy.verify_cost)]
        tree.nodes = sorted(ranked)
        index = {c: i for i, c in enumerate(tree.nodes)}
        candidates = [tree.candidates[c] for c in tree.nodes]
        draft = DraftTree([c.token for c in candidates], [index.get(c.parent, -1) for c in candidates])
        if self._deterministic or not candidates:
            return draft, None
        return draft, torch.stack([tree.q[c.parent] for c in candidates])

    def update(self, sequences, paths, target_logits, p) -> None:
        if not self._trees:  # a chain step: the chain drafter's own bookkeeping
            self.chain.update(sequences, paths, target_logits, p)
            for k, path in zip(self._chain_lengths, paths, strict=True):
                for i in range(min(len(path) + 1, k)):
                    self.acceptance.observe(0, i < len(path))
            return
        for b, (tree, path) in enumerate(zip(self._trees, paths, strict=True)):
            accepted = [tree.nodes[node] for node in path]
            reached = {-1, *accepted}
            for c in tree.nodes:  # every child of a reached node was judged
                cand = tree.candidates[c]
                if cand.parent in reached:
                    self.acceptance.observe(cand.rank, c in accepted, cand.factor)
            if tree.fed:  # keep the accepted nodes the cache holds (a prefix of the path)
                block = {c: j for j, c in enumerate(tree.fed)}
                kept = []
                for c in accepted:
                    if c not in block:
                        break
                    kept.append(block[c])
                self.chain.runner.keep_path_row(b, len(tree.sequence) - 1, kept)
        self._trees = []

    def select_rows(self, keep: list[int]) -> None:
        self.chain.select_rows(keep)
        self._trees = [self._trees[b] for b in keep] if self._trees else []
        self._chain_lengths = [self._chain_lengths[b] for b in keep] if self._chain_lengths else []
