"""The n-gram drafter of NASD: drafts chains or trees from a dynagram, only as large as they are likely to pay."""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ngram_assisted.dynagram import DynaGram, Prediction
from ngram_assisted.matching import MAX_MATCH, CopyIndex
from ngram_assisted.options import NgramOptions, check_vocabulary
from sampling.loop.drafts import DraftTree, PerRow
from sampling.policy.draft_policy import best_tree_size
from sampling.policy.tree_choice import tree_branching
from utils.cost_model import prior_cost
from utils.logits_processors import supports_float64
from utils.validation import check_bool, check_int

# Prior P(accept) of a draft by the length of the context it matched (1, 2, 3, 4, 5-7, 8-15, 16+
# tokens: in the pool or, longer, in the text itself), as measured on held-out Spec-Bench prompts
# with SmolLM2-135M (greedy): longer matches are copies.
MATCH_LENGTH_PRIOR = (0.25, 0.5, 0.65, 0.8, 0.8, 0.9, 0.92)
# Greedy: prior P(accept) of the target's own top choice at a context it scored before, by match
# length (as above) and by its probability then (< 0.2, < 0.6, < 0.97, >= 0.97). Measured on
# held-out Spec-Bench prompts apart from the evaluation's (SmolLM2-135M): at a long match the
# target's argmax is its argmax again whatever its probability was (a 0.3 argmax, 0.9 accepted);
# at a one-token match a 0.97 argmax is accepted half the time (the context was another one).
TOP_CHOICE_PRIOR = (
    (0.05, 0.25, 0.3, 0.5), (0.3, 0.4, 0.55, 0.83), (0.5, 0.65, 0.7, 0.9), (0.55, 0.65, 0.75, 0.88),
    (0.65, 0.72, 0.85, 0.88), (0.85, 0.87, 0.9, 0.97), (0.9, 0.95, 0.98, 0.99),
)
TOP_CHOICE_EDGES = (0.2, 0.6, 0.97)
NOT_TOP_CHOICE_PRIOR = 0.1  # greedy: a token the target ranked below another there
PRIOR_WEIGHT = 4.0  # the prior counts as this many observed drafts
RUNNER_UP_PRIOR = 0.3  # a second or third candidate starts at this fraction of the first's prior
COPY_CANDIDATES = 3  # the pool's candidates per node searched for the longest copy, whatever the branching
CONFIDENCE_BUCKETS = (0.05, 0.1, 0.2, 0.3, 0.45, 0.6, 0.75, 0.9, 0.97)  # the target's last probability of a proposal, bucketed


@dataclass(frozen=True, slots=True)
class TextKind:
    """A proposal only seen in text (the target never scored its context): judged by its match
    length (1-4, then 5-7, 8-15, 16+ as 5, 6, 7), how often it followed (1-4+), whether it is the
    majority continuation, and its rank among the context's candidates (0, 1, 2+)."""

    match_length: int
    count: int
    majority: bool
    rank: int


@dataclass(frozen=True, slots=True)
class ScoredKind:
    """A proposal the target scored at that context (a token of its top-k there): judged by its
    match length (as `TextKind`'s), whether it was the target's top choice, whether it is a
    runner-up among the pool's candidates, and the bucket of its probability then
    (`CONFIDENCE_BUCKETS`: 0 below the first edge, len(edges) at or past the last)."""

    match_length: int
    top_choice: bool
    runner_up: bool
    bucket: int


Kind = TextKind | ScoredKind  # distinct classes: a text kind never equals a scored one


class AcceptanceModel:
    """Online estimate of P(a draft is accepted | the drafts before it were), per kind of proposal.

    A proposal the target has scored (a token of its top-k there) is judged by what the target
    said the last time it saw that context (`ScoredKind`). Greedy decoding accepts the target's
    argmax, so there the prior is how often the top choice stays the top choice
    (`TOP_CHOICE_PRIOR`, by match length and probability); sampling accepts x with probability
    p(x), so there it is the middle of the probability's bucket. A proposal only seen in text (the
    prompt) is judged by its `TextKind`, starting from a prior set by its match length
    (`MATCH_LENGTH_PRIOR`). Priors are worth `PRIOR_WEIGHT` drafts; each
    kind moves to the acceptance rate actually observed. On top of that, a calibration factor
    (accepted / predicted over all judged drafts so far) scales the odds of every estimate, so that
    text where the pool is less reliable than usual stops the drafting after a few misses (in odds,
    a sure proposal is lowered less than an unsure one, and none is raised past certainty).
    """

    def __init__(self, prior: tuple[float, ...] = MATCH_LENGTH_PRIOR, weight: float = PRIOR_WEIGHT) -> None:
        self.prior = prior
        self.weight = weight
        self.greedy = True  # until a sampled step is judged
        self.counts: dict[Kind, list[float]] = {}  # kind -> [accepted, rejected]
        self.accepted = 0.0
        self.predicted = 0.0

    @staticmethod
    def kind(prediction: Prediction, rank: int = 0, copied: int = 0) -> Kind:
        """`copied`: the context tokens it matched in the text itself (`CopyIndex`), when more than
        the pool's context; match lengths 1-4 count as themselves, then 5-7, 8-15 and 16+."""
        p = prediction.probability
        length = max(prediction.match_length, copied)
        match_length = length if length <= 4 else 5 if length < 8 else 6 if length < 16 else 7
        if p is None:  # only seen in text: count and majority speak for it
            return TextKind(match_length, min(prediction.count, 4), 2 * prediction.count > prediction.total, min(rank, 2))
        bucket = sum(p >= edge for edge in CONFIDENCE_BUCKETS)
        return ScoredKind(match_length, prediction.target_rank == 0, rank > 0, bucket)

    def _prior(self, kind: Kind) -> list[float]:
        if isinstance(kind, TextKind):
            a = self.prior[min(kind.match_length, len(self.prior)) - 1] * (RUNNER_UP_PRIOR if kind.rank else 1.0)
        else:
            edges = (0.0, *CONFIDENCE_BUCKETS, 1.0)
            middle = (edges[kind.bucket] + edges[kind.bucket + 1]) / 2  # the target's probability then
            if not self.greedy:
                a = middle
            elif kind.top_choice:
                row = TOP_CHOICE_PRIOR[min(kind.match_length, len(TOP_CHOICE_PRIOR)) - 1]
                a = row[sum(middle >= edge for edge in TOP_CHOICE_EDGES)]
            else:
                a = NOT_TOP_CHOICE_PRIOR
        return [a * self.weight, (1 - a) * self.weight]

    def estimate(self, kind: Kind) -> float:
        accepted, rejected = self.counts.get(kind) or self._prior(kind)
        calibration = (self.accepted + self.weight) / (self.predicted + self.weight)
        odds = calibration * accepted / max(rejected, 1e-9)  # scaled as odds: stays below 1
        return min(0.99, odds / (1.0 + odds))

    def record(self, kind: Kind, accepted: float, estimate: float) -> None:
        """A judged draft of this kind, proposed with this `estimate`, was accepted (1.0), rejected
        (0.0), or accepted with this probability (sampling)."""
        counts = self.counts.setdefault(kind, self._prior(kind))
        counts[0] += accepted
        counts[1] += 1.0 - accepted
        self.accepted += accepted
        self.predicted += estimate


class NgramDrafter:
    """Drafts from a dynagram pool (deterministic drafts: q is one-hot, so `draft` returns q=None).

    `options` (`NgramOptions`, as `ngram_assisted_speculative_generate` takes them): up to
    `branching` candidates per node (most frequent first; 1 is a chain; None: up to
    AUTO_BRANCHING where stop_if_unknown cuts trees to what pays, else 1), grown best-first by the
    estimated probability of reaching each node (the product of the acceptance estimates on its
    path), up to `max_drafts` nodes. stop_if_unknown=True: the tree is then cut to the size that
    maximises expected accepted tokens per unit of target cost (`draft_cost`; None: the documented
    prior `utils.cost_model.prior_cost`, NASD puts the target's measured costs there); with
    branching=1 that is a chain stopping at the first unknown n-gram. stop_if_unknown=False: every
    known continuation is drafted, up to gamma nodes (ANPD's behaviour, widened). A miss always
    ends a branch: the pool never invents a token. After each step the pool learns the accepted
    tokens and the target's `top_k_filler` most likely tokens (with probabilities) after every
    verified node, rejected ones included (token recycling). `greedy`: the target decodes greedily
    (its argmax judges a draft) or samples (p(x) does): each has its own priors.
    """

    forward_passes = 0  # an n-gram pool runs no model

    def __init__(
        self,
        pool: DynaGram,
        options: NgramOptions = NgramOptions(),  # frozen: one shared default is safe
        *,
        vocab_size: int,
        source_tokens: Sequence[int] = (),
        greedy: bool = True,
    ) -> None:
        if not isinstance(pool, DynaGram):
            raise TypeError(f"pool must be a SimpleDynaGram or MultiDynaGram, got {type(pool).__name__}")
        if not isinstance(options, NgramOptions):
            raise TypeError(f"options must be an NgramOptions (ngram_assisted.NgramOptions(top_k_filler=..., ...)), "
                            f"got {type(options).__name__}")
        check_int(vocab_size, "vocab_size", 1)
        check_vocabulary(options, vocab_size)
        check_bool(greedy, "greedy")
        self.pool = pool
        self.options = options
        self.vocab_size = vocab_size
        self.source_tokens = list(source_tokens)
        self.draft_cost = prior_cost if options.draft_cost is None else options.draft_cost
        self.branching = tree_branching(options.branching, options.stop_if_unknown)
        self.acceptance = AcceptanceModel()
        self.acceptance.greedy = greedy  # greedy judges the argmax, sampling p(x): the priors differ
        self.copies = CopyIndex()  # the match length of proposals copied from the text
        self._indexed = 0  # tokens of the sequence in `copies`
        self._base = 0  # len(sequence) when the last draft started
        self._tree = DraftTree.chain([])
        self._judged: list[tuple[Kind, float]] = []  # (kind, estimate) of each node of the last tree
        self.reaches: list[float] = []  # P(node and its whole path accepted), each node of the last tree

    def start(self, sequence: list[int]) -> None:
        self.pool.bind_vocabulary(self.vocab_size)
        self.pool.fill(self.source_tokens)  # encoder-decoder: the source text, where copying happens
        self.pool.learn(sequence)
        self.copies = CopyIndex()
        self.copies.extend([*self.source_tokens, *sequence])
        self._indexed = len(sequence)

    def _candidates(self, history: list[int], parent: int, reach: float) -> list[tuple[float, int, Kind, float, Prediction]]:
        """(reach, parent, kind, acceptance estimate, proposal) of the pool's candidates after `history`:
        the `branching` whose earlier occurrences repeat the longest stretch of the text before them
        (prompt lookup's copy; SuffixDecoding's longest match), the pool's order among equals."""
        found = self.pool.candidates(history[len(history) - (self.pool.n - 1) :], max(self.branching, COPY_CANDIDATES))
        copied = [self.copies.match_length(history, c.token) for c in found]
        order = sorted(range(len(found)), key=lambda i: -copied[i])[: self.branching]  # stable: pool order kept
        found = [found[i] for i in order]
        kinds = [AcceptanceModel.kind(found[rank], rank, copied[i]) for rank, i in enumerate(order)]
        estimates = [self.acceptance.estimate(kind) for kind in kinds]
        return [(reach * a, parent, kind, a, c) for kind, a, c in zip(kinds, estimates, found, strict=True)]

    def draft(self, sequence: list[int], max_drafts: int, max_depth: int | None = None,
              cut: bool | None = None) -> tuple[DraftTree, None]:
        """`cut` (default: stop_if_unknown): cut the tree to the size that pays under `draft_cost`;
        a batch cuts its rows' trees together instead (`NgramRows`)."""
        self._base = len(sequence)
        max_depth = max_drafts if max_depth is None else max_depth
        tokens, parents, reaches, judged, depths = [], [], [], [], []
        histories = {-1: list(sequence[-max(self.pool.n - 1, MAX_MATCH) :])}
        # Best-first: the candidate most likely to be reached, the earliest found among equals (a heap
        # of (-reach, order found)).
        frontier: list[tuple[float, int, tuple]] = []
        found = 0
        for candidate in self._candidates(histories[-1], -1, 1.0) if max_depth > 0 else []:
            heapq.heappush(frontier, (-candidate[0], found, candidate))
            found += 1
        while frontier and len(tokens) < max_drafts:
            reach, parent, kind, estimate, prediction = heapq.heappop(frontier)[2]
            node = len(tokens)
            tokens.append(prediction.token)
            parents.append(parent)
            reaches.append(reach)
            judged.append((kind, estimate))
            histories[node] = histories[parent] + [prediction.token]
            depths.append(1 + (depths[parent] if parent >= 0 else 0))
            if depths[node] < max_depth:  # only a path's depth can become generated tokens
                for candidate in self._candidates(histories[node], node, reach):
                    heapq.heappush(frontier, (-candidate[0], found, candidate))
                    found += 1
        self._tree, self._judged, self.reaches = DraftTree(tokens, parents), judged, reaches
        if self.options.stop_if_unknown if cut is None else cut:
            return self.keep(best_tree_size(reaches, self.draft_cost)), None
        return self._tree, None

    def keep(self, size: int) -> DraftTree:
        """Cut the tree just drafted to its first `size` nodes -> that tree. Nodes come in order of
        falling reach, parents first, so a prefix is a tree (0: the empty tree, a plain step)."""
        tree = self._tree
        self._tree = DraftTree(tree.tokens[:size], tree.parents[:size])
        self._judged, self.reaches = self._judged[:size], self.reaches[:size]
        return self._tree

    def update(self, sequence: list[int], path: list[int], target_logits: Tensor, p: Tensor | None) -> None:
        tree = self._tree
        self.copies.extend(sequence[self._indexed :])
        self._indexed = len(sequence)
        # Learn how often each kind of proposal is accepted. Judged: the candidates at the root and
        # at every accepted node (the nodes below a rejection were never reached). Greedy: whether
        # it was the target's argmax. Sampling: its chance p(x) of being the emitted token, known
        # now (the multi-candidate rule emits x with probability p(x)): the same mean, less noise.
        reached = {-1, *path}
        judged_nodes = [node for node, parent in enumerate(tree.parents) if parent in reached]
        top_k, chances = self._read_scores(tree, judged_nodes, target_logits, p)
        if p is None:
            on_path = set(path)
            chances = [float(node in on_path) for node in judged_nodes]
        for node, chance in zip(judged_nodes, chances, strict=True):
            kind, estimate = self._judged[node]
            self.acceptance.record(kind, chance, estimate)
        # Token recycling (Luo et al. 2024): the target's top-k after every verified position, on the
        # accepted path and off it, go in the pool with their probabilities. They go in before the
        # accepted tokens, so that on equal counts the token really generated (added last, most
        # recent) stays the proposal; that one only gets its probability here.
        longest = self.pool.n - 1
        prefix = sequence[max(0, self._base - longest) : self._base]
        for row, node in enumerate([-1, *path]):
            end = self._base + row
            if end < len(sequence):
                self._recycle(sequence[max(0, end - longest) : end], top_k[1 + node], generated=sequence[end])
        for node in range(len(tree)):
            if node not in reached:
                self._recycle((prefix + tree.path_to(node))[-longest:], top_k[1 + node], generated=None)
        self.pool.learn(sequence)  # the accepted tokens and the target's own

    def _read_scores(self, tree: DraftTree, judged_nodes: list[int], target_logits: Tensor,
                     p: Tensor | None) -> tuple[list[tuple[list[int], list[float]]], list[float]]:
        """-> (the target's top-k (ids, probabilities) at every row of its scores; sampling: p of each
        judged node's token there, else []), computed on the scores' device and read in one transfer
        (one host sync per step, whatever the tree's size)."""
        k = self.options.top_k_filler
        if p is not None:
            top = p.topk(k, dim=-1)
            probabilities = top.values
        else:  # softmax of the top-k only (no full-vocabulary softmax per step)
            top = target_logits.topk(k, dim=-1)
            probabilities = (top.values - target_logits.logsumexp(dim=-1, keepdim=True)).exp()
        # Ids travel as floats beside the probabilities: exact below 2**24 (float32) or 2**53.
        dtype = torch.float64 if supports_float64(target_logits.device) else torch.float32
        # A row scored nowhere (all -inf, as off the path in the offline replay) teaches nothing.
        parts = [top.indices.to(dtype).flatten(), probabilities.to(dtype).nan_to_num(0.0).flatten()]
        if p is not None and judged_nodes:
            rows = torch.tensor([1 + tree.parents[node] for node in judged_nodes], device=p.device)
            tokens = torch.tensor([tree.tokens[node] for node in judged_nodes], device=p.device)
            parts.append(p[rows, tokens].to(dtype))
        values = torch.cat(parts).tolist()
        size = top.indices.numel()
        ids, chances = [int(i) for i in values[:size]], values[2 * size :]
        top_k = [(ids[row : row + k], values[size + row : size + row + k]) for row in range(0, size, k)]
        return top_k, chances

    def _recycle(self, context: list[int], top_k: tuple[list[int], list[float]], generated: int | None) -> None:
        for rank, (token, probability) in enumerate(zip(*top_k, strict=True)):
            if probability > 0:  # zero: outside the processor's nucleus or top-k
                self.pool.add(context, token, count=int(token != generated), probability=probability, target_rank=rank)


class NgramRows(PerRow):
    """The n-gram drafters of a batch's rows (`PerRow`), with the step's rule for a batch.

    A step's pass is as wide as the widest row's tree, so the rows' trees are cut together, to the
    width W (1 + drafted nodes per row; 1 is a plain step) that maximises

        (1 + E_min(W) + s * sum_b (E_b(W) - E_min(W))) / r(W),

    E_b(W) the expected accepted drafts of row b's tree cut to W - 1 nodes (its nodes' reaches,
    from its own drafter's acceptance estimates, which start from priors that let a row try and
    then follow what that row's drafts really achieved), r(W) what a pass of the batch's rows x W
    tokens costs against a plain one (timed, `PassCosts.batch_ratio`), and s the share of a plain
    pass a row saves when it leaves the batch (`PassCosts.row_ratio`). The batch ends with its
    slowest row: its gain counts in full, a faster row's only by what finishing earlier saves, so
    where a pass costs the same whatever its rows (memory-bound) this is the slowest row's rule,
    and where cost grows with rows it is the batch's throughput. Every width is weighed, so short
    drafts that cost about a plain pass are taken even where long ones would not pay.
    With stop_if_unknown=False (the user asked for drafts) or a given `draft_cost`, each row drafts
    as it would alone.
    """

    def __init__(self, drafters: list[NgramDrafter], costs, stop_if_unknown: bool) -> None:
        super().__init__(drafters)
        self.costs = costs
        self.stop_if_unknown = stop_if_unknown

    def reaches(self) -> list[list[float]]:
        """Per row, P(node and its whole path accepted) for each node of its last tree (what a
        hybrid weighs the pool's drafts by)."""
        return [drafter.reaches for drafter in self.drafters]

    def withdraw(self, rows: list[int]) -> None:
        """The last trees of `rows` are not verified (a hybrid verifies another draft there): they
        are forgotten, and those rows' next `update` has an empty path."""
        for b in rows:
            self.drafters[b].keep(0)

    def draft(self, sequences, max_drafts, max_depths):
        if len(sequences) == 1 or not self.stop_if_unknown or self.costs is None:
            return super().draft(sequences, max_drafts, max_depths)
        for drafter, sequence, depth in zip(self.drafters, sequences, max_depths, strict=True):
            drafter.draft(sequence, max_drafts, depth, cut=False)
        size = batch_width(self.costs, [drafter.reaches for drafter in self.drafters]) - 1
        return [(drafter.keep(size), None) for drafter in self.drafters]


def batch_width(costs, reaches: list[list[float]]) -> int:
    """The pass width W (1 + nodes per row) for rows whose trees' nodes have these `reaches`, by
    the rule of `NgramRows`; 1 when no drafting pays."""
    rows = len(reaches)
    share = 1.0 - costs.row_ratio(rows)  # of a plain pass, saved by a row that leaves
    best_width, best_rate = 1, 1.0
    expected = [0.0] * rows
    for width in range(2, 2 + max(map(len, reaches), default=0)):
        expected = [e + (r[width - 2] if width - 2 < len(r) else 0.0) for e, r in zip(expected, reaches, strict=True)]
        slowest = min(expected)
        rate = (1.0 + slowest + share * sum(e - slowest for e in expected)) / costs.batch_ratio(rows, width)
        if rate > best_rate:
            best_width, best_rate = width, rate
    return best_width
