"""The acceptance rules of speculative decoding: pure functions of the target's scores and the drafts.

Shapes: k drafts, vocabulary V. `target_logits` / `p` hold k + 1 rows: row i scores the token after
the accepted prefix and the first i drafts, so the last row gives the bonus token when every draft
is accepted.
"""

from __future__ import annotations

import torch
from torch import Tensor

from utils.logits_processors import LogitsProcessor


def _leading_true(mask: Tensor) -> int:
    """Number of leading True values of a 1-D bool tensor."""
    return int(mask.long().cumprod(dim=0).sum())


def greedy_accept(target_logits: Tensor, drafts: Tensor) -> tuple[int, int]:
    """Greedy verification -> (n accepted drafts, the target's next token).

    A draft is accepted iff it equals the target's argmax at its position; the token emitted after
    the n accepted drafts is the target's argmax there (the correction, or the bonus token when all
    k drafts pass). The output is token-identical to greedy autoregressive decoding.
    target_logits: (k + 1, V); drafts: (k,) int64.
    """
    argmax = target_logits.argmax(dim=-1)
    n = _leading_true(argmax[: len(drafts)] == drafts)
    return n, int(argmax[n])


def speculative_accept(
    p: Tensor,
    q: Tensor | None,
    drafts: Tensor,
    processor: LogitsProcessor,
    generator: torch.Generator | None = None,
) -> tuple[int, int]:
    """Speculative sampling (Leviathan et al. 2023, Algorithm 1; Chen et al. 2023) -> (n, next token).

    p: (k + 1, V) the target's processed distributions; q: (k, V) the drafter's processed
    distributions, or None for a deterministic drafter (an n-gram pool), whose q is one-hot at each
    draft. Draft x_i is accepted with probability min(1, p_i(x_i) / q_i(x_i)); at the first
    rejection the next token is drawn from normalize(max(0, p_i - q_i)), which for a one-hot q is p_i
    with x_i removed; if all k pass, the bonus token is drawn from p_k. The output then follows p
    exactly, whatever q is.
    """
    k = len(drafts)
    rows = torch.arange(k, device=p.device)
    p_x = p[rows, drafts]
    q_x = q[rows, drafts] if q is not None else torch.ones_like(p_x)
    r = torch.rand(k, generator=generator, device=p.device, dtype=p.dtype)
    n = _leading_true(r * q_x < p_x)  # r < p/q, without dividing by q
    if n == k:
        return n, int(processor.sample(p[k], generator))
    if q is not None:
        q_n = q[n]
    else:
        q_n = torch.zeros_like(p[n])
        q_n[drafts[n]] = 1.0
    residual = (p[n] - q_n).clamp(min=0)
    total = residual.sum()
    # In exact arithmetic a rejection implies p_n != q_n, so the residual has mass; guard rounding.
    residual = residual / total if total > 0 else p[n]
    return n, int(torch.multinomial(residual, 1, generator=generator))


# Token trees: several candidate continuations per node, verified in one pass. A tree of n nodes is
# `tokens` (n,) and `parents` (n,), parents[i] < i, -1 for a child of the root (the last accepted
# token); row 0 of the target's scores is at the root, row 1 + i after node i. A chain is the tree
# with parents = [-1, 0, 1, ...].


def _children(parents: list[int]) -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(parents):
        children.setdefault(parent, []).append(node)
    return children


def greedy_accept_tree(target_logits: Tensor, tokens: list[int], parents: list[int]) -> tuple[list[int], int]:
    """Greedy verification of a draft tree -> (accepted nodes from the root down, the target's next token).

    From the root, move to the child whose token is the target's argmax there, while there is one;
    the next token is the argmax at the last node reached. Token-identical to greedy decoding.
    target_logits: (1 + n, V).
    """
    argmax = target_logits.argmax(dim=-1).tolist()
    children = _children(parents)
    path, node = [], -1
    while True:
        wanted = argmax[node + 1]
        node = next((child for child in children.get(node, []) if tokens[child] == wanted), None)
        if node is None:
            return path, wanted
        path.append(node)


def speculative_accept_tree(
    p: Tensor, tokens: list[int], parents: list[int], generator: torch.Generator | None = None
) -> tuple[list[int], int]:
    """Multi-candidate speculative sampling of a tree of deterministic drafts (SpecInfer, Miao et al.
    2024) -> (accepted nodes from the root down, next token).

    At a node whose children propose distinct tokens x1, x2, ...: accept x1 with probability p(x1);
    if rejected, remove x1 from p and renormalise, accept x2 with the new p(x2); and so on; if every
    candidate is rejected, the next token is drawn from p with all of them removed. Each token y is
    then emitted with probability p(y) (the rejections' (1 - p(x1)) factors cancel the
    renormalisations), so the output follows p exactly; an accepted child continues in its subtree
    with its own row of p. p: (1 + n, V) processed distributions.
    """
    children = _children(parents)
    path, node = [], -1
    while True:
        residual = p[node + 1].clone()
        for child in children.get(node, []):
            x = tokens[child]
            if float(torch.rand((), generator=generator, dtype=p.dtype, device=p.device)) < float(residual[x]):
                path.append(child)
                node = child
                break
            residual[x] = 0.0
            total = residual.sum()
            # In exact arithmetic a rejection leaves mass elsewhere; guard rounding.
            residual = residual / total if total > 0 else p[node + 1]
        else:
            return path, int(torch.multinomial(residual, 1, generator=generator))
