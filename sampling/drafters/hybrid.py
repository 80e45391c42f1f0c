"""Hybrid drafting: an n-gram pool and a drafter model, the better of the two per step and per row.

NASD's pool drafts for free where the text repeats (code re-using the prompt's names, a function
rewritten, a summary quoting its source) and knows nothing elsewhere; a drafter model guesses
everywhere but costs a pass per drafted token (SAM-Decoding, ACL 2025, and REST-style hybrids use
the retrieval draft when its match is long and the model otherwise). Here the choice follows the
expected accepted tokens per unit of measured cost, in one-token target passes:

- the pool's tree of n nodes: (1 + sum of its nodes' reaches) / verify(n), its reaches the pool's
  own acceptance estimates (match length, the target's top choice...), verify(n) the target's
  measured pass over 1 + n tokens: the pool costs nothing else;
- the model's chain: what its steps achieved, (1 + accepted) / (verify(k) + k drafted tokens'
  timed cost), a running average from the cost model's prior.

Drafts of either kind go through the same acceptance rules (a pool's with q None by the coupled
rule, a model's with q by speculative sampling), so the output is exact whichever is chosen.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

import torch

from sampling.drafters.model_drafter import ModelDrafter
from sampling.drafters.model_kind import ModelOptions, build_model_drafter, check_model_drafter
from sampling.drafters.registry import KINDS, register_kind
from sampling.drafters.self_drafting import self_drafter
from sampling.drafters.self_kind import DEFAULT_BITS, SELF
from sampling.loop.common import Generation, Request
from sampling.loop.drafts import Drafter
from sampling.loop.options import DecodingOptions, Drafting
from sampling.policy.draft_policy import CostAwarePolicy, DraftLength, best_draft_length
from sampling.policy.estimators import RunningAverage
from utils.quantized_models import check_quantization, drafter_group


class PoolDrafter(Drafter, Protocol):
    """What the hybrid needs from a pool's drafter over the rows, beyond the `Drafter` protocol."""

    def reaches(self) -> list[list[float]]:
        """Per row, P(node and its whole path accepted) for each node of its last tree."""

    def withdraw(self, rows: list[int]) -> None:
        """The last trees of `rows` are not verified: forget them (their next `update` has an empty path)."""


def pool_rows(ngram: object, request: Request, *, greedy: bool) -> Callable[[Generation], PoolDrafter]:
    """`ngram=`, a pool of a registered kind that builds pool rows (NASD's, `ngram_assisted/nasd.py`;
    or one pool per row of a batch) -> its rows' builder, at the pool's defaults."""
    first = ngram[0] if isinstance(ngram, (list, tuple)) and ngram else ngram
    kinds = [kind for kind in KINDS if hasattr(kind, "pool_rows") and kind.takes(first, {})]
    if not kinds:
        raise TypeError(f"ngram must be an n-gram pool (ngram_assisted's SimpleDynaGram or MultiDynaGram), or for "
                        f"a batch one per row, got {type(first).__name__}")
    return kinds[0].pool_rows(ngram, request, greedy=greedy)


@dataclass(frozen=True, kw_only=True)
class HybridOptions(ModelOptions):
    """A drafter model's options and the pool beside it (`ngram=`)."""

    ngram: object = None  # a pool of a registered pool kind (ngram_assisted's SimpleDynaGram, MultiDynaGram), or one per row


class HybridKind:
    """A drafter model beside an n-gram pool (`speculative_generate(..., ngram=pool)`)."""

    Options = HybridOptions
    what = "a transformers PreTrainedModel"

    def takes(self, drafter: object, given: dict[str, object]) -> bool:
        return (isinstance(drafter, torch.nn.Module) or _is_self(drafter)) and given.get("ngram") is not None

    def check(self, request: Request, shared: DecodingOptions, drafter: object,
              options: HybridOptions) -> Callable[[Generation], Drafting]:
        if _is_self(drafter):  # the self-drafter's default bits and group (`bits=`, `group_size=`: the self kind's)
            if request.encoder_decoder:
                raise ValueError('drafter="self" drafts for decoder-only targets (the target is an encoder-decoder model)')
            check_quantization(request.model, DEFAULT_BITS, drafter_group(request.model))
        elif check_model_drafter(request, shared, drafter, options):
            raise ValueError("ngram= drafts in the target's vocabulary beside a drafter sharing it; with "
                             "drafter_tokenizer (another vocabulary) pass ngram=None")
        build_pool_rows = pool_rows(options.ngram, request, greedy=shared.logits_processor.is_greedy)

        def build(gen: Generation) -> Drafting:
            # The hybrid's model drafts chains: the pool's trees and its chains share one budget.
            model = self_drafter(request.model, DEFAULT_BITS) if _is_self(drafter) else drafter
            model_drafter, cost_policy, _ = build_model_drafter(model, request.model, gen, shared,
                                                                replace(options, branching=1), universal=False,
                                                                priced=True)
            hybrid, policy = hybrid_drafter(build_pool_rows(gen), model_drafter, cost_policy, gamma=shared.gamma,
                                            adaptive_gamma=options.adaptive_gamma)
            return Drafting(hybrid, shared.draft_policy or policy, model_drafter.counters)

        return build


register_kind(HybridKind())


def _is_self(drafter: object) -> bool:
    """`drafter="self"`: the target's own weights in four bits beside the pool (`self_drafter`, built once)."""
    return isinstance(drafter, str) and drafter == SELF


def hybrid_drafter(pool_drafter: PoolDrafter, model: ModelDrafter, policy: CostAwarePolicy, *, gamma: int,
                   adaptive_gamma: bool) -> tuple[HybridDrafter, DraftLength]:
    """The hybrid drafter and the loop's cap for it: the pool's tree or the model's chain, within
    `max(policy.max_budget, gamma)` nodes (the model's chain by its own rule: `gamma` when fixed)."""
    drafter = HybridDrafter(pool_drafter, model, policy, fixed_gamma=None if adaptive_gamma else gamma)
    return drafter, DraftLength(max(policy.max_budget, gamma))


class HybridDrafter:
    """A batch `Drafter` over an n-gram drafter (`ngram_assisted.drafter.NgramRows`) and a
    `ModelDrafter` that share the rows. `policy` prices a model chain (its costs, its acceptance
    rate, whether drafting with the model can pay now); `fixed_gamma`: the model's chain length
    when the user fixed it (None: the policy's confidence stop sizes it)."""

    RATE_WEIGHT = 0.2  # of one model step in the running average of its rate

    def __init__(self, ngram: PoolDrafter, model: ModelDrafter, policy: CostAwarePolicy, fixed_gamma: int | None) -> None:
        self.ngram, self.model, self.policy, self.fixed_gamma = ngram, model, policy, fixed_gamma
        self.model_rate = RunningAverage(self.RATE_WEIGHT)  # (1 + accepted) / cost of the model's steps
        self._chose_model: list[bool] = []
        self._model_drafts: list[int] = []

    @property
    def forward_passes(self) -> int:
        return self.model.forward_passes

    def start(self, sequences: list[list[int]]) -> None:
        self.ngram.start(sequences)
        self.model.start(sequences)

    def _expected_model_rate(self, rows: int) -> float:
        """What a model step over `rows` rows is expected to yield per unit of cost (the prior: the policy's rate)."""
        if self.model_rate.value is not None:
            return self.model_rate.value
        rate = self.policy.acceptance_rate
        cost = functools.partial(self.policy.cost, rows=rows)
        length = self.fixed_gamma or best_draft_length([min(rate, 0.99)] * self.policy.max_budget, cost)
        expected = sum(rate ** j for j in range(1, length + 1))
        return (1.0 + expected) / cost(length)

    def draft(self, sequences, max_drafts, max_depths):
        adaptive = self.policy.budget(len(sequences))
        pool_drafts = self.ngram.draft(sequences, max_drafts, max_depths)
        model_length = self.fixed_gamma or adaptive  # the model's chain this step; 0: it cannot pay now
        model_rate = self._expected_model_rate(len(sequences)) if model_length else 0.0
        self._chose_model = []
        for reaches, (tree, _) in zip(self.ngram.reaches(), pool_drafts, strict=True):
            pool_rate = (1.0 + sum(reaches[: len(tree)])) / self.policy.verify_cost(len(tree), len(sequences))
            self._chose_model.append(model_length > 0 and model_rate > pool_rate)
        if not any(self._chose_model):
            return pool_drafts
        model_depths = [depth if model else 0 for depth, model in zip(max_depths, self._chose_model, strict=True)]
        model_drafts = self.model.draft(sequences, min(model_length, max_drafts), model_depths)
        self.ngram.withdraw([b for b, model in enumerate(self._chose_model) if model])  # it learns from the model's step
        self._model_drafts = [len(tree) if model else 0 for (tree, _), model in zip(model_drafts, self._chose_model, strict=True)]
        return [model_draft if model else pool_draft
                for model_draft, pool_draft, model in zip(model_drafts, pool_drafts, self._chose_model, strict=True)]

    def update(self, sequences, paths, target_logits, p) -> None:
        chose = self._chose_model or [False] * len(paths)
        if any(chose):  # its cache keeps the accepted tokens (untouched on steps it did not draft)
            self.model.update(sequences, paths, target_logits, p)
        # The pool learns every step's accepted tokens and the target's top-k after its own nodes.
        self.ngram.update(sequences, [[] if model else path for path, model in zip(paths, chose, strict=True)],
                          target_logits, p)
        for b, model in enumerate(chose):
            if not model:
                continue
            k, n = self._model_drafts[b], len(paths[b])
            self.policy.update(k, n)
            if k:
                self.model_rate.add((1.0 + n) / self.policy.cost(k, len(sequences)))
        self._chose_model = []

    def select_rows(self, keep: list[int]) -> None:
        self.ngram.select_rows(keep)
        self.model.select_rows(keep)
