"""Sampling verification of a token tree whose children were sampled from the drafter's q without
replacement: recursive rejection sampling (Jeon et al. 2024, "Recursive Speculative Decoding";
Yang et al. 2024, "Multi-candidate speculative decoding").

At a reached node with target distribution p and children c_1, c_2, ... drawn one after the other
from q without replacement (c_i from q_i = q without c_1..c_{i-1}, renormalised), try them in that
order: accept c_i with probability min(1, p_i(c_i) / q_i(c_i)); on a rejection
p_{i+1} = normalize(max(p_i - q_i, 0)) and the next child is tried; when every child is rejected
the token is drawn from the last residual (a leaf: from p). Each try is Leviathan et al.'s step
with proposal q_i, and c_i given the earlier children is exactly a draw from q_i, so the emitted
token follows p (by induction from the last child), whatever the number of children.

Why this rule and not SpecInfer's i.i.d. children (accept x_i with min(1, p/q), residual against
the same q): drawn i.i.d., two children may be the same token, and the second copy is then
rejected for sure (its residual mass is 0) while it still costs a node of the verification pass
and must stay in the tree (dropping it changes the residuals). Without replacement every child is
a new token, the siblings of `DraftTree` are distinct, and Jeon et al. show it accepts more.

Exactness needs one more thing of the tree's shape: whether child c_i is in the tree must not
depend on c_i's own value (nor on its later siblings'). `sampling/drafters/model_tree.py` ranks children
by scores known before they are drawn (the i-th largest probability of q); see its docstring.

Random numbers: a tree step starting at generated position t draws every number it needs from a
generator seeded by a number that position owns (`step_generator`): DRAFT's for the children,
ACCEPT's for the coins and the residual draws. No other step reads those two numbers of t (a
chain step reads DRAFT and ACCEPT only at the positions it drafts, which start after the last
emitted token), so steps never share a random number, and a seed reproduces the output.
"""

from __future__ import annotations

import torch
from torch import Tensor

from sampling.loop.drafts import DraftTree, children_of
from sampling.loop.randomness import ACCEPT, PositionUniforms, inverse_cdf

SEED_SCALE = 2**53  # a uniform number in [0, 1) -> a generator seed


def step_generator(uniforms: PositionUniforms, position: int, stream: int) -> torch.Generator:
    """The generator of the tree step whose first draft is generated position `position`, for one
    use (`stream`: DRAFT for the drafter's children, ACCEPT for the verification)."""
    return torch.Generator().manual_seed(int(uniforms(position, stream) * SEED_SCALE))


def recursive_rejection_walk(p: Tensor, q: Tensor, tree: DraftTree, coins: list[float] | Tensor,
                             residual_numbers: list[float] | Tensor) -> tuple[list[int], int]:
    """Recursive rejection sampling down `tree` -> (accepted nodes root to leaf, the next token).

    p: (1 + n, V) the target's processed distributions (row 0 at the root, 1 + i after node i);
    q: (n, V), row i the drafter's distribution node i was drawn from (its parent's), so siblings
    share one row; siblings are tried in node order, their draw order. coins: n numbers in [0, 1),
    one per node; residual_numbers: one per depth, for the emitted token (floats, or a float64 tensor
    of them). Pure.

    Every node's verdicts are computed on p's device first (`sibling_verdicts`) and read back in one
    transfer; the walk then follows them from the root (`walk_verdicts`)."""
    return walk_verdicts(tree, sibling_verdicts(p, q, tree, coins, residual_numbers).tolist())


def sibling_verdicts(p: Tensor, q: Tensor, tree: DraftTree, coins: list[float] | Tensor,
                     residual_numbers: list[float] | Tensor) -> Tensor:
    """For every node of `tree` (the root first), its children tried in order as the walk would
    try them there -> (2 n + 1,) int64 on p's device: per child, in `walk_verdicts`'s order, 1 where it is
    accepted if tried; then per node 1 + i (0: the root) the token emitted if every child of it is rejected.

    A child x is accepted with probability min(1, p(x) / q(x)) (coin * q(x) < p(x), in float64);
    after a rejection p becomes the residual max(0, p - q) renormalised (p unchanged where it has no
    mass: rounding) and q loses x, renormalised: the numbers a walk that reaches that node uses."""
    children = children_of(tree.parents)
    flags, emitted = [], []
    depths = [0] * (len(tree) + 1)  # 1 + node -> its depth (the root: 0)
    for node, parent in enumerate(tree.parents):
        depths[node + 1] = depths[parent + 1] + 1
    for node in range(-1, len(tree)):
        p_i, kids = p[node + 1], children.get(node, [])
        q_i = q[kids[0]].to(p.device, p.dtype) if kids else None
        for child in kids:
            x = tree.tokens[child]
            q_i = q_i / q_i.sum()  # q without the children tried before, renormalised
            flags.append(coins[child] * q_i[x].double() < p_i[x].double())
            residual = (p_i - q_i).clamp(min=0)
            total = residual.sum()
            p_i = torch.where(total > 0, residual / total, p_i)
            q_i = q_i.clone()
            q_i[x] = 0.0  # the next child is drawn without this one
        emitted.append(inverse_cdf(p_i, residual_numbers[depths[node + 1]]))
    return torch.cat([torch.stack(flags).long() if flags else emitted[0].new_empty(0), torch.stack(emitted)])


def walk_verdicts(tree: DraftTree, values: list[int]) -> tuple[list[int], int]:
    """`sibling_verdicts` read to the host -> the walk from the root: (accepted nodes root to leaf, the next
    token)."""
    children = children_of(tree.parents)
    order = [child for node in range(-1, len(tree)) for child in children.get(node, [])]
    accepted = [False] * len(tree)
    for i, child in enumerate(order):
        accepted[child] = bool(values[i])
    tokens = values[len(order):]
    path, node = [], -1
    while True:
        node = next((child for child in children.get(node, []) if accepted[child]), None)
        if node is None:
            return path, tokens[path[-1] + 1 if path else 0]
        path.append(node)


def tree_verdicts(p: Tensor, q: Tensor, tree: DraftTree, uniforms: PositionUniforms, position: int) -> Tensor:
    """`sibling_verdicts` with the step's own numbers (`step_generator`, ACCEPT), on the device, for the step's one
    host transfer (`walk_verdicts` then follows them). `position`: the generated position of the root's children."""
    generator = step_generator(uniforms, position, ACCEPT)
    # Kept a tensor: each number is used on the device (float64 either way), not read to the host.
    numbers = torch.rand(len(tree) + tree.depth() + 1, generator=generator, dtype=torch.float64)
    return sibling_verdicts(p, q, tree, numbers[: len(tree)], numbers[len(tree) :])
