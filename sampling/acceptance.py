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
