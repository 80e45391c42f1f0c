"""Token trees grown on the device: no host read between a tree's drafter passes (`ModelTreeDrafter`, where a
read waits for the device).

The tree is `model_tree.py`'s (EAGLE-2's; greedy, coupled or sampled, the same children, each
scored by the product of its path's factors, the best `budget` kept), grown otherwise.
There, each pass's children are read to choose what the next pass expands: the best candidates that
can still make the budget. Here what each depth expands is fixed before drafting: `widths[d - 1]`
nodes at depth d, as many as the positional model's best tree of the budget's nodes expands there
(`tree_choice.positional_tree`); each depth's **beams** are that many of its best candidates by
cumulative confidence, found on the device (a stable sort: rank order on ties). A depth's pass
feeds the root, then every beam's path depth by depth (depth 1 of each beam, then depth 2, ...;
`path_layout`): parents that do not depend on the drafts, so the runner's tree mask is known before
them, the ids stay on the device, and the block's last tokens are the beams whose children the
pass gives. Paths repeat shared ancestors: a pass over 1 + d w tokens at depth d, where the host's
feeds their union; on a CPU, where a read costs nothing, the host grows the tree.

The step reads every row's candidates (tokens and factors) and beams once, at the end; the host
then ranks, cuts and verifies them as it does its own (`RowTree`). In sampling, which nodes are
expanded depends on the scores, the order statistics of their ancestors' q, as model_tree.py's
choice does: never on a child's own drawn value.
"""

from __future__ import annotations

import torch
from torch import Tensor

from sampling.drafters.model_drafter import ModelDrafter
from utils.logits_processors import inverse_cdf
from utils.runners.protocol import Runner

Levels = list[tuple[list[int], list[float]]]  # a row's candidates depth by depth: tokens, factors (q of each)


def expansion_widths(nodes: list[tuple[int, int, int]]) -> list[int]:
    """A tree's nodes (parent, depth, rank) -> how many nodes of each depth 1, 2, ... have children in it, down to
    the depth above its deepest."""
    expanded = {parent for parent, _, _ in nodes if parent >= 0}
    deepest = max((depth for _, depth, _ in nodes), default=0)
    return [sum(1 for c in expanded if nodes[c][1] == depth) for depth in range(1, deepest)]


def path_layout(width: int, depth: int) -> list[int]:
    """The parents of a block feeding the root, then `width` paths of `depth` tokens, depth by depth: the node at
    depth j of path i is at 1 + (j - 1) width + i."""
    return [-1] + [0] * width + [1 + (j - 2) * width + i for j in range(2, depth + 1) for i in range(width)]


class Growth:
    """One row's candidates on the device, level by level (level d: depth d + 1): each level's tokens, factors and
    scores (cumulative confidences), the distributions its children were drawn from (row i: beam i's of the level
    above; the root's for level 0), the beams chosen at each expanded depth (indices into its level) and their
    paths' tokens."""

    def __init__(self) -> None:
        self.levels: list[tuple[Tensor, Tensor, Tensor]] = []
        self.qs: list[Tensor] = []
        self.beams: list[Tensor] = []
        self.paths: Tensor | None = None  # (beams, depth): the last beams' tokens from depth 1
        self._parent_beam: Tensor | None = None  # each candidate of the deepest level: its parent's beam

    def add(self, qs: Tensor, tokens: Tensor, factors: Tensor) -> None:
        """The next level: the children (tokens, factors: (n, k)) of the root (n = 1) or of the last beams."""
        scores = factors if not self.beams else self.levels[-1][2][self.beams[-1]][:, None] * factors
        self.levels.append((tokens.reshape(-1), factors.reshape(-1), scores.reshape(-1)))
        self.qs.append(qs)
        self._parent_beam = torch.arange(len(qs), device=qs.device).repeat_interleave(factors.shape[-1])

    def choose(self, width: int) -> Tensor:
        """The deepest level's `width` best candidates become beams -> the block after the root (`path_layout`)."""
        tokens, _, scores = self.levels[-1]
        best = torch.sort(scores, descending=True, stable=True).indices[:width]
        last = tokens[best][:, None]
        self.paths = last if self.paths is None else torch.cat([self.paths[self._parent_beam[best]], last], dim=1)
        self.beams.append(best)
        return self.paths.T.reshape(-1)

    def parts(self) -> list[Tensor]:
        """What the host reads of it, in one dtype: each level's tokens and factors, then each depth's beams."""
        dtype = self.levels[0][1].dtype  # float32 or float64 (`belief`): token ids below 2^24 are exact
        return [part.to(dtype) for tokens, factors, _ in self.levels for part in (tokens, factors)] + \
            [beams.to(dtype) for beams in self.beams]


def children(chain: ModelDrafter, qs: Tensor, branching: int, row: int, position: int,
             generator: torch.Generator | None) -> tuple[Tensor, Tensor]:
    """The children of each distribution of qs (n, V) (drafter beliefs at sequence position `position`) -> their
    tokens and factors (n, k), on the device, as `model_tree.py` drafts them: greedy, the top k; coupled, the
    chain's own draft, then the next most likely; sampled, drawn without replacement with `generator`, scored by
    q's order statistics (a factor 0: no mass left, dropped by the host)."""
    k = min(branching, qs.shape[-1])
    if chain.processor.is_greedy:
        factors, tokens = qs.topk(k, dim=-1)
        return tokens, factors
    if chain.coupled:
        first = torch.stack([chain.draw(q, row, position) for q in qs])[:, None]
        rest, others = qs.scatter(-1, first, 0.0).topk(k - 1, dim=-1)
        return torch.cat([first, others], dim=-1), torch.cat([qs.gather(-1, first), rest], dim=-1)
    return torch.stack([torch.stack(draw_without_replacement(q, k, generator)) for q in qs]), qs.topk(k, dim=-1).values


def draw_without_replacement(q: Tensor, count: int, generator: torch.Generator) -> list[Tensor]:
    """`count` tokens drawn from q without replacement with `generator`'s numbers, on q's device."""
    u = torch.rand(count, generator=generator, dtype=torch.float64)
    remaining, drawn = q, []
    for i in range(count):
        drawn.append(inverse_cdf(remaining, u[i]))
        remaining = remaining.index_fill(0, drawn[-1].view(1), 0.0)
    return drawn


def root_pass(runner: Runner, sequences: list[list[int]], depths: list[int]) -> tuple[int, dict[int, Tensor]]:
    """A tree step's first drafter pass, whichever grows the tree: each row with room to draft (`depths[b]`) feeds
    what its cache has not seen (a chain) -> (the widest block, row -> the logits at its root, the last accepted
    token, for the rows that fed any)."""
    pending = [s[runner.row_length(b) :] if depths[b] else [] for b, s in enumerate(sequences)]
    logits = runner.forward_rows([(tokens, None) for tokens in pending], [int(bool(t)) for t in pending])
    return max(map(len, pending)), {b: logits[b][-1] for b, tokens in enumerate(pending) if tokens}


def grow(chain: ModelDrafter, sequences: list[list[int]], depths: list[int], widths: list[int], branching: int,
         generators: list[torch.Generator | None]) -> tuple[list[Levels], list[list[list[int]]], list[list[Tensor]],
                                                            list[int]]:
    """Every drafting row's tree, at most `depths[b]` deep, `widths` expanded per depth, grown on the device ->
    per row its levels and each expanded depth's beams (read in one transfer; none for a row that did not
    draft), its levels' distributions (`Growth.qs`, on the device), and the widest block of each drafter pass."""
    runner = chain.runner
    width, roots = root_pass(runner, sequences, depths)
    passes = [width]
    growths = {b: Growth() for b in roots}
    for b, growth in growths.items():
        q = chain.belief(roots[b], None)[None]
        growth.add(q, *children(chain, q, branching, b, len(sequences[b]), generators[b]))
    for depth in range(1, min(len(widths) + 1, max(depths))):
        growing = [b for b in growths if depth < depths[b]]
        if not growing:
            break
        blocks, beams = [([], None)] * len(sequences), [0] * len(sequences)
        for b in growing:
            paths = growths[b].choose(widths[depth - 1])
            beams[b] = len(paths) // depth  # fewer where the depth has fewer candidates
            runner.rollback_row(b, len(sequences[b]) - 1)  # the root is fed again, with the paths
            root = torch.tensor([sequences[b][-1]], dtype=torch.long, device=runner.device)
            blocks[b] = (torch.cat([root, paths]), path_layout(beams[b], depth))
        logits = runner.forward_rows(blocks, beams)
        passes.append(max(len(tokens) for tokens, _ in blocks))
        for b in growing:
            qs = torch.stack([chain.belief(row, None) for row in logits[b]])
            growths[b].add(qs, *children(chain, qs, branching, b, len(sequences[b]) + depth, generators[b]))
    levels, beams = read(growths, len(sequences))
    return levels, beams, [growths[b].qs if b in growths else [] for b in range(len(sequences))], passes


def read(growths: dict[int, Growth], rows: int) -> tuple[list[Levels], list[list[list[int]]]]:
    """Every row's levels and beams read to the host in one transfer (a row that did not draft: none)."""
    parts = {b: growth.parts() for b, growth in growths.items()}
    flat = [part for b in sorted(parts) for part in parts[b]]
    values = iter(torch.cat(flat).tolist() if flat else [])
    levels, beams = [[] for _ in range(rows)], [[] for _ in range(rows)]
    for b in sorted(parts):
        taken = [[next(values) for _ in range(len(part))] for part in parts[b]]
        depth_parts = taken[: 2 * len(growths[b].levels)]
        levels[b] = [([int(t) for t in tokens], factors)
                     for tokens, factors in zip(depth_parts[::2], depth_parts[1::2], strict=True)]
        beams[b] = [[int(i) for i in chosen] for chosen in taken[2 * len(growths[b].levels) :]]
    return levels, beams
