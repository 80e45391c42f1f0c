"""Logits processors: turn the logits of one position into the distribution to sample from.

Each processor is a pure function of its input (nothing is modified in place) with the same
filtering semantics as transformers' temperature, top-k and top-p warpers, applied in that order.
At least one token is always kept, so the distribution is never empty.

    probs = processor(logits)                 # (..., vocab) -> (..., vocab), rows sum to 1
    token = processor.sample(probs, generator) # (..., vocab) -> (...,) token ids
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

__all__ = [
    "LogitsProcessor",
    "GreedyProcessor",
    "MultinomialProcessor",
    "TopKProcessor",
    "NucleusProcessor",
    "TopKNucleusProcessor",
]


def _check_temperature(temperature: float) -> float:
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(f"temperature must be a number, got {temperature!r}")
    if not math.isfinite(temperature) or temperature <= 0:
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    return float(temperature)


def _check_top_k(top_k: int) -> int:
    if isinstance(top_k, bool) or not isinstance(top_k, int):
        raise TypeError(f"top_k must be an int, got {top_k!r}")
    if top_k < 1:
        raise ValueError(f"top_k must be >= 1, got {top_k!r}")
    return top_k


def _check_top_p(top_p: float) -> float:
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)):
        raise TypeError(f"top_p must be a number, got {top_p!r}")
    if not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    return float(top_p)


def top_k_filter(logits: Tensor, top_k: int) -> Tensor:
    """Mask (to -inf) every logit below the k-th largest of its row; ties with it are kept.

    logits: (..., vocab). Returns a new tensor of the same shape.
    """
    top_k = min(top_k, logits.shape[-1])
    kth_value = torch.topk(logits, top_k, dim=-1).values[..., -1:]
    return logits.masked_fill(logits < kth_value, -math.inf)


def top_p_filter(logits: Tensor, top_p: float) -> Tensor:
    """Keep the smallest set of most likely tokens whose probability mass reaches `top_p`.

    Same rule as transformers' TopPLogitsWarper: sort ascending, drop the tokens whose cumulative
    probability is <= 1 - top_p, always keep the most likely token. logits: (..., vocab).
    """
    if top_p >= 1.0:
        return logits
    sorted_logits, sorted_indices = torch.sort(logits, descending=False, dim=-1)
    cumulative_probs = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    sorted_to_remove = cumulative_probs <= (1 - top_p)
    sorted_to_remove[..., -1:] = False
    to_remove = sorted_to_remove.scatter(-1, sorted_indices, sorted_to_remove)
    return logits.masked_fill(to_remove, -math.inf)


class LogitsProcessor:
    """Base class: `filter` the tempered logits, softmax them, sample from the result.

    Subclasses override `filter`. `is_greedy` tells the decoding loops that they may take the exact
    argmax shortcut (greedy acceptance) instead of rejection sampling.
    """

    is_greedy = False

    def __init__(self, temperature: float = 1.0) -> None:
        self.temperature = _check_temperature(temperature)

    def filter(self, logits: Tensor) -> Tensor:
        """Tempered logits -> filtered logits (-inf where a token is removed). Pure."""
        return logits

    def __call__(self, logits: Tensor) -> Tensor:
        """Logits (..., vocab) -> processed probabilities (..., vocab). The input is not modified."""
        return self.filter(logits / self.temperature).softmax(dim=-1)

    def sample(self, probs: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """Draw one token per row of `probs` (..., vocab) -> (...,) int64."""
        flat = probs.reshape(-1, probs.shape[-1])
        tokens = torch.multinomial(flat, num_samples=1, generator=generator)
        return tokens.reshape(probs.shape[:-1])

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v}" for k, v in vars(self).items())
        return f"{type(self).__name__}({args})"


class GreedyProcessor(LogitsProcessor):
    """Argmax decoding. Its distribution is one-hot at the argmax (first index on ties)."""

    is_greedy = True

    def __init__(self, temperature: float = 1.0) -> None:
        super().__init__(temperature)  # accepted for interface symmetry; argmax ignores it

    def __call__(self, logits: Tensor) -> Tensor:
        return torch.zeros_like(logits).scatter_(-1, logits.argmax(dim=-1, keepdim=True), 1.0)

    def sample(self, probs: Tensor, generator: torch.Generator | None = None) -> Tensor:
        return probs.argmax(dim=-1)


class MultinomialProcessor(LogitsProcessor):
    """Sampling from softmax(logits / temperature)."""


class TopKProcessor(LogitsProcessor):
    """Sampling among the `top_k` most likely tokens (after temperature)."""

    def __init__(self, temperature: float = 1.0, top_k: int = 50) -> None:
        super().__init__(temperature)
        self.top_k = _check_top_k(top_k)

    def filter(self, logits: Tensor) -> Tensor:
        return top_k_filter(logits, self.top_k)


class NucleusProcessor(LogitsProcessor):
    """Nucleus (top-p) sampling (Holtzman et al. 2020), after temperature."""

    def __init__(self, temperature: float = 1.0, top_p: float = 0.9) -> None:
        super().__init__(temperature)
        self.top_p = _check_top_p(top_p)

    def filter(self, logits: Tensor) -> Tensor:
        return top_p_filter(logits, self.top_p)


class TopKNucleusProcessor(LogitsProcessor):
    """Temperature, then top-k, then top-p: the order of transformers' `generate`."""

    def __init__(self, temperature: float = 1.0, top_k: int = 50, top_p: float = 0.9) -> None:
        super().__init__(temperature)
        self.top_k = _check_top_k(top_k)
        self.top_p = _check_top_p(top_p)

    def filter(self, logits: Tensor) -> Tensor:
        return top_p_filter(top_k_filter(logits, self.top_k), self.top_p)
