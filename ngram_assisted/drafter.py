"""The n-gram drafter of NASD: drafts chains from a dynagram, only as long as they are likely to pay."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from torch import Tensor

from ngram_assisted.dynagram import DynaGram, Prediction
from sampling.draft_policy import best_draft_length
from utils.cost_model import prior_cost

# Prior P(accept) of a draft by the length of the context it matched (1, 2, 3, 4+ tokens), as
# measured on held-out Spec-Bench prompts with SmolLM2-135M (greedy): longer matches are copies.
MATCH_LENGTH_PRIOR = (0.25, 0.5, 0.7, 0.85)
PRIOR_WEIGHT = 4.0  # the prior counts as this many observed drafts


class AcceptanceModel:
    """Online estimate of P(a draft is accepted | the drafts before it were), per kind of proposal.

    A proposal's kind is (match length, count, whether it is the majority continuation), each
    capped. Each kind starts from a prior set by its match length (`MATCH_LENGTH_PRIOR`, worth
    `PRIOR_WEIGHT` drafts) and moves to the acceptance rate actually observed. On top of that, a
    calibration factor (accepted / predicted over all judged drafts so far) scales every estimate,
    so that text where the pool is less reliable than usual stops the drafting after a few misses.
    """

    def __init__(self, prior: tuple[float, ...] = MATCH_LENGTH_PRIOR, weight: float = PRIOR_WEIGHT) -> None:
        self.prior = prior
        self.weight = weight
        self.counts: dict[tuple[int, int, bool], list[float]] = {}  # kind -> [accepted, rejected]
        self.accepted = 0.0
        self.predicted = 0.0

    @staticmethod
    def kind(prediction: Prediction) -> tuple[int, int, bool]:
        return min(prediction.match_length, 8), min(prediction.count, 4), 2 * prediction.count > prediction.total

    def _prior(self, kind: tuple[int, int, bool]) -> list[float]:
        a = self.prior[min(kind[0], len(self.prior)) - 1]
        return [a * self.weight, (1 - a) * self.weight]

    def estimate(self, kind: tuple[int, int, bool]) -> float:
        accepted, rejected = self.counts.get(kind) or self._prior(kind)
        calibration = (self.accepted + self.weight) / (self.predicted + self.weight)
        return min(0.99, calibration * accepted / (accepted + rejected))

    def record(self, kind: tuple[int, int, bool], accepted: float, estimate: float) -> None:
        """A judged draft of this kind, proposed with this `estimate`, was accepted (1.0), rejected
        (0.0), or accepted with this probability (sampling)."""
        counts = self.counts.setdefault(kind, self._prior(kind))
        counts[0] += accepted
        counts[1] += 1.0 - accepted
        self.accepted += accepted
        self.predicted += estimate


class NgramDrafter:
    """Drafts from a dynagram pool (deterministic drafts: q is one-hot, so `draft` returns q=None).

    stop_if_unknown=True: a chain stops at the first unknown n-gram and is cut to the length that
    maximises the expected tokens per unit of target cost (`draft_cost`, learned acceptance).
    stop_if_unknown=False: every known continuation is drafted, up to gamma (ANPD's behaviour).
    A miss always ends a chain: the pool never invents a token.
    """

    forward_passes = 0  # an n-gram pool runs no model

    def __init__(
        self,
        pool: DynaGram,
        *,
        vocab_size: int,
        top_k_filler: int = 3,
        stop_if_unknown: bool = True,
        source_tokens: Sequence[int] = (),
        draft_cost: Callable[[int], float] = prior_cost,
    ) -> None:
        self.pool = pool
        self.vocab_size = vocab_size
        self.top_k_filler = top_k_filler
        self.stop_if_unknown = stop_if_unknown
        self.source_tokens = list(source_tokens)
        self.draft_cost = draft_cost
        self.acceptance = AcceptanceModel()
        self._base = 0  # len(sequence) when the last draft started
        self._drafts: list[int] = []  # the last draft
        self._judged: list[tuple[tuple[int, int, bool], float]] = []  # (kind, estimate) of each draft

    def start(self, sequence: list[int]) -> None:
        self.pool.bind_vocabulary(self.vocab_size)
        self.pool.fill(self.source_tokens)  # encoder-decoder: the source text, where copying happens
        self.pool.learn(sequence)

    def draft(self, sequence: list[int], max_drafts: int) -> tuple[list[int], None]:
        self._base = len(sequence)
        history = list(sequence[-(self.pool.n - 1) :])
        drafts, kinds, estimates = [], [], []
        for _ in range(max(max_drafts, 0)):
            prediction = self.pool.predict(history)
            if prediction is None:
                break  # unknown n-gram: nothing to propose
            kind = AcceptanceModel.kind(prediction)
            drafts.append(prediction.token)
            kinds.append(kind)
            estimates.append(self.acceptance.estimate(kind))
            history.append(prediction.token)
        if self.stop_if_unknown:
            drafts = drafts[: best_draft_length(estimates, self.draft_cost)]
        self._drafts = drafts
        self._judged = list(zip(kinds, estimates, strict=True))[: len(drafts)]
        return drafts, None

    def update(self, sequence: list[int], num_accepted: int, target_logits: Tensor, p: Tensor | None) -> None:
        # Learn how often each kind of proposal is accepted (drafts after a rejection were not judged).
        # Sampling: a draft x was accepted with probability p(x), known now; learning p(x) rather
        # than the coin's outcome learns the same mean with less noise, in the mode that runs.
        judged = self._judged[: num_accepted + 1]
        if p is not None and judged:
            rows = torch.arange(len(judged), device=p.device)
            chances = p[rows, torch.tensor(self._drafts[: len(judged)], device=p.device)].tolist()
        else:
            chances = [float(i < num_accepted) for i in range(len(judged))]
        for (kind, estimate), chance in zip(judged, chances, strict=True):
            self.acceptance.record(kind, chance, estimate)
        # The target's top-k at each verified position go in first, so that on equal counts the
        # token that was really generated (added last, most recent) stays the proposal.
        longest = self.pool.n - 1
        positions = min(len(target_logits), len(sequence) - self._base)
        top_k = target_logits[:positions].topk(self.top_k_filler, dim=-1).indices.tolist()
        for i, candidates in enumerate(top_k):
            end = self._base + i
            context = sequence[max(0, end - longest) : end]
            for token in candidates:
                if token != sequence[end]:
                    self.pool.add(context, token)
        self.pool.learn(sequence)  # the accepted tokens and the target's own
