"""The drafter kind of a drafter model (`ModelOptions`, `ModelDrafterKind`): the `ModelDrafter` (or,
another tokenizer, the `UniversalDrafter`; trees, the `ModelTreeDrafter`), built whole from the call's
options with its coupling and stop rules, and the cost-aware policy that sizes its drafts
(`sampling/policy/draft_policy.py`) or, in a hybrid, prices them. Cascade drafting is an option of this
kind (`sampling/drafters/cascade.py`); the drafter model's pass costs are measured here (`pass_costs`),
the target's by `sampling.loop.common.measured_costs`."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from sampling.drafters.cascade import Cascade
from sampling.drafters.model_drafter import ModelDrafter
from sampling.drafters.model_tree import ModelTreeDrafter
from sampling.drafters.registry import register_kind
from sampling.drafters.self_drafting import releasing, self_drafting, shared_runner
from sampling.drafters.universal import UniversalDrafter, check_tokenizers
from sampling.loop.common import Generation, Request, max_tokens
from sampling.loop.options import DecodingOptions, Drafting
from sampling.policy.draft_confidence import ConfidenceStop, pair_record
from sampling.policy.draft_policy import MAX_ADAPTIVE_GAMMA, CostAwareDraftLength, DraftLength, DraftPolicy
from sampling.policy.tree_choice import TreeAcceptance, TreePlanner, shape_record, tree_branching
from utils.calibration import pass_costs
from utils.cost_model import PassCosts
from utils.runners.model_info import input_device, pass_bytes, vocab_size
from utils.validation import check_bool, check_int, check_model


def check_same_vocabulary(drafter: PreTrainedModel, target: PreTrainedModel) -> None:
    """Drafter and target must share the tokenizer. Logit widths may differ by padding rows (the
    embedding is often padded past the tokenizer), so up to 1% difference is accepted."""
    v_d, v_t = vocab_size(drafter), vocab_size(target)
    if abs(v_d - v_t) > 0.01 * max(v_d, v_t):
        raise ValueError(
            f"drafter and target vocabularies differ (drafter {v_d} tokens, target {v_t} tokens): for a "
            f"drafter with another tokenizer pass tokenizer=<the target's tokenizer> and "
            f"drafter_tokenizer=<the drafter's tokenizer>"
        )


@dataclass(frozen=True, kw_only=True)
class ModelOptions:
    """A drafter model's options (`speculative_generate`'s docstring says what each means)."""

    adaptive_gamma: bool = False
    drafter_tokenizer: object = None
    drafter_invariant: bool | None = None
    cascade: bool | None = None
    branching: int | None = None  # token trees from the drafter model (sampling/drafters/model_tree.py); 1: chains

    def __post_init__(self) -> None:
        check_bool(self.adaptive_gamma, "adaptive_gamma")
        check_bool(self.drafter_invariant, "drafter_invariant", optional=True)
        check_bool(self.cascade, "cascade", optional=True)
        if self.branching is not None:
            check_int(self.branching, "branching", 1)
        if self.drafter_tokenizer is not None and not isinstance(self.drafter_tokenizer, PreTrainedTokenizerBase):
            raise TypeError(f"drafter_tokenizer must be a transformers tokenizer (PreTrainedTokenizerBase: the "
                            f"drafter's) or None, got {type(self.drafter_tokenizer).__name__}")


def check_model_drafter(request: Request, shared: DecodingOptions, drafter: object, options: ModelOptions) -> bool:
    """A drafter model and its options, checked before any model runs -> whether it drafts with
    another tokenizer (`sampling.drafters.universal.check_tokenizers`)."""
    check_model(drafter, "drafter", request.encoder_decoder)
    universal = check_tokenizers(shared.habits.tokenizer, options.drafter_tokenizer, drafter, request.model,
                                 encoder_decoder=request.encoder_decoder)
    if not universal:
        check_same_vocabulary(drafter, request.model)
    return universal


PAYING_COST = 1 / 3  # past this share of the target's pass, a drafter pays only where nearly every draft is kept
_TOLD: set[tuple[int, int]] = set()  # (drafter, target costs) pairs already warned about, in this process


def say_if_it_cannot_pay(drafter: PreTrainedModel, drafter_costs: PassCosts | None, target_costs: PassCosts | None) -> None:
    """One warning, once per pair, when the drafter's measured one-token pass costs more than `PAYING_COST` of the
    target's here: it is never used silently (adaptive_gamma then drafts only where its costs say it pays)."""
    mine = drafter_costs.seconds() if drafter_costs is not None and drafter_costs.measured else None
    theirs = target_costs.seconds() if target_costs is not None and target_costs.measured else None
    if mine is None or not theirs or mine / theirs <= PAYING_COST or (id(drafter), id(target_costs)) in _TOLD:
        return
    _TOLD.add((id(drafter), id(target_costs)))
    warnings.warn(f"the drafter's one-token pass costs {1000 * mine:.1f} ms here, {mine / theirs:.2f} of the "
                  f"target's ({1000 * theirs:.1f} ms): over {PAYING_COST:.2f}, it pays only where nearly all its drafts "
                  f"are accepted (adaptive_gamma=True drafts only where its measured costs say it pays)", stacklevel=4)


def prior_share(drafter: PreTrainedModel, target: PreTrainedModel) -> float:
    """A drafted token's cost in target passes before both passes are timed: the share of the weight bytes the
    drafter's pass reads against the target's (1.0 where either cannot be read)."""
    mine, theirs = pass_bytes(drafter), pass_bytes(target)
    return mine / theirs if mine and theirs else 1.0


def build_model_drafter(drafter: PreTrainedModel, target: PreTrainedModel, gen: Generation, shared: DecodingOptions,
                        options: ModelOptions, *,
                        universal: bool, priced: bool = False,
                        share_cache: bool = True) -> tuple[ModelDrafter | UniversalDrafter, CostAwareDraftLength, DraftPolicy]:
    """A drafter model over the rows of `gen`, from a speculative call's options (checked;
    `universal`: it has another tokenizer, `check_model_drafter`) -> (its drafter, the cost-aware
    policy of its chains, the loop's policy: that one with `adaptive_gamma`, else `gamma` every step).
    `cascade` (None: on with `adaptive_gamma` where a host read does not wait for the drafter's device): the drafter
    checks a proposer's tokens in passes of its own (`sampling/drafters/cascade.py`), priced by its measured costs.
    `branching` (`sampling.drafters.model_tree`): token trees where both models' runners verify them, else chains.
    `priced`: the caller prices the drafter's chains with the cost-aware policy even with a fixed gamma
    (its drafting is then timed, as with `adaptive_gamma`; otherwise it is not: no synchronization).
    `share_cache`: a self-drafter of `target` drafts over the target's cache where its runner allows
    (`sampling.drafters.self_drafting.shared_runner`)."""
    adaptive = options.adaptive_gamma
    # The cost of a step: the target's measured passes, and the drafter's timed drafting (the
    # closures read the drafter built below: one drafter and one policy, each built whole).
    drafter_costs = pass_costs(drafter)  # its kernels, and its step's cost for adaptive gamma
    say_if_it_cannot_pay(drafter, drafter_costs, gen.runner.costs)
    record = pair_record(drafter, target, shared.logits_processor.is_greedy)  # what the pair learned in earlier calls
    stops = adaptive and not universal  # a per-token stop (the other-tokenizer drafter has none)
    policy = CostAwareDraftLength(max(shared.gamma, MAX_ADAPTIVE_GAMMA), gen.runner.costs, drafter_costs,
                                  draft_seconds=lambda: model_drafter.seconds_per_draft,
                                  warm=lambda: model_drafter.is_warm(),
                                  per_token_stop=not universal, chains=record.chains if stops else None,
                                  prior_share=lambda: prior_share(drafter, target))
    loop_policy = policy if adaptive else DraftLength(shared.gamma)
    # None: drafter-invariant exactly where draft lengths follow timings (adaptive_gamma), so that a
    # seed means one output; with a fixed gamma the standard rule already reproduces and accepts more.
    coupled = adaptive if options.drafter_invariant is None else options.drafter_invariant
    # The cascade compares each draft with its proposal on the host: by default not where a read waits for the device.
    cascade = options.cascade if options.cascade is not None else \
        adaptive and not ModelDrafter.read_waits(input_device(drafter))
    proposer = Cascade(drafter_costs) if cascade else None
    if universal:  # drafts in its own vocabulary, from its own tokens of the text (sampling/drafters/universal.py)
        model_drafter = UniversalDrafter(drafter, shared.logits_processor, tokenizer=shared.habits.tokenizer,
                                         drafter_tokenizer=options.drafter_tokenizer, target_vocab_size=vocab_size(target),
                                         uniforms=gen.uniforms, use_cache=shared.use_cache, trees=gen.runner.supports_trees,
                                         coupled=coupled, costs=drafter_costs, cascade=proposer,
                                         max_tokens=max_tokens(gen.prefixes, gen.max_new_tokens))
        return model_drafter, policy, loop_policy
    model_drafter = ModelDrafter(
        drafter, shared.logits_processor, vocab_size=vocab_size(target), use_cache=shared.use_cache,
        encoder_input_ids=gen.encoder_input_ids, uniforms=gen.uniforms, coupled=coupled,
        stop=ConfidenceStop(policy, record) if stops else None,
        costs=drafter_costs, cascade=proposer,
        max_tokens=max_tokens(gen.prefixes, gen.max_new_tokens), timed=adaptive or priced,
    )
    # A self-drafter drafts over the target's cache: no prompt pass of its own (`sampling.drafters.self_drafting`).
    shared_cache = shared_runner(drafter, target, lambda: gen.runner, use_cache=shared.use_cache, costs=drafter_costs,
                                 share_cache=share_cache)
    if shared_cache is not None:
        model_drafter.runner = shared_cache
    elif gen.prompt_cache is not None:  # its own keys kept with the target's, for the conversation's next turn
        model_drafter.prompt_cache = gen.prompt_cache
        gen.also_kept.append(lambda: model_drafter.runner)
    width = tree_branching(options.branching, adaptive)
    if width == 1 or not (gen.runner.supports_trees and model_drafter.runner.supports_trees):
        return releasing(model_drafter, shared_cache), policy, loop_policy
    acceptance = TreeAcceptance()
    mode = ("greedy" if shared.logits_processor.is_greedy else "coupled" if coupled else "sampled", len(gen.uniforms))
    tree_drafter = ModelTreeDrafter(model_drafter, width,  # the policy's closures still read the chain drafter
                                    TreePlanner(policy, drafter_costs, width, acceptance) if adaptive else None,
                                    acceptance, shape_record(drafter, target, mode) if adaptive else None)
    return releasing(tree_drafter, shared_cache), policy, loop_policy


class ModelDrafterKind:
    """A drafter model alone (`speculative_generate(inputs, drafter_model, target)`); the target's own weights in
    fewer bits are the self-drafter's kind (`sampling/drafters/self_kind.py`)."""

    Options = ModelOptions
    what = "a transformers PreTrainedModel"

    def takes(self, drafter: object, given: dict[str, object]) -> bool:
        return isinstance(drafter, torch.nn.Module) and given.get("ngram") is None and self_drafting(drafter) is None

    def check(self, request: Request, shared: DecodingOptions, drafter: object,
              options: ModelOptions) -> Callable[[Generation], Drafting]:
        universal = check_model_drafter(request, shared, drafter, options)

        def build(gen: Generation) -> Drafting:
            model_drafter, _, policy = build_model_drafter(drafter, request.model, gen, shared, options, universal=universal)
            return Drafting(model_drafter, shared.draft_policy or policy, model_drafter.counters)

        return build


register_kind(ModelDrafterKind())
