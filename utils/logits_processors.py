"""Logits processors: turn the logits of one position into the distribution to sample from.

Each processor is a pure function of its input (nothing is modified in place) with the same
filtering semantics as transformers' temperature, top-k and top-p warpers, applied in that order.
At least one token is always kept, so the distribution is never empty.

    probs = processor(logits, history)         # (rows, vocab) -> (rows, vocab), rows sum to 1
    token = processor.sample(probs, generator) # (..., vocab) -> (...,) token ids
    token = inverse_cdf(probs, u)              # the same, driven by given uniform numbers

`history` is the token sequence the rows continue: row i of r rows scores the token after
history[: len(history) - r + 1 + i] (a verification pass scores the last accepted token and each
draft). The library's own processors ignore it; `TransformersProcessor` (transformers' processors:
repetition penalty, no-repeat n-grams, min-p...) processes each row with its own prefix, which is
what keeps speculative decoding exact under history-dependent processing.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = [
    "LogitsProcessor",
    "GreedyProcessor",
    "MultinomialProcessor",
    "TopKProcessor",
    "NucleusProcessor",
    "TopKNucleusProcessor",
    "TransformersProcessor",
    "inverse_cdf",
    "supports_float64",
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


def supports_float64(device: torch.device | str) -> bool:
    """Whether tensors on `device` can be float64 (Apple's MPS has no float64)."""
    return torch.device(device).type != "mps"


def inverse_cdf(probs: Tensor, u: Tensor | float) -> Tensor:
    """The token y with F(y - 1) <= u * total < F(y) for each row: a sample of `probs` driven by u.

    probs: (..., V) non-negative (rows need not sum exactly to 1); u: (...) or a float, in [0, 1),
    on any device. Returns (...) int64. A token of probability zero is never returned (rounding
    included). The CDF is summed in float64, or float32 on a device without it (`supports_float64`):
    the same rule, rounded coarser.
    """
    dtype = torch.float64 if supports_float64(probs.device) else torch.float32
    cdf = probs.to(dtype).cumsum(dim=-1)
    u = u if isinstance(u, Tensor) else torch.tensor(u, dtype=dtype)  # a float keeps its 53 bits where it can
    u = u.to(dtype).to(probs.device).expand(cdf.shape[:-1])
    tokens = torch.searchsorted(cdf, (u * cdf[..., -1])[..., None], right=True)[..., 0]
    # u * total may round up to the total: fall back to the last token that has mass.
    last = probs.shape[-1] - 1 - (probs > 0).flip(-1).long().argmax(dim=-1)
    return torch.minimum(tokens, last)


NUCLEUS_CANDIDATES = 256  # top-p over a larger vocabulary first looks for the nucleus among this many


def top_p_filter(logits: Tensor, top_p: float) -> Tensor:
    """Keep the smallest set of most likely tokens whose probability mass reaches `top_p`.

    Same rule as transformers' TopPLogitsWarper: sort ascending, drop the tokens whose cumulative
    probability is <= 1 - top_p, always keep the most likely token. logits: (..., vocab).
    """
    if top_p >= 1.0:
        return logits
    if logits.shape[-1] > NUCLEUS_CANDIDATES:
        # A large vocabulary: the nucleus is almost always among the few most likely tokens, and
        # then sorting those few is enough (the same rule, read from the top: a token is kept
        # while the mass of the tokens before it is < top_p). Otherwise, the full sort below.
        top = logits.topk(NUCLEUS_CANDIDATES, dim=-1)
        probs = (top.values - logits.logsumexp(dim=-1, keepdim=True)).exp()  # their share of the whole softmax
        if bool((probs.sum(dim=-1) > top_p).all()):
            mass_before = probs.cumsum(dim=-1) - probs
            keep = torch.zeros_like(logits, dtype=torch.bool).scatter(-1, top.indices, mass_before < top_p)
            return logits.masked_fill(~keep, -math.inf)
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
    needs_history = False  # whether `scores` reads the history (then each row is its own call)

    def __init__(self, temperature: float = 1.0) -> None:
        self.temperature = _check_temperature(temperature)

    def filter(self, logits: Tensor) -> Tensor:
        """Tempered logits -> filtered logits (-inf where a token is removed). Pure."""
        return logits

    def scores(self, logits: Tensor, history: Sequence[int] | None = None) -> Tensor:
        """Logits (..., vocab) -> processed scores before the softmax (greedy decoding takes their
        argmax). The input is not modified."""
        return self.filter(logits / self.temperature)

    def __call__(self, logits: Tensor, history: Sequence[int] | None = None) -> Tensor:
        """Logits (..., vocab) -> processed probabilities (..., vocab). The input is not modified."""
        return self.scores(logits, history).softmax(dim=-1)

    def sample(self, probs: Tensor, generator: torch.Generator | None = None) -> Tensor:
        """Draw one token per row of `probs` (..., vocab) -> (...,) int64 (inverse CDF of one
        uniform number per row; the decoding loops draw theirs by position, `sampling.loop.randomness`)."""
        device = generator.device if generator is not None else torch.device("cpu")
        u = torch.rand(probs.shape[:-1], generator=generator, device=device,
                       dtype=torch.float64 if supports_float64(device) else torch.float32)
        return inverse_cdf(probs, u)  # moved to probs' device there (float32 where float64 is missing)

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v}" for k, v in vars(self).items())
        return f"{type(self).__name__}({args})"


class GreedyProcessor(LogitsProcessor):
    """Argmax decoding. Its distribution is one-hot at the argmax (first index on ties)."""

    is_greedy = True

    def __init__(self, temperature: float = 1.0) -> None:
        super().__init__(temperature)  # accepted for interface symmetry; argmax ignores it

    def scores(self, logits: Tensor, history: Sequence[int] | None = None) -> Tensor:
        return logits

    def __call__(self, logits: Tensor, history: Sequence[int] | None = None) -> Tensor:
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


# Processors that keep state between calls (or need a second model pass): calling them on
# speculative positions that are then rejected would change what they do. Refused, not inexact.
_STATEFUL = ("SynthIDTextWatermarkLogitsProcessor", "WatermarkLogitsProcessor",
             "UnbatchedClassifierFreeGuidanceLogitsProcessor", "WhisperNoSpeechDetection",
             "WhisperTimeStampLogitsProcessor")


class TransformersProcessor(LogitsProcessor):
    """transformers' logits processors and warpers, applied as `generate` applies them.

    `processors`: a `transformers.LogitsProcessorList` or a list of transformers `LogitsProcessor`s
    (warpers included), applied in order to scores of shape (1, vocab) with the `input_ids` (1, length)
    of each position's own history. `do_sample=False`: greedy on the processed scores; `True`:
    sampling from their softmax. Under speculation each verified position is processed with its
    own prefix (the accepted tokens plus the drafts before it), as transformers' assisted
    generation does, so greedy identity and the exactness of speculative sampling hold.
    """

    def __init__(self, processors, *, do_sample: bool) -> None:
        from transformers import LogitsProcessor as HFLogitsProcessor
        from transformers import LogitsProcessorList

        if isinstance(processors, HFLogitsProcessor):
            processors = [processors]
        if not isinstance(processors, (list, tuple, LogitsProcessorList)):
            raise TypeError(f"processors must be a LogitsProcessorList or a list of transformers LogitsProcessors, "
                            f"got {type(processors).__name__}")
        for i, processor in enumerate(processors):
            if not isinstance(processor, HFLogitsProcessor):
                raise TypeError(f"processors[{i}] must be a transformers LogitsProcessor, got {processor!r}")
            if type(processor).__name__ in _STATEFUL:
                raise ValueError(f"processors[{i}] ({type(processor).__name__}) keeps state between calls and "
                                 "cannot be applied to speculative positions exactly; use plain `generate`")
        if not isinstance(do_sample, bool):
            raise TypeError(f"do_sample must be a bool, got {do_sample!r}")
        self.processors = LogitsProcessorList(processors)
        self.do_sample = do_sample
        self.is_greedy = not do_sample
        self.needs_history = True
        self.temperature = 1.0

    @classmethod
    def from_generation_config(cls, config) -> TransformersProcessor:
        """The processors `generate` builds from a `GenerationConfig` (repetition penalty, no-repeat
        n-grams, bad words, minimum length; when sampling: temperature, top-k, top-p, min-p,
        typical-p, epsilon and eta cutoffs), in `generate`'s order. Unset fields add nothing."""
        import transformers as hf

        c = config
        eos = c.eos_token_id
        processors = []
        if c.repetition_penalty not in (None, 1.0):
            processors.append(hf.RepetitionPenaltyLogitsProcessor(penalty=c.repetition_penalty))
        if c.no_repeat_ngram_size:
            processors.append(hf.NoRepeatNGramLogitsProcessor(c.no_repeat_ngram_size))
        if c.bad_words_ids:
            processors.append(hf.NoBadWordsLogitsProcessor(c.bad_words_ids, eos_token_id=eos))
        if c.min_length and eos is not None:
            processors.append(hf.MinLengthLogitsProcessor(c.min_length, eos))
        if c.do_sample:
            if c.temperature not in (None, 1.0):
                processors.append(hf.TemperatureLogitsWarper(c.temperature))
            if c.top_k:
                processors.append(hf.TopKLogitsWarper(c.top_k))
            if c.top_p not in (None, 1.0):
                processors.append(hf.TopPLogitsWarper(c.top_p))
            if c.min_p:
                processors.append(hf.MinPLogitsWarper(c.min_p))
            if c.typical_p not in (None, 1.0):
                processors.append(hf.TypicalLogitsWarper(c.typical_p))
            if c.epsilon_cutoff:
                processors.append(hf.EpsilonLogitsWarper(c.epsilon_cutoff))
            if c.eta_cutoff:
                processors.append(hf.EtaLogitsWarper(c.eta_cutoff))
        return cls(processors, do_sample=bool(c.do_sample))

    def scores(self, logits: Tensor, history: Sequence[int] | None = None) -> Tensor:
        if history is None:
            raise ValueError("TransformersProcessor needs the token history of the scored positions")
        rows = logits.reshape(-1, logits.shape[-1])
        ids = torch.tensor([list(history)], dtype=torch.long, device=logits.device)
        first = ids.shape[1] - rows.shape[0] + 1  # length of the first row's prefix
        assert first >= 1, "fewer history tokens than scored rows"
        # transformers' processors work in float32 and may write into their input: give each a copy.
        out = torch.stack([self.processors(ids[:, : first + i], rows[i : i + 1].float().clone())[0]
                           for i in range(rows.shape[0])])
        return out.to(logits.dtype).reshape(logits.shape)

    def __call__(self, logits: Tensor, history: Sequence[int] | None = None) -> Tensor:
        scores = self.scores(logits, history)
        if self.is_greedy:
            return torch.zeros_like(scores).scatter_(-1, scores.argmax(dim=-1, keepdim=True), 1.0)
        return scores.softmax(dim=-1)

    def sample(self, probs: Tensor, generator: torch.Generator | None = None) -> Tensor:
        return probs.argmax(dim=-1) if self.is_greedy else super().sample(probs, generator)

    def __repr__(self) -> str:
        names = ", ".join(type(p).__name__ for p in self.processors)
        return f"TransformersProcessor([{names}], do_sample={self.do_sample})"
