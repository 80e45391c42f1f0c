"""Each benchmarked method learns from its own runs only. What the policy learns across generations (each pair's
`PairRecord`, `sampling/policy/draft_confidence.py`; its `ShapeRecord`s, `sampling/policy/tree_choice.py`) is kept per
(drafter, target), so methods that share a drafter (the self-drafter's chains and its default; SD with and without
trees) would share it, and the later one on a prompt would draft from what the earlier had just learned on that very
prompt: in a rotating order with the self-drafter's default before its chains on two prompts of three, its chains
read 1.02-1.03x it with no tree drafted by either; kept apart, 1.01x (a 2-vCPU AMD EPYC Zen 4, twenty-eighth round,
docs/results.md).
`learned_apart(method)` gives the method its own stores for a run, as a process that runs it alone would have."""

from __future__ import annotations

import contextlib
import weakref

from sampling.policy.draft_confidence import use_pair_records
from sampling.policy.tree_choice import use_shape_records

__all__ = ["learned_apart"]

_APART: dict[str, tuple[weakref.WeakKeyDictionary, weakref.WeakKeyDictionary]] = {}


@contextlib.contextmanager
def learned_apart(method: str):
    """The pairs' records kept apart for `method` in the block (each method's own, kept across its runs)."""
    stores = _APART.setdefault(method, (weakref.WeakKeyDictionary(), weakref.WeakKeyDictionary()))
    pairs, shapes = use_pair_records(stores[0]), use_shape_records(stores[1])
    try:
        yield
    finally:
        use_pair_records(pairs)
        use_shape_records(shapes)
