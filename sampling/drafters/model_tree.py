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
  recursive rejection sampling (`sampling/loop/tree_sampling.py`, Jeon et al. 2024). For that rule to
  keep the target's law, whether a child is in the tree must not depend on its own value nor on its
  later siblings': so in sampling a child's score factor is the rank-th largest probability of q
  (known before it is drawn), not q of the drawn token, and the tree is cut only to the budget
  chosen before drafting (a cost cut after drafting would look at the drawn values).
- **Drafter-invariant sampling** (`drafter_invariant`, the default with `adaptive_gamma`): the first
  child is the chain's coupled draft (the inverse CDF of q at the target's own number of that
  position), the others the next most likely tokens; the coupled rule verifies them, and the output
  is plain seeded sampling's.

Where a host read waits for the drafter's device (not a CPU), the tree grows there instead
(`device_tree.py`: what each depth expands fixed before drafting, no read between passes, 2 reads
a step); on a CPU the host grows it as below.

The drafter's runner takes the tree through the `Runner` protocol only: after the root's pass (what
the cache has not seen, a chain) each depth's pass rolls the row back to its accepted tokens less
the last one and feeds that token with the candidates on the paths to the nodes it expands (a tree
block, `forward_rows` with parents): a node must see its own ancestors and no other branch, and the
protocol's cache shows a new block everything it holds. After verification `keep_path_row` keeps
the accepted nodes the last block holds.

Shape and size (with `adaptive_gamma`, `sampling/policy/tree_choice.py`): the planner proposes a tree
where its expected accepted tokens per unit of cost (the drafter's passes priced at their measured
widths, the target's pass over 1 + n tokens) beat the best chain's by a margin, and the shape record
lets it run only where trees have measured to pay there; else the step is the chain drafter's (its
cascade and per-token stop included). A fixed gamma with `branching` >= 2: a tree of `gamma` nodes
every step, no cost cut.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import Tensor

from sampling.drafters import device_tree
from sampling.drafters.device_tree import Levels, draw_without_replacement, path_layout
from sampling.drafters.model_drafter import ModelDrafter
from sampling.loop.drafts import DraftTree
from sampling.loop.randomness import DRAFT
from sampling.loop.tree_sampling import step_generator
from sampling.policy import tree_choice
from sampling.policy.draft_policy import best_tree_size
from sampling.policy.tree_choice import ShapeRecord, TreeAcceptance, TreePlanner, positional_tree
from utils.runners.passes import synchronize


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
        self.fed: list[int | None] = []  # the candidates in the cache after the root, in block order
        self.fed_parents: list[int] = []  # their parents in that block (0: the root, 1 + j: fed[j])
        self.nodes: list[int] = []  # the verified tree's nodes (candidate indices, node order)

    @classmethod
    def from_levels(cls, sequence: list[int], levels: Levels, beams: list[list[int]], qs: list[Tensor],
                    sampled: bool) -> RowTree:
        """A tree grown on the device (`device_tree.grow`): its levels' candidates with mass (each child of beam i
        of level d - 1 in rank order; sampled, with the q it was drawn from, row i of `qs[d]`), and the cache's
        block, the last beams' paths depth by depth."""
        tree = cls(sequence)
        index: list[list[int | None]] = []  # each level's candidates in `candidates` (None: no mass)
        for d, (tokens, factors) in enumerate(levels):
            children = len(tokens) // len(beams[d - 1]) if d else len(tokens)
            index.append([])
            for j, (token, factor) in enumerate(zip(tokens, factors, strict=True)):
                parent = index[d - 1][beams[d - 1][j // children]] if d else -1
                if factor > 0 and parent is not None:
                    if sampled:
                        tree.q[parent] = qs[d][j // children]
                    score = tree.candidates[parent].score if parent >= 0 else 1.0
                    tree.candidates.append(Candidate(token, parent, d + 1, j % children, factor, score * factor))
                index[d].append(len(tree.candidates) - 1 if factor > 0 and parent is not None else None)
        paths = []
        for beam in beams[-1] if beams else []:
            path = [beam]  # a level's index of each node, deepest first
            for d in range(len(beams) - 1, 0, -1):
                path.append(beams[d - 1][path[-1] // (len(levels[d][0]) // len(beams[d - 1]))])
            paths.append([index[d][j] for d, j in enumerate(reversed(path))])
        tree.fed = [path[d] for d in range(len(beams)) for path in paths]
        tree.fed_parents = path_layout(len(paths), len(beams))[1:] if paths else []
        return tree

    def path(self, c: int) -> list[int]:
        tokens = []
        while c >= 0:
            tokens.append(self.candidates[c].token)
            c = self.candidates[c].parent
        return tokens[::-1]

    def kept(self, accepted: list[int]) -> list[int]:
        """The block's positions (after the root) of the longest prefix of the accepted candidates that is a path
        in it: what the drafter's cache keeps."""
        kept: list[int] = []
        for c in accepted:
            at = 1 + kept[-1] if kept else 0  # the last kept node's place in the block (0: the root)
            j = next((j for j, (f, p) in enumerate(zip(self.fed, self.fed_parents, strict=True)) if f == c and p == at),
                     None)
            if j is None:
                break
            kept.append(j)
        return kept

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
    not pay or the record says trees did not (`sampling/policy/tree_choice.py`). `planner` None: a tree of
    `max_drafts` nodes every step (a fixed gamma); `record` None: the planner alone chooses."""

    def __init__(self, chain: ModelDrafter, branching: int, planner: TreePlanner | None,
                 acceptance: TreeAcceptance, record: ShapeRecord | None = None) -> None:
        assert branching >= 2 and chain.runner.supports_trees
        self.chain, self.branching, self.planner, self.acceptance = chain, branching, planner, acceptance
        self.record = record if planner is not None else None
        self._trees: list[RowTree] = []  # this step's trees, one per row; empty on a chain step
        self._chain_lengths: list[int] = []
        self._passes: list[int] = []  # the widest block of each drafter pass of this tree step
        self.tree_steps = 0  # steps drafted as trees (for reports)
        if planner is not None:
            planner.paths = self.on_device  # how its passes are priced

    @property
    def forward_passes(self) -> int:
        return self.chain.forward_passes

    @property
    def cascade(self):
        return self.chain.cascade

    def counters(self) -> dict[str, float]:
        """The chain drafter's counters (its cascade's) and the steps drafted as trees: `Drafting.counters`."""
        return {**self.chain.counters(), "tree_steps": self.tree_steps}

    def start(self, sequences: list[list[int]]) -> None:
        self.chain.start(sequences)
        self._trees = []

    def draft(self, sequences, max_drafts, max_depths):
        budget = max_drafts if self.planner is None else self.planner.budget(max_drafts, len(sequences))
        proposed = budget > 0 and any(max_depths)
        as_tree = proposed and (self.record is None or self.record.choose())
        timed = self.planner is not None and self.chain.is_warm()  # a cold step's catch-up times nothing
        if timed:
            synchronize(*self.chain.runner.devices)
        if proposed and timed and self.record is not None:
            self.record.begin(as_tree)  # timed until `update`: the whole step
        if not as_tree:
            self._trees = []
            drafts = self.chain.draft(sequences, max_drafts, max_depths)
            self._chain_lengths = [len(tree) for tree, _ in drafts]
            return drafts
        self.tree_steps += 1
        depths = [max(0, min(depth, budget)) for depth in max_depths]
        start = tree_choice.clock()
        self._trees = self._grow_on_device(sequences, budget, depths) if self.on_device else \
            self._grow(sequences, budget, depths)
        if timed:  # what the tree's passes cost with the work around them
            synchronize(*self.chain.runner.devices)
            self.planner.observe_drafting(tree_choice.clock() - start, self._passes, len(sequences))
        cut = self.planner is not None and self._deterministic
        return [self._tree(tree, budget, len(sequences) if cut else 0) for tree in self._trees]

    @property
    def _deterministic(self) -> bool:
        return self.chain.processor.is_greedy or self.chain.coupled

    @property
    def on_device(self) -> bool:
        """Whether this drafter's trees grow on the device (`device_tree.py`): where a host read waits for the
        drafter's device (`ModelDrafter.on_device`), for a processor that reads no history."""
        return self.chain.on_device and not self.chain.processor.needs_history

    def _grow_on_device(self, sequences: list[list[int]], budget: int, depths: list[int]) -> list[RowTree]:
        """Every row's candidates grown on the device, as many expanded per depth as the positional model's best
        tree of `budget` nodes expands there, read once. The model's rates: those learned, except under standard
        sampling with a fixed gamma, whose trees take the prior's, one shape whatever the batch's other rows (a
        seeded row is then the single call; elsewhere the output does not depend on the tree's shape)."""
        learned = self.planner is not None or self._deterministic
        acceptance = self.acceptance if learned else TreeAcceptance()
        widths = device_tree.expansion_widths(positional_tree(acceptance, self.branching, budget)[0])
        levels, beams, qs, self._passes = device_tree.grow(self.chain, sequences, depths, widths, self.branching,
                                                           self._generators(sequences, depths))
        sampled = not self._deterministic
        return [RowTree.from_levels(sequence, *row, sampled) if row[0] else RowTree(sequence)
                for sequence, *row in zip(sequences, levels, beams, qs, strict=True)]

    def _generators(self, sequences: list[list[int]], depths: list[int]) -> list[torch.Generator | None]:
        """Each drafting row's numbers for this step's sampled children (None where nothing is sampled)."""
        sampled = not self._deterministic
        return [step_generator(self.chain.uniforms[b], len(s) - self.chain.uniforms[b].prefix_length, DRAFT)
                if sampled and depths[b] else None for b, s in enumerate(sequences)]

    def _grow(self, sequences: list[list[int]], budget: int, depths: list[int]) -> list[RowTree]:
        """Every row's candidates: the root's pass, then one pass per depth (all rows together)."""
        runner, trees = self.chain.runner, [RowTree(sequence) for sequence in sequences]
        generators = self._generators(sequences, depths)
        # 1. The root: each drafting row feeds what its cache has not seen (a chain).
        width, roots = device_tree.root_pass(runner, sequences, depths)
        self._passes = [width]
        self._expand_all([(trees[b], b, -1, root, generators[b]) for b, root in roots.items()])
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
                    tree.fed_parents = parents
                    blocks.append(([tree.sequence[-1]] + [tree.candidates[c].token for c in tree.fed], [-1, *parents]))
                else:
                    blocks.append(([], None))
            logits = runner.forward_rows(blocks, [len(chosen) for chosen in picks])
            self._passes.append(max(len(tokens) for tokens, _ in blocks))
            self._expand_all([(trees[b], b, c, logits[b][j], generators[b])
                              for b, chosen in enumerate(picks) for j, c in enumerate(chosen)])
        return trees

    def _expand_all(self, expansions: list[tuple[RowTree, int, int, Tensor, torch.Generator | None]]) -> None:
        """Give every (tree, row, parent, logits, generator) of one drafter pass (all rows) its children,
        in order, with few host reads: greedy, every parent's top-k in one read; sampled, the top-k
        probabilities in one read, the children drawn on the device and read in a second (`_expand_sampled`);
        coupled, per parent (`_expand_coupled`)."""
        if not expansions:
            return
        chain = self.chain
        # The drafter's confidence: q, or the softmax of its processed scores when q is greedy's one-hot.
        qs = [chain.belief(logits, self._history(tree, parent)) for tree, _, parent, logits, _ in expansions]
        if self.chain.coupled and not chain.processor.is_greedy:
            for (tree, b, parent, _, _), q in zip(expansions, qs, strict=True):
                self._expand_coupled(tree, b, parent, q)
            return
        tops = self._top_rows(torch.stack(qs), self.branching)
        if not chain.processor.is_greedy:
            self._expand_sampled(expansions, qs, [factors for _, factors in tops])
            return
        for (tree, _, parent, _, _), (tokens, factors) in zip(expansions, tops, strict=True):
            self._add_children(tree, parent, tokens, factors)

    def _expand_sampled(self, expansions, qs: list[Tensor], factors: list[list[float]]) -> None:
        """Sampled children, drawn from each parent's q without replacement and scored by the order
        statistics of q (`factors`, read before drawing: how many have mass), drawn on the device and
        read in one transfer for the pass."""
        drawn = []
        for (tree, _, parent, _, generator), q, row_factors in zip(expansions, qs, factors, strict=True):
            tree.q[parent] = q
            drawn.append(draw_without_replacement(q, len(row_factors), generator))
        on_device = [token for children in drawn for token in children]
        values = iter(torch.stack(on_device).tolist() if on_device else [])
        for (tree, _, parent, _, _), children, row_factors in zip(expansions, drawn, factors, strict=True):
            self._add_children(tree, parent, [next(values) for _ in children], row_factors)

    def _history(self, tree: RowTree, parent: int) -> list[int] | None:
        """The tokens before candidate `parent`'s children, for a processor that reads them (else None)."""
        return tree.sequence + tree.path(parent) if self.chain.processor.needs_history else None

    def _expand_coupled(self, tree: RowTree, b: int, parent: int, q: Tensor) -> None:
        """Candidate `parent`'s children when coupled: the chain's own draft first, then the next most likely."""
        depth = 1 + (tree.candidates[parent].depth if parent >= 0 else 0)
        first = self.chain.sample(q, b, len(tree.sequence) + depth - 1)
        tokens, factors = self._top(q.index_fill(0, torch.tensor([first], device=q.device), 0.0), self.branching - 1)
        self._add_children(tree, parent, [first, *tokens], [float(q[first]), *factors])

    @staticmethod
    def _add_children(tree: RowTree, parent: int, tokens: list[int], factors: list[float]) -> None:
        """Candidate `parent` (-1: the root)'s children, in rank order, scored along the path."""
        depth = 1 + (tree.candidates[parent].depth if parent >= 0 else 0)
        score = tree.candidates[parent].score if parent >= 0 else 1.0
        for rank, (token, factor) in enumerate(zip(tokens, factors, strict=True)):
            tree.candidates.append(Candidate(token, parent, depth, rank, factor, score * factor))

    @staticmethod
    def _top(q: Tensor, k: int) -> tuple[list[int], list[float]]:
        """The k most likely tokens of q with their probabilities, those with mass only."""
        if k <= 0:
            return [], []
        return ModelTreeDrafter._top_rows(q[None], k)[0]

    @staticmethod
    def _top_rows(qs: Tensor, k: int) -> list[tuple[list[int], list[float]]]:
        """`_top` of each row of qs (n, V), the k > 0 most likely tokens of every row read in one transfer."""
        values, tokens = qs.topk(min(k, qs.shape[-1]), dim=-1)
        # One host read for both: q is float32 or float64 (`as_float`), where token ids below 2^24 are exact.
        read = torch.stack([values, tokens.to(values.dtype)], dim=1).tolist()
        out = []
        for row_values, row_tokens in read:
            pairs = [(int(t), v) for v, t in zip(row_values, row_tokens, strict=True) if v > 0]
            out.append(([t for t, _ in pairs], [v for _, v in pairs]))
        return out

    def _tree(self, tree: RowTree, budget: int, cut_rows: int) -> tuple[DraftTree, Tensor | None]:
        """The row's best `budget` candidates as a `DraftTree` (with `cut_rows`, the rows verified
        together, only as many as pay for that verification pass; 0: no cut), nodes in candidate
        order: parents first, siblings in draw order."""
        ranked = tree.ranked()[:budget]
        if cut_rows and ranked:
            reach: dict[int, float] = {-1: 1.0}
            for c in ranked:
                cand = tree.candidates[c]
                reach[c] = reach[cand.parent] * self.acceptance(cand.rank, cand.factor)
            verify_cost = functools.partial(self.planner.policy.verify_cost, rows=cut_rows)
            ranked = ranked[: best_tree_size([reach[c] for c in ranked], verify_cost)]
        tree.nodes = sorted(ranked)
        index = {c: i for i, c in enumerate(tree.nodes)}
        candidates = [tree.candidates[c] for c in tree.nodes]
        draft = DraftTree([c.token for c in candidates], [index.get(c.parent, -1) for c in candidates])
        if self._deterministic or not candidates:
            return draft, None
        return draft, torch.stack([tree.q[c.parent] for c in candidates])

    def update(self, sequences, paths, target_logits, p) -> None:
        self._learn(sequences, paths, target_logits, p)
        if self.record is not None:  # the step ends here: its tokens, all rows
            self.record.end(sum(len(path) + 1 for path in paths))

    def _learn(self, sequences, paths, target_logits, p) -> None:
        """The acceptance rates learn the judged children; the drafter's cache keeps the accepted ones."""
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
                self.chain.runner.keep_path_row(b, len(tree.sequence) - 1, tree.kept(accepted))
        self._trees = []

    def select_rows(self, keep: list[int]) -> None:
        self.chain.select_rows(keep)
        self._trees = [self._trees[b] for b in keep] if self._trees else []
        self._chain_lengths = [self._chain_lengths[b] for b in keep] if self._chain_lengths else []
