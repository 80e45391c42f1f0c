"""What the loop knows of a drafter: the draft tree it proposes (a row's `Draft`: its tree and q), the `Drafter` protocol, and `PerRow`
(a batch drafter made of single-row ones). The loop in `sampling/loop/speculative_loop.py` only talks
to this interface, so a small model (`sampling/drafters/`) and an n-gram pool (`ngram_assisted/`) plug
into the same draft -> verify -> accept loop."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Protocol

from torch import Tensor


def children_of(parents: list[int]) -> dict[int, list[int]]:
    """A tree given by its parents (-1: the root) -> each node's children, in node order."""
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(parents):
        children.setdefault(parent, []).append(node)
    return children


@dataclass(frozen=True)
class DraftTree:
    """Drafted tokens as a tree: node i proposes `tokens[i]` after its parent, `parents[i]` < i
    (-1: after the last accepted token). Siblings propose distinct tokens. A chain, what a model
    drafter proposes, has parents [-1, 0, 1, ...]."""

    tokens: list[int]
    parents: list[int]

    @classmethod
    def chain(cls, tokens: list[int]) -> DraftTree:
        return cls(list(tokens), list(range(-1, len(tokens) - 1)))

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        return all(parent == node - 1 for node, parent in enumerate(self.parents))

    def path_to(self, node: int) -> list[int]:
        """The tokens from the root's first child down to `node` (none for -1)."""
        path = []
        while node >= 0:
            path.append(self.tokens[node])
            node = self.parents[node]
        return path[::-1]

    def depth(self) -> int:
        depths: list[int] = []
        for parent in self.parents:
            depths.append(1 + (depths[parent] if parent >= 0 else 0))
        return max(depths, default=0)


class Draft(NamedTuple):
    """One row's drafts for a step: `tree` (a chain, or a tree of candidates) and `q`, the drafter's
    processed distributions (len(tree), V) a sampled chain's drafts were drawn from, or None for
    deterministic drafts. A plain `(tree, q)` tuple is read the same way (the loop makes it a `Draft`)."""

    tree: DraftTree
    q: Tensor | None = None


class Drafter(Protocol):
    """What the speculative loop needs from a source of drafts, for the rows of a batch (one row:
    one sequence). Lists go by row, in the order of the rows still decoding.

    `sequences[b]` is always row b's whole accepted sequence (decoder prefix + generated tokens).
    """

    forward_passes: int  # model forward passes spent drafting (0 for an n-gram pool)

    def start(self, sequences: list[list[int]]) -> None:
        """A new generation begins with these prompts."""

    def draft(self, sequences: list[list[int]], max_drafts: int, max_depths: list[int]) -> list[Draft]:
        """For each row, up to `max_drafts` (possibly 0) nodes, no path deeper than `max_depths[b]`
        (what fits before `max_gen_len`) -> a `Draft` (or a plain (tree, q) tuple) per row.

        q: (len(tree), V) the processed distributions a chain's drafts were sampled from, or None
        when the drafts are deterministic (q one-hot) or the processor is greedy. A drafter of your
        own proposes trees of deterministic drafts only (q None); the library's drafter model also
        proposes sampled trees, row i of q node i's distribution, siblings drawn without replacement
        (`sampling/drafters/model_tree.py`, verified by `sampling/loop/tree_sampling.py`).
        """

    def update(self, sequences: list[list[int]], paths: list[list[int]], target_logits: list[Tensor],
               p: list[Tensor | None]) -> None:
        """Row b's target accepted the nodes `paths[b]` (root to leaf) of its last tree; its sequence
        now ends with their tokens and the target's own. `target_logits[b]`: (1 + len(tree), V), the
        target's scores at the root (row 0) and after every node i (row 1 + i), accepted or not;
        `p[b]`: the same rows processed (None when greedy)."""

    def select_rows(self, keep: list[int]) -> None:
        """Only the rows `keep` go on decoding."""


class PerRow:
    """A batch `Drafter` made of one single-row drafter per row (the n-gram drafters: each row
    drafts from its own pool, or all from one shared pool, and teaches it)."""

    def __init__(self, drafters: list) -> None:
        self.drafters = drafters

    @property
    def forward_passes(self) -> int:
        return sum(drafter.forward_passes for drafter in self.drafters)

    def start(self, sequences: list[list[int]]) -> None:
        for drafter, sequence in zip(self.drafters, sequences, strict=True):
            drafter.start(sequence)

    def draft(self, sequences, max_drafts, max_depths):
        return [drafter.draft(sequence, max_drafts, max_depth)
                for drafter, sequence, max_depth in zip(self.drafters, sequences, max_depths, strict=True)]

    def update(self, sequences, paths, target_logits, p) -> None:
        for drafter, *row in zip(self.drafters, sequences, paths, target_logits, p, strict=True):
            drafter.update(*row)

    def select_rows(self, keep: list[int]) -> None:
        self.drafters = [self.drafters[b] for b in keep]
