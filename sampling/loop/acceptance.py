"""The acceptance rules of speculative decoding: pure functions of the target's scores and the drafts.

Shapes: k drafts, vocabulary V. `p` holds k + 1 rows: row i scores the token after the accepted
prefix and the first i drafts, so the last row gives the bonus token when every draft is accepted.
Random numbers come by position (`sampling.loop.randomness`): the token at generated position t uses
the numbers of t, whichever step emits it.

Token trees: several candidate continuations per node, verified in one pass. A tree of n nodes is
`tokens` (n,) and `parents` (n,), parents[i] < i, -1 for a child of the root (the last accepted
token); row 0 of the target's scores is at the root, row 1 + i after node i. A chain is the tree
with parents = [-1, 0, 1, ...].
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor

from sampling.loop.drafts import Draft, DraftTree, children_of
from sampling.loop.randomness import ACCEPT, TARGET, PositionUniforms, inverse_cdf
from sampling.loop.tree_sampling import tree_verdicts, walk_verdicts
from utils.logits_processors import LogitsProcessor, supports_float64


class Verdict(NamedTuple):
    """The target's decision on one row's `Draft`: `path`, the accepted nodes from the root down;
    `token`, the target's own token after them (the bonus token, or the recovered one at the first
    rejection); `p`, the target's processed distributions at the verification's rows
    (1 + len(tree), V), None when greedy."""

    path: list[int]
    token: int
    p: Tensor | None


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
    children = children_of(parents)
    path, node = [], -1
    while True:
        wanted = choose(node + 1, len(path))
        node = next((child for child in children.get(node, []) if tokens[child] == wanted), None)
        if node is None:
            return path, wanted
        path.append(node)


def coupled_choices(p: Tensor, starts: list[int], trees: list[DraftTree], uniforms: list[PositionUniforms],
                    positions: list[int]) -> Tensor:
    """The coupled rule's decisions for trees of deterministic drafts, on the device: the target's
    token at every row of each tree's scores (row 0 at the root, 1 + i after node i), F^{-1}(u) of
    its row of p (flattened, tree b's rows from `starts[b]`) at the uniform of its generated
    position `positions[b]` + its depth, as plain sampling would draw it -> (sum of 1 + n_b,)
    int64. `walk_tree` then follows the nodes that propose them."""
    depths = [_tree_depths(tree) for tree in trees]
    rows = torch.tensor([start + i for start, d in zip(starts, depths, strict=True) for i in range(len(d))],
                        dtype=torch.long, device=p.device)
    u = torch.cat([u_b.span(t, 1 + max(d), TARGET)[d] for u_b, t, d in zip(uniforms, positions, depths, strict=True)])
    return inverse_cdf(p[rows], u)


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


def _tree_depths(tree: DraftTree) -> list[int]:
    """The depth of each row of a verification pass's scores: 0 at the root, then each node's."""
    depths = [0]
    for parent in tree.parents:
        depths.append(1 + depths[parent + 1])
    return depths


def speculative_rows(p: Tensor, starts: list[int], trees: list[DraftTree], qs: list[Tensor],
                      uniforms: list[PositionUniforms], positions: list[int]) -> tuple[Tensor, Tensor]:
    """Speculative sampling (Leviathan et al. 2023, Algorithm 1) for R sampled chains at once, on the device ->
    (n (R,), next token (R,)), int64.

    p: every row's target distributions, flattened (sum of 1 + k_i, V), chain i's from `starts[i]`;
    `qs[i]`: (k_i, V), moved to p's device. The drafts are flattened with offsets (vLLM's
    `cu_num_draft_tokens`), the leading accepted drafts counted per chain; n and the token are
    computed on the device (the bonus case is the residual against q = 0)."""
    device, lengths = p.device, [len(tree) for tree in trees]
    row_of = [i for i, k in enumerate(lengths) for _ in range(k)]
    column = [j for k in lengths for j in range(k)]
    p_rows = torch.tensor([starts[i] + j for i, j in zip(row_of, column, strict=True)], device=device)
    drafts = torch.tensor([token for tree in trees for token in tree.tokens], dtype=torch.long, device=device)
    q = torch.cat([q_i.to(device) for q_i in qs])
    p_x, q_x = p[p_rows, drafts], q[torch.arange(len(drafts), device=device), drafts]
    r = torch.cat([u.span(t, k, ACCEPT) for u, t, k in zip(uniforms, positions, lengths, strict=True)])
    passed = torch.zeros(len(trees), max(lengths), dtype=torch.long, device=device)
    passed[row_of, column] = (r.to(p.dtype).to(device) * q_x < p_x).long()  # r < p/q without dividing by q
    n = passed.cumprod(dim=1).sum(dim=1)  # leading accepted drafts of each row
    k = torch.tensor(lengths, device=device)
    q_starts = torch.tensor([0, *itertools.accumulate(lengths)][:-1], device=device)
    q_n = q[q_starts + torch.minimum(n, k - 1)] * (n < k)[:, None]  # q at the first rejection; zero if none
    p_n = p[torch.tensor(starts, device=device) + n]
    residual = (p_n - q_n).clamp(min=0)
    residual = torch.where(residual.sum(dim=-1, keepdim=True) > 0, residual, p_n)  # guard rounding
    u = torch.stack([torch.nn.functional.pad(un.span(t, k_i + 1, TARGET), (0, max(lengths) - k_i))
                     for un, t, k_i in zip(uniforms, positions, lengths, strict=True)])
    u = u.to(torch.float64 if supports_float64(device) else torch.float32).to(device)
    return n, inverse_cdf(residual, u[torch.arange(len(trees), device=device), n])


def accept_rows(
    logits: list[Tensor], drafts: list[Draft], sequences: list[list[int]], processor: LogitsProcessor,
    uniforms: list[PositionUniforms],
) -> list[Verdict]:
    """Step 3 of the loop for every row of a batch at once, with one host transfer -> a `Verdict` per row.

    logits[b]: (1 + len(drafts[b].tree), V), the target's scores at row b's last accepted token and after
    every node; `sequences[b]`: its prefix and every token generated so far. Greedy: the argmax
    path. Sampling: deterministic drafts (q None) by the coupled rule, a model drafter's chain (q
    its distributions) by speculative sampling, a drafter model's tree (q per node) by recursive
    rejection sampling (`sampling.loop.tree_sampling`). An empty tree is a plain decoding step.
    The rows' scores are flattened with offsets and decided on the device; the walks down the trees
    read the decided tokens on the host, every row's in one transfer.
    """
    trees, qs = [draft.tree for draft in drafts], [draft.q for draft in drafts]
    scores = [row_scores(x, tree, sequence, processor) for x, tree, sequence in zip(logits, trees, sequences, strict=True)]
    sizes = [len(s) for s in scores]
    starts = [0, *itertools.accumulate(sizes)][:-1]
    flat = torch.cat(scores)
    if processor.is_greedy:
        choice = flat.argmax(dim=-1).tolist()
        return [Verdict(*walk_tree(tree.tokens, tree.parents, lambda row, depth, s=start: choice[s + row]), None)
                for tree, start in zip(trees, starts, strict=True)]
    p = flat.softmax(dim=-1)
    positions = [len(sequence) - u.prefix_length for sequence, u in zip(sequences, uniforms, strict=True)]
    with_q = [b for b, (tree, q) in enumerate(zip(trees, qs, strict=True)) if q is not None and len(tree)]
    sampled = [b for b in with_q if trees[b].is_chain]
    model_trees = [b for b in with_q if not trees[b].is_chain]  # children sampled without replacement
    coupled = [b for b in range(len(trees)) if b not in set(with_q)]
    decided = []  # on the device: the coupled rows' tokens, then the sampled chains' n and tokens
    if coupled:
        decided.append(coupled_choices(p, [starts[b] for b in coupled], [trees[b] for b in coupled],
                                       [uniforms[b] for b in coupled], [positions[b] for b in coupled]))
    if sampled:
        decided += speculative_rows(p, [starts[b] for b in sampled], [trees[b] for b in sampled],
                                    [qs[b] for b in sampled], [uniforms[b] for b in sampled],
                                    [positions[b] for b in sampled])
    ps, results, at = p.split(sizes), [None] * len(trees), 0
    decided += [tree_verdicts(ps[b], qs[b], trees[b], uniforms[b], positions[b]) for b in model_trees]
    values = torch.cat(decided).tolist() if decided else []  # the step's one host transfer
    for b in coupled:
        choice = values[at : at + sizes[b]]
        results[b] = Verdict(*walk_tree(trees[b].tokens, trees[b].parents, lambda row, depth, c=choice: c[row]), ps[b])
        at += sizes[b]
    for i, b in enumerate(sampled):
        n, token = values[at + i], values[at + len(sampled) + i]
        results[b] = Verdict(list(range(n)), token, ps[b])
    at += 2 * len(sampled)
    for b in model_trees:  # each walk's verdicts: one per node, then one per node and the root
        results[b] = Verdict(*walk_verdicts(trees[b], values[at : at + 2 * len(trees[b]) + 1]), ps[b])
        at += 2 * len(trees[b]) + 1
    return results

