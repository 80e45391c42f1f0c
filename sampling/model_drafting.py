"""The factory of a drafter model's drafting: the `ModelDrafter` (or, another tokenizer, the
`UniversalDrafter`), built whole with its coupling and stop rules, and the cost-aware policy that
sizes its drafts (`sampling/draft_policy.py`) or, in a hybrid, prices them."""

from __future__ import annotations

from transformers import PreTrainedModel

from sampling.cascade import Cascade
from sampling.common import Generation, max_tokens
from sampling.draft_confidence import ConfidenceStop
from sampling.draft_policy import CostAwareDraftLength, DraftLength, DraftPolicy
from sampling.drafters import ModelDrafter
from sampling.model_tree import ModelTreeDrafter, TreeAcceptance, TreePlanner, tree_branching
from sampling.universal import UniversalDrafter
from utils.caching import vocab_size
from utils.calibration import pass_costs
from utils.logits_processors import LogitsProcessor

MAX_ADAPTIVE_GAMMA = 16  # with adaptive_gamma, each step drafts 0 .. max(gamma, this) tokens


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


def model_drafting(drafter: PreTrainedModel, target: PreTrainedModel, gen: Generation, *,
                   logits_processor: LogitsProcessor, use_cache: bool,
                   gamma: int, adaptive_gamma: bool, drafter_invariant: bool | None, cascade: bool | None = None,
                   universal: bool = False, branching: int | None = 1,
                   tokenizer=None, drafter_tokenizer=None) -> tuple[ModelDrafter, CostAwareDraftLength, DraftPolicy]:
    """A drafter model over the rows of `gen` (arguments checked; `universal`: it has another
    tokenizer, `sampling.universal.check_tokenizers`) -> (its drafter, the cost-aware policy of its
    chains, the loop's policy: that one with `adaptive_gamma`, else `gamma` every step). `cascade`
    (None: on with `adaptive_gamma`): the drafter checks a proposer's tokens in passes of its own
    (`sampling/cascade.py`), priced by its measured costs. `branching` (checked; `sampling.model_tree`):
    token trees where both models' runners verify them, else chains."""
    # The cost of a step: the target's measured passes, and the drafter's timed drafting (the
    # closures read the drafter built below: one drafter and one policy, each built whole).
    drafter_costs = pass_costs(drafter)  # its kernels, and its step's cost for adaptive gamma
    policy = CostAwareDraftLength(max(gamma, MAX_ADAPTIVE_GAMMA), gen.runner.costs, drafter_costs,
                                  draft_seconds=lambda: model_drafter.seconds_per_draft,
                                  warm=lambda: model_drafter.is_warm(),
                                  per_token_stop=not universal)  # the other-tokenizer drafter has no per-token stop
    # None: drafter-invariant exactly where draft lengths follow timings (adaptive_gamma), so that a
    # seed means one output; with a fixed gamma the standard rule already reproduces and accepts more.
    coupled = adaptive_gamma if drafter_invariant is None else drafter_invariant
    proposer = Cascade(drafter_costs) if (adaptive_gamma if cascade is None else cascade) else None
    if universal:  # drafts in its own vocabulary, from its own tokens of the text (sampling/universal.py)
        model_drafter = UniversalDrafter(drafter, logits_processor, tokenizer=tokenizer, drafter_tokenizer=drafter_tokenizer,
                                         target_vocab_size=vocab_size(target), uniforms=gen.uniforms, use_cache=use_cache,
                                         trees=gen.runner.supports_trees, coupled=coupled, costs=drafter_costs,
                                         cascade=proposer)
    else:
        stop = (ConfidenceStop(policy.cost, policy.verify_cost, policy.max_gamma, on_discard=policy.discard)
                if adaptive_gamma else None)
        model_drafter = ModelDrafter(
            drafter, logits_processor, vocab_size=vocab_size(target), use_cache=use_cache,
            encoder_input_ids=gen.encoder_input_ids, uniforms=gen.uniforms, coupled=coupled, stop=stop,
            costs=drafter_costs, cascade=proposer, max_tokens=max_tokens(gen.prefixes, gen.max_new_tokens),
        )
        width = tree_branching(branching, adaptive_gamma)
        if width > 1 and gen.runner.supports_trees and model_drafter.runner.supports_trees:
            acceptance = TreeAcceptance()
            planner = TreePlanner(policy, drafter_costs, width, acceptance) if adaptive_gamma else None
            tree_drafter = ModelTreeDrafter(model_drafter, width, planner, acceptance)
            return tree_drafter, policy, policy if adaptive_gamma else DraftLength(gamma)
    return model_drafter, policy, policy if adaptive_gamma else DraftLength(gamma)
