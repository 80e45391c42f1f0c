"""Drafters written outside the library: the `Drafter` protocol checked at the door (docs/drafters.md).

`speculative_generate(inputs, my_drafter, target, ...)` takes any object with the batch form of the
protocol. `check_drafter` refuses one that lacks a part before any model runs; `CheckedDrafter`
wraps it for the loop, checks every draft it returns (a wrong draft raises a ValueError naming
the row and what is wrong, instead of a wrong answer or an index error deep in the loop) and
cuts a tree to its first branch where the target verifies chains only.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import PreTrainedModel

from sampling.drafters.model_drafter import DRAFT_TIME_WEIGHT
from sampling.drafters.registry import register_kind
from sampling.loop.common import Generation, Request
from sampling.loop.drafts import Draft, DraftTree
from sampling.loop.options import DecodingOptions, Drafting
from sampling.policy.draft_policy import MAX_ADAPTIVE_GAMMA, CostAwareDraftLength, DraftLength
from sampling.policy.estimators import RunningAverage
from utils.runners.model_info import vocab_size
from utils.validation import check_bool

DRAFTER_METHODS = ("start", "draft", "update", "select_rows")


def check_drafter(drafter: object) -> None:
    """A TypeError naming every missing part, unless `drafter` has the whole `Drafter` protocol."""
    missing = [f"{name}()" for name in DRAFTER_METHODS if not callable(getattr(drafter, name, None))]
    if not hasattr(drafter, "forward_passes"):
        missing.append("forward_passes (an int attribute: 0 for a drafter without a model)")
    if missing:
        raise TypeError(
            f"drafter must be a transformers PreTrainedModel or an object with the Drafter protocol "
            f"(sampling.Drafter, docs/drafters.md); {type(drafter).__name__} lacks {', '.join(missing)}"
        )
    passes = drafter.forward_passes
    if isinstance(passes, bool) or not isinstance(passes, int):
        raise TypeError(f"drafter.forward_passes must be an int, got {passes!r}")


def checked_drafter(drafter: object, target: PreTrainedModel, gen: Generation) -> CheckedDrafter:
    """A drafter object (checked by `check_drafter`) as the loop over `gen`'s target sees it."""
    return CheckedDrafter(drafter, vocab=vocab_size(target), trees=gen.runner.supports_trees)


def first_branch(tree: DraftTree) -> DraftTree:
    """The chain of a tree's first children, from the root down (a chain is its own first branch)."""
    tokens, node = [], -1
    for child, parent in enumerate(tree.parents):
        if parent == node:
            tokens.append(tree.tokens[child])
            node = child
    return DraftTree.chain(tokens)


def check_draft(tree: object, q: object, *, row: int, max_drafts: int, max_depth: int, vocab: int) -> None:
    """One row's (tree, q) as `Drafter.draft` must return it, or a ValueError/TypeError saying why not."""
    where = f"drafter.draft(...)[{row}]"
    if not isinstance(tree, DraftTree):
        raise TypeError(f"{where} must be a (DraftTree, q or None) pair, got a {type(tree).__name__} for the tree")
    if len(tree.parents) != len(tree.tokens):
        raise ValueError(f"{where}: the tree has {len(tree.tokens)} tokens but {len(tree.parents)} parents")
    if len(tree) > max_drafts:
        raise ValueError(f"{where}: the tree has {len(tree)} nodes, more than max_drafts = {max_drafts}")
    for node, (token, parent) in enumerate(zip(tree.tokens, tree.parents, strict=True)):
        if isinstance(token, bool) or not isinstance(token, int):
            raise TypeError(f"{where}: tokens must be Python ints (a tensor's .tolist()), found {token!r}")
        if not 0 <= token < vocab:
            raise ValueError(f"{where}: token {token} is outside the target's vocabulary [0, {vocab})")
        if isinstance(parent, bool) or not isinstance(parent, int) or not -1 <= parent < node:
            raise ValueError(f"{where}: parents[{node}] must be -1 (the root) or a node before it, got {parent!r}")
    siblings = {(parent, token) for token, parent in zip(tree.tokens, tree.parents, strict=True)}
    if len(siblings) < len(tree):
        raise ValueError(f"{where}: two children of one node propose the same token; siblings must differ")
    if tree.depth() > max_depth:
        raise ValueError(f"{where}: the tree is {tree.depth()} deep, deeper than max_depths[{row}] = {max_depth}")
    if q is None:
        return
    if not isinstance(q, Tensor):
        raise TypeError(f"{where}: q must be None or a tensor (len(tree), V), got {type(q).__name__}")
    if not tree.is_chain:
        raise ValueError(f"{where}: q is for a chain of sampled drafts; a tree must be deterministic (q None)")
    if tuple(q.shape) != (len(tree), vocab):
        raise ValueError(f"{where}: q must have shape (len(tree), V) = ({len(tree)}, {vocab}), got {tuple(q.shape)}")


class CheckedDrafter:
    """An outside `Drafter` as the loop sees it: each draft checked (`check_draft`), each row's
    sequence handed over as a copy (the drafter may keep or change it), and trees cut to their
    first branch when the target cannot verify a tree in one pass (`trees` False: an
    encoder-decoder target, no cache, flash attention). Cutting keeps the output exact: it only
    drafts fewer nodes."""

    def __init__(self, drafter, *, vocab: int, trees: bool) -> None:
        self.drafter = drafter
        self.vocab = vocab
        self.trees = trees
        self.draft_time = RunningAverage(DRAFT_TIME_WEIGHT)

    @property
    def forward_passes(self) -> int:
        return int(self.drafter.forward_passes)

    def start(self, sequences: list[list[int]]) -> None:
        self.drafter.start([list(sequence) for sequence in sequences])

    @property
    def seconds_per_draft(self) -> float | None:
        """What a drafted node costs, in seconds, timed over its steps (None before any drafted)."""
        return self.draft_time.value

    def counters(self) -> dict[str, float]:
        """Its own counters for `SpeculativeStats`: the drafter's `counters()`, if it has one."""
        counters = getattr(self.drafter, "counters", None)
        return dict(counters()) if callable(counters) else {}

    def draft(self, sequences, max_drafts, max_depths):
        start = time.perf_counter()
        drafts = self.drafter.draft([list(sequence) for sequence in sequences], max_drafts, list(max_depths))
        seconds = time.perf_counter() - start
        if not isinstance(drafts, (list, tuple)) or len(drafts) != len(sequences):
            got = f"{len(drafts)} items" if isinstance(drafts, (list, tuple)) else type(drafts).__name__
            raise ValueError(f"drafter.draft must return a list of one (DraftTree, q or None) per row "
                             f"({len(sequences)} rows), got {got}")
        checked = []
        for row, draft in enumerate(drafts):
            if not isinstance(draft, tuple) or len(draft) != 2:
                raise TypeError(f"drafter.draft(...)[{row}] must be a (DraftTree, q or None) pair, got {draft!r}")
            tree, q = draft
            check_draft(tree, q, row=row, max_drafts=max_drafts, max_depth=max(0, max_depths[row]), vocab=self.vocab)
            if not self.trees and not tree.is_chain:
                tree = first_branch(tree)
            checked.append(Draft(tree, q))
        if any(len(tree) for tree, _ in checked):
            self.draft_time.add(seconds / max(len(tree) for tree, _ in checked))
        return checked

    def update(self, sequences, paths, target_logits, p) -> None:
        self.drafter.update([list(sequence) for sequence in sequences], paths, target_logits, p)

    def select_rows(self, keep: list[int]) -> None:
        self.drafter.select_rows(list(keep))


@dataclass(frozen=True, kw_only=True)
class CustomOptions:
    """Your own drafter's options. `adaptive_gamma`: each step's budget chosen by the cost-aware
    rule (`sampling.policy.draft_policy.CostAwareDraftLength`) from the drafter's timed drafting and the
    target's measured passes, its acceptance rate learned online; off: `gamma` every step."""

    adaptive_gamma: bool = False

    def __post_init__(self) -> None:
        check_bool(self.adaptive_gamma, "adaptive_gamma")


class CustomDrafterKind:
    """Your own `Drafter` (`speculative_generate(inputs, my_drafter, target)`): the step's budget
    of nodes at most (it may propose fewer: it knows best how sure it is)."""

    Options = CustomOptions
    what = "an object with the Drafter protocol (sampling.Drafter, docs/drafters.md)"
    refusals = {
        "drafter_tokenizer": "a Drafter object proposes the target's token ids",
        "branching": "your own Drafter shapes its own drafts (DraftTree)",
        "drafter_invariant": "a Drafter object's drafts with q None are already decided by the coupled rule",
        "cascade": "the cascade drafts for a drafter model; a Drafter object drafts on its own",
        "ngram": "ngram= combines a pool with a drafter model; a Drafter object drafts alone",
    }

    def takes(self, drafter: object, given: dict[str, object]) -> bool:
        parts = (*DRAFTER_METHODS, "forward_passes")
        return not isinstance(drafter, torch.nn.Module) and any(hasattr(drafter, name) for name in parts)

    def check(self, request: Request, shared: DecodingOptions, drafter: object,
              options: CustomOptions) -> Callable[[Generation], Drafting]:
        check_drafter(drafter)

        def build(gen: Generation) -> Drafting:
            checked = checked_drafter(drafter, request.model, gen)
            policy = shared.draft_policy or (
                CostAwareDraftLength(max(shared.gamma, MAX_ADAPTIVE_GAMMA), gen.runner.costs, None,
                                     draft_seconds=lambda: checked.seconds_per_draft)
                if options.adaptive_gamma else DraftLength(shared.gamma))
            return Drafting(checked, policy, checked.counters)

        return build


register_kind(CustomDrafterKind())
