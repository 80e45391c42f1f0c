"""The acceptance rules of speculative decoding: pure functions of the target's scores and the drafts.

Shapes: k drafts, vocabulary V. `p` holds k + 1 rows: row i scores the token after the accepted
prefix and the first i drafts, so the last row gives the bonus token when every draft is accepted.
Random numbers come by position (`sampling.randomness`): the token at generated position t uses
the numbers of t, whichever step emits it.

Token trees: several candidate continuations per node, verified in one pass. A tree of n nodes is
`tokens` (n,) and `parents` (n,), parents[i] < i, -1 for a child of the root (the last accepted
token); row 0 of the target's scores is at the root, row 1 + i after node i. A chain is the tree
with parents = [-1, 0, 1, ...].
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from sampling.drafters import DraftTree
from sampling.randomness import ACCEPT, TARGET, PositionUniforms, inverse_cdf
from sampling.tree_sampling import tree_speculative_accept
from utils.logits_processors import LogitsProcessor, supports_float64


def _children(parents: list[int]) -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(parents):
        children.setdefault(parent, []).append(node)
    return children


def walk_tree(tokens: list[int], parents: list[int], choose: Callable[[int, int], int]) -> tuple[list[int], int]:
    """Verification of deterministic drafts -> (accepted nodes from the root down, the target's next token).

    `choose(row, depth)` is the token the target emits at a row of its scores (row 0 at the root,
    1 + i after node i; depth 0 at the root): its argmax when greedy, its inverse-CDF sample at the
    position's uniform when sampling. From the root, move to the child proposing that token while
    there is one; the token chosen at the last node reached is the next token. Greedy: the output
    is token-identical to greedy decoding. Sampling: a candidate x is accepted with probability
    p(x), and otherwise the emitted token follows p without the candidates, renormalised: the law
    of (multi-candidate) speculative sampling with one-hot q, coupled with plain sampling.
    """
    children = _children(parents)
    path, node = [], -1
    while True:
        wanted = choose(node + 1, len(path))
        node = next((child for child in children.get(node, []) if tokens[child] == wanted), None)
        if node is None:
            return path, wanted
        path.append(node)


def greedy_accept_tree(target_logits: Tensor, tokens: list[int], parents: list[int]) -> tuple[list[int], int]:
    """Greedy verification of a draft tree (`walk_tree` along the argmax). target_logits: (1 + n, V)."""
    argmax = target_logits.argmax(dim=-1).tolist()
    return walk_tree(tokens, parents, lambda row, depth: argmax[row])


def coupled_accept_tree(
    p: Tensor, tokens: list[int], parents: list[int], uniforms: PositionUniforms, position: int
) -> tuple[list[int], int]:
    """Sampling verification of a tree of deterministic drafts (`walk_tree`): the target's token at
    depth d is F^{-1}(u_{position + d}) of its row of p (1 + n, V), as plain sampling would draw it."""
    return walk_tree(tokens, parents, lambda row, depth: int(inverse_cdf(p[row], uniforms(position + depth))))


def speculative_accept(
    p: Tensor, q: Tensor, drafts: Tensor, uniforms: PositionUniforms, position: int
) -> tuple[int, int]:
    """Speculative sampling (Leviathan et al. 2023, Algorithm 1; Chen et al. 2023) -> (n, next token).

    p: (k + 1, V) the target's processed distributions; q: (k, V) the drafter's, which its drafts
    were sampled from. Draft x_i (at generated position `position` + i) is accepted with probability
    min(1, p_i(x_i) / q_i(x_i)); at the first rejection the next token is drawn from
    normalize(max(0, p_i - q_i)); if all k pass, the bonus token is drawn from p_k. The output then
    follows p exactly, whatever q is.

    q (from a drafter on another device) is moved to p's. One host sync: n and the token are
    computed on the device and read together (the bonus case is the residual against q = 0).
    """
    k = len(drafts)
    q, drafts = q.to(p.device), drafts.to(p.device)
    rows = torch.arange(k, device=p.device)
    p_x, q_x = p[rows, drafts], q[rows, drafts]
    r = uniforms.span(position, k, ACCEPT).to(p.dtype).to(p.device)
    n = (r * q_x < p_x).long().cumprod(dim=0).sum()  # leading accepted drafts (r < p/q without dividing by q)
    q_n = q[n.clamp(max=k - 1)] * (n < k)  # q at the first rejection; zero when all k were accepted
    residual = (p[n] - q_n).clamp(min=0)
    # In exact arithmetic a rejection implies p_n != q_n, so the residual has mass; guard rounding.
    residual = torch.where(residual.sum() > 0, residual, p[n])
    u = uniforms.span(position, k + 1, TARGET)
    u = u.to(torch.float64 if supports_float64(p.device) else torch.float32).to(p.device)[n]
    n, token = torch.stack([n, inverse_cdf(residual, u)]).tolist()
    return n, token


def row_scores(logits: Tensor, tree: DraftTree, sequence: list[int], processor: LogitsProcessor) -> Tensor:
    """The processed scores (1 + n, V) of a verification pass: every row with its own history, the
    accepted `sequence` and the drafts on the path to it (what keeps history-dependent processors
    exact). The library's own processors read no history and process all rows at once."""
    if not processor.needs_history:
        return processor.scores(logits)
    if tree.is_chain:
        return processor.scores(logits, sequence + tree.tokens)
    return torch.cat([processor.scores(logits[row : row + 1], sequence + tree.path_to(row - 1))
                      for row in range(len(logits))])


def accept(
    logits: Tensor, tree: DraftTree, q: Tensor | None, sequence: list[int], processor: LogitsProcessor,
    uniforms: PositionUniforms,
) -> tuple[list[int], int, Tensor | None]:
    """Step 3 of the loop -> (accepted nodes root to leaf, the target's next token, p or None).

    logits: (1 + len(tree), V), the target's scores at the last accepted token and after every
    node; `sequence`: the prefix and every token generated so far. Greedy: the argmax path.
    Sampling: deterministic drafts (q None) by the coupled rule, a model drafter's chain (q its
    distributions) by speculative sampling, its tree by recursive rejection sampling
    (`sampling.tree_sampling`). An empty tree is a plain decoding step.
    """
    position = len(sequence) - uniforms.prefix_length  # the generated position of row 0's token
    scores = row_scores(logits, tree, sequence, processor)
    if processor.is_greedy:
        path, token = greedy_accept_tree(scores, tree.tokens, tree.parents)
        return path, token, None
    p = scores.softmax(dim=-1)
    if q is None or not len(tree):
        path, token = coupled_accept_tree(p, tree.tokens, tree.parents, uniforms, position)
        return path, token, p
    if not tree.is_chain:  # a drafter model's tree, its children sampled without replacement
        path, token = tree_speculative_accept(p, q, tree, uniforms, position)
        return path, token, p
    draft_ids = torch.tensor(tree.tokens, dtype=torch.long, device=logits.device)
    n, token = speculative_accept(p, q, draft_ids, uniforms, position)
    return list(range(n)), token, p
