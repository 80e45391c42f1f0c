"""Speculative decoding (Leviathan et al. 2023) and speculative sampling (Chen et al. 2023).

One loop serves every drafter: a small model here, an n-gram pool in `ngram_assisted/`; one
model runner serves decoder-only and encoder-decoder targets.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from transformers import PreTrainedModel

from sampling.acceptance import accept
from sampling.common import Generation, OnStep, Step, prepare
from sampling.custom_drafters import CheckedDrafter, check_drafter
from sampling.draft_confidence import ConfidenceStop
from sampling.draft_policy import CostAwareDraftLength, DraftLength
from sampling.drafters import Drafter, ModelDrafter
from sampling.hybrid import HybridDrafter, HybridLength
from sampling.step_clock import StepClock

if TYPE_CHECKING:
    from ngram_assisted.dynagram import DynaGram
from sampling.universal import UniversalDrafter, check_tokenizers
from utils.caching import input_device, vocab_size
from utils.calibration import pass_costs
from utils.logits_processors import GreedyProcessor, LogitsProcessor
from utils.validation import Inputs, check_int, check_model


@dataclass
class SpeculativeStats:
    """Counters of one (or several) speculative generations. Pass one as `stats=` to fill it; the
    counters add up over calls and over the rows of a batch.

    A *step* is one verification of one sequence: the target scores the row's last accepted token
    and its drafts (none, a chain or a tree), and the row gains its accepted drafts plus the
    target's own token (cut at an end token or `max_gen_len`). The prompt pass (prefill) is not a
    step. In a batch, one shared target pass verifies every running row: it is one target forward
    and as many steps as rows.

    - `drafts_proposed`, `drafts_accepted`: drafted tokens (tree nodes) over all steps, and those accepted.
    - `generated_tokens`: tokens returned, all rows together.
    - `steps`: row-steps (each row's verifications, summed over rows).
    - `steps_without_drafts`: row-steps in which nothing was drafted (plain decoding at a
      verification's cost: the policy found nothing worth drafting, or the room was used up).
    - `target_forwards`, `drafter_forwards`: forward passes of each model, the prefill included; a
      batch's shared pass counts once.
    - `proposed_by_position`, `accepted_by_position`: per draft position (per depth for a tree), the
      steps that drafted that far and those that accepted that far.
    - `tau` (property): generated tokens / steps, Spec-Bench's "mean accepted tokens" (the
      accepted drafts plus the target's token, per verification of a sequence; 1.0 = no gain).
    - `tokens_per_target_pass` (property): generated tokens / target forwards (prefill included;
      in a batch it grows with the batch width, not with speculation).
    - `alpha` (property): drafts accepted / drafts proposed.
    - `seconds` (with `timed=True`): phase -> seconds, summed over calls: "prefill", "draft" (the
      drafter's work, its model's passes included), "target" (the verification pass), "accept",
      "rollback" (the target's cache), "update" (the drafter told what was accepted: its cache, a
      pool's learning) and "rest" (the loop's own bookkeeping). Off by default: on an accelerator
      each phase waits for the device's queued work before it is timed.
    """

    drafts_proposed: int = 0
    drafts_accepted: int = 0
    generated_tokens: int = 0
    target_forwards: int = 0
    drafter_forwards: int = 0
    steps: int = 0
    steps_without_drafts: int = 0
    proposed_by_position: list[int] = field(default_factory=list)
    accepted_by_position: list[int] = field(default_factory=list)
    retokenize_seconds: float = 0.0  # a drafter with another tokenizer: time spent moving text between tokenizers
    timed: bool = False
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def alpha(self) -> float:
        """Acceptance rate: drafts accepted / drafts proposed (0.0 when none was proposed)."""
        return self.drafts_accepted / self.drafts_proposed if self.drafts_proposed else 0.0

    @property
    def tau(self) -> float:
        """Mean tokens per verification step of a sequence (Spec-Bench's mean accepted tokens):
        generated tokens / row-steps, the prompt pass excluded (0.0 before any step)."""
        return self.generated_tokens / self.steps if self.steps else 0.0

    @property
    def tokens_per_target_pass(self) -> float:
        """Generated tokens / target forward passes, the prefill included; a batch's shared pass
        counts once, so this grows with the batch width (0.0 before any pass)."""
        return self.generated_tokens / self.target_forwards if self.target_forwards else 0.0

    def acceptance_by_position(self) -> list[float]:
        """P(draft i accepted | draft i proposed), for i = 0, 1, ..."""
        return [a / p if p else 0.0 for a, p in zip(self.accepted_by_position, self.proposed_by_position, strict=False)]

    def record(self, num_drafts: int, num_accepted: int, depth: int | None = None) -> None:
        """One step: `num_drafts` drafted nodes (of a tree `depth` deep; a chain's depth is its
        length), `num_accepted` of them accepted. Acceptance by position is by depth."""
        depth = num_drafts if depth is None else depth
        self.steps += 1
        self.steps_without_drafts += num_drafts == 0
        self.drafts_proposed += num_drafts
        self.drafts_accepted += num_accepted
        grow = depth - len(self.proposed_by_position)
        if grow > 0:
            self.proposed_by_position += [0] * grow
            self.accepted_by_position += [0] * grow
        for i in range(depth):
            self.proposed_by_position[i] += 1
            self.accepted_by_position[i] += i < num_accepted


def speculative_loop(
    gen: Generation,
    drafter: Drafter,
    *,
    logits_processor: LogitsProcessor,
    draft_length: DraftLength | CostAwareDraftLength,
    stats: SpeculativeStats | None = None,
    on_step: OnStep | None = None,
) -> tuple[list[int], float] | list[tuple[list[int], float]]:
    """The draft -> verify -> accept -> roll back loop, over every row of `gen` (one row: one
    sequence). Returns (generated ids, alpha), or for a batch a list with one such pair per row.

    Invariant: the target's cache holds every accepted token of a row but the last one, which is
    fed together with the row's drafts, so one forward pass scores the last token and all drafts
    of every row. Each row accepts its own drafts (ragged acceptance); a finished row leaves the
    batch. Random numbers come from each row's `gen.uniforms` (`sampling.randomness`).
    """
    stats = stats if stats is not None else SpeculativeStats()
    target = gen.runner
    sequences = [list(prefix) for prefix in gen.prefixes]
    rows = list(range(len(sequences)))  # the rows still decoding, in the runner's (and drafter's) order
    clock = StepClock(stats.seconds if stats.timed else None, input_device(target.model))
    drafter.start(sequences)
    drafter_passes, target_passes = drafter.forward_passes, target.forward_passes
    if any(len(sequence) > 1 for sequence in sequences):  # prefill
        target.forward_rows([(sequence[:-1], None) for sequence in sequences], [int(len(s) > 1) for s in sequences])
    clock.lap("prefill")
    generated: list[list[int]] = [[] for _ in sequences]
    proposed, accepted = [0] * len(sequences), [0] * len(sequences)
    while rows:
        active = [sequences[row] for row in rows]
        draft_length.rows = len(rows)
        # 1. Draft (a chain, or a tree from an n-gram pool) for every row: gamma nodes at most, and no
        #    path longer than the room left before max_gen_len once the target's own token is counted.
        rooms = [gen.max_new_tokens[row] - len(generated[row]) - 1 for row in rows]
        drafts = drafter.draft(active, draft_length.gamma, rooms)
        clock.lap("draft")

        # 2. Verify: one target pass over each row's last accepted token and every drafted node.
        blocks = [([sequence[-1], *tree.tokens], None if tree.is_chain else [-1, *(parent + 1 for parent in tree.parents)])
                  for sequence, (tree, _) in zip(active, drafts, strict=True)]
        logits = target.forward_rows(blocks, [len(tokens) for tokens, _ in blocks])
        clock.lap("target")

        paths, ps, running = [], [], []
        for i, row in enumerate(rows):
            (tree, q), sequence = drafts[i], sequences[row]
            # 3. Accept a path of drafts, then take one token from the target.
            path, token, p = accept(logits[i], tree, q, sequence, logits_processor, gen.uniforms[row])
            n = len(path)
            clock.lap("accept")

            # 4. Roll back the target: keep the accepted path, forget the rest.
            if tree.is_chain:
                target.rollback_row(i, len(sequence) + n)
            else:
                target.keep_path_row(i, len(sequence) - 1, path)  # the root is the last accepted token
            clock.lap("rollback")
            accepted_tokens = [tree.tokens[node] for node in path]
            new_tokens, finished = gen.trim(row, accepted_tokens + [token], len(generated[row]))
            sequence += new_tokens
            generated[row] += new_tokens
            paths.append(path)
            ps.append(p)
            if not finished:
                running.append(i)

            draft_length.update(len(tree), n)
            proposed[row], accepted[row] = proposed[row] + len(tree), accepted[row] + n
            stats.record(len(tree), n, tree.depth())
            if on_step is not None:
                rejected = [tree.tokens[node] for node in range(len(tree)) if node not in path]
                on_step(Step(drafts=tuple(accepted_tokens + rejected), accepted=n, tokens=tuple(new_tokens), row=row))
            clock.lap("rest")

        # 5. Tell the drafter what was accepted (it rolls back its cache, an n-gram pool learns).
        drafter.update(active, paths, logits, ps)
        clock.lap("update")
        if 0 < len(running) < len(rows):  # finished rows stop costing compute
            target.select_rows(running)
            drafter.select_rows(running)
        rows = [rows[i] for i in running]
        clock.lap("rest")

    stats.generated_tokens += sum(len(tokens) for tokens in generated)
    stats.target_forwards += target.forward_passes - target_passes
    stats.drafter_forwards += drafter.forward_passes - drafter_passes
    return gen.results([(tokens, a / p if p else 0.0) for tokens, a, p in zip(generated, accepted, proposed, strict=True)])


MAX_ADAPTIVE_GAMMA = 16  # with adaptive_gamma, each step drafts 0 .. max(gamma, this) tokens


def check_gamma(gamma: object) -> int:
    return check_int(gamma, "gamma", 1)


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


def _speculative(inputs, drafter, target, *, encoder_decoder, use_cache, gamma, max_gen_len,
                 logits_processor, end_tokens_id, adaptive_gamma, generator, stats, on_step,
                 tokenizer=None, drafter_tokenizer=None, drafter_invariant=None, ngram=None):
    if drafter_invariant is not None and not isinstance(drafter_invariant, bool):
        raise TypeError(f"drafter_invariant must be a bool or None, got {drafter_invariant!r}")
    if not isinstance(drafter, torch.nn.Module):  # your own drafter: the `Drafter` protocol (docs/drafters.md)
        if drafter_tokenizer is not None:
            raise ValueError("drafter_tokenizer is for a drafter model with another vocabulary; a Drafter object "
                             "proposes the target's token ids: pass drafter_tokenizer=None")
        if ngram is not None:
            raise ValueError("ngram= combines a pool with a drafter model; a Drafter object drafts alone: pass ngram=None")
        if drafter_invariant:
            raise ValueError("drafter_invariant=True is for a drafter model; a Drafter object's drafts with q None "
                             "are already decided by the coupled rule")
        return _with_drafter_object(
            inputs, drafter, target, encoder_decoder=encoder_decoder, use_cache=use_cache, gamma=gamma,
            max_gen_len=max_gen_len, logits_processor=logits_processor, end_tokens_id=end_tokens_id,
            adaptive_gamma=adaptive_gamma, generator=generator, stats=stats, on_step=on_step,
        )
    check_model(drafter, "drafter", encoder_decoder)
    check_model(target, "target", encoder_decoder)
    gamma = check_gamma(gamma)
    if not isinstance(adaptive_gamma, bool):
        raise TypeError(f"adaptive_gamma must be a bool, got {adaptive_gamma!r}")
    universal = check_tokenizers(tokenizer, drafter_tokenizer, drafter, target, encoder_decoder=encoder_decoder)
    if not universal:
        check_same_vocabulary(drafter, target)
    gen = prepare(
        inputs, target, encoder_decoder=encoder_decoder, use_cache=use_cache, max_gen_len=max_gen_len,
        logits_processor=logits_processor, end_tokens_id=end_tokens_id, generator=generator, model_name="target",
    )
    if universal:  # drafts in its own vocabulary, from its own tokens of the text (sampling/universal.py)
        model_drafter = UniversalDrafter(drafter, logits_processor, tokenizer=tokenizer, drafter_tokenizer=drafter_tokenizer,
                                         target_vocab_size=vocab_size(target), uniforms=gen.uniforms, use_cache=use_cache,
                                         trees=gen.runner.supports_trees)
    else:
        model_drafter = ModelDrafter(
            drafter, logits_processor, vocab_size=vocab_size(target), use_cache=use_cache,
            encoder_input_ids=gen.encoder_input_ids, uniforms=gen.uniforms,
        )
    # None: drafter-invariant exactly where draft lengths follow timings (adaptive_gamma), so that a
    # seed means one output; with a fixed gamma the standard rule already reproduces and accepts more.
    model_drafter.coupled = adaptive_gamma if drafter_invariant is None else drafter_invariant
    model_drafter.runner.costs = pass_costs(drafter)  # its kernels, and its step's cost for adaptive gamma
    policy = CostAwareDraftLength(max(gamma, MAX_ADAPTIVE_GAMMA), gen.runner.costs, model_drafter.runner.costs,
                                  draft_seconds=lambda: model_drafter.seconds_per_draft,
                                  warm=model_drafter.is_warm, per_token_stop=True)
    if adaptive_gamma:
        draft_length = policy
        model_drafter.stop = ConfidenceStop(policy.cost, policy.verify_cost, policy.max_gamma)
    else:
        draft_length = DraftLength(gamma)
    drafter_in_loop = model_drafter
    if ngram is not None:  # the pool's draft or the model's, per step and row (sampling/hybrid.py)
        drafter_in_loop = HybridDrafter(ngram_rows(ngram, gen, universal), model_drafter, policy,
                                        fixed_gamma=None if adaptive_gamma else gamma)
        draft_length = HybridLength(max(policy.max_gamma, gamma))
    result = speculative_loop(
        gen, drafter_in_loop, logits_processor=logits_processor, draft_length=draft_length,
        stats=stats, on_step=on_step,
    )
    if universal and stats is not None:
        stats.retokenize_seconds += model_drafter.retokenize_seconds
    return result


def ngram_rows(ngram, gen: Generation, universal: bool):
    """NASD's drafter over the rows of `gen` (one pool shared, or one per row), at its defaults, for
    hybrid drafting; checked before any model runs."""
    from ngram_assisted.drafter import AUTO_BRANCHING, NgramDrafter, NgramRows
    from ngram_assisted.dynagram import DynaGram

    if universal:
        raise ValueError("ngram= drafts in the target's vocabulary beside a drafter sharing it; with "
                         "drafter_tokenizer (another vocabulary) pass ngram=None")
    rows = len(gen.prefixes)
    pools = list(ngram) if isinstance(ngram, (list, tuple)) else [ngram] * rows
    if len(pools) != rows or not all(isinstance(pool, DynaGram) for pool in pools):
        raise TypeError(f"ngram must be a SimpleDynaGram or MultiDynaGram (or one per row of the batch), got {ngram!r}")
    vocab = vocab_size(gen.runner.model)
    for pool in pools:
        pool.bind_vocabulary(vocab)
    branching = AUTO_BRANCHING if gen.runner.supports_trees else 1
    return NgramRows([NgramDrafter(pool, vocab_size=vocab, source_tokens=source, draft_cost=gen.runner.costs,
                                   branching=branching)
                      for pool, source in zip(pools, gen.encoder_input_ids or [()] * rows, strict=True)],
                     gen.runner.costs, stop_if_unknown=True)


def _with_drafter_object(inputs, drafter, target, *, encoder_decoder, use_cache, gamma, max_gen_len,
                         logits_processor, end_tokens_id, adaptive_gamma, generator, stats, on_step):
    """The loop with a drafter written outside the library: `gamma` nodes at most every step (the
    drafter may propose fewer: it knows best how sure it is)."""
    check_drafter(drafter)
    check_model(target, "target", encoder_decoder)
    gamma = check_gamma(gamma)
    if not isinstance(adaptive_gamma, bool):
        raise TypeError(f"adaptive_gamma must be a bool, got {adaptive_gamma!r}")
    if adaptive_gamma:
        # The rule learns one acceptance rate for a chain and prices a draft by a drafter model's
        # timed passes; a drafter object may draft trees and costs what it costs. It sizes its own
        # drafts within gamma, as NASD's n-gram drafter does by its cost rule.
        raise ValueError(
            f"adaptive_gamma=True sizes a drafter model's chains; a {type(drafter).__name__} drafter "
            f"chooses its own draft size up to gamma: pass adaptive_gamma=False (the default)"
        )
    gen = prepare(
        inputs, target, encoder_decoder=encoder_decoder, use_cache=use_cache, max_gen_len=max_gen_len,
        logits_processor=logits_processor, end_tokens_id=end_tokens_id, generator=generator, model_name="target",
    )
    checked = CheckedDrafter(drafter, vocab=vocab_size(target), trees=gen.runner.supports_trees)
    return speculative_loop(gen, checked, logits_processor=logits_processor, draft_length=DraftLength(gamma),
                            stats=stats, on_step=on_step)


def speculative_generate(
    inputs: Inputs,
    drafter: PreTrainedModel | Drafter,
    target: PreTrainedModel,
    tokenizer=None,
    gamma: int = 5,
    logits_processor: LogitsProcessor = GreedyProcessor(),
    max_gen_len: int = 40,
    end_tokens_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
    use_cache: bool = True,
    *,
    adaptive_gamma: bool = False,
    generator: torch.Generator | list[torch.Generator] | None = None,
    stats: SpeculativeStats | None = None,
    on_step: OnStep | None = None,
    drafter_tokenizer=None,
    drafter_invariant: bool | None = None,
    ngram: DynaGram | list[DynaGram] | None = None,
) -> tuple[list[int], float] | list[tuple[list[int], float]]:
    """Speculative decoding of a decoder-only `target` with a smaller `drafter` model, or with any
    object with the `Drafter` protocol (your own drafter: docs/drafters.md; `adaptive_gamma` is for models).

    Each step the drafter proposes `gamma` tokens, the target scores them in one forward pass, and
    a prefix is accepted: greedily (output identical to greedy `autoregressive_generate`) or by
    rejection sampling (output distributed exactly as the target's processed distribution).
    Returns (generated ids, alpha = drafts accepted / drafts proposed); for a batch (a list of
    token-id lists, a 2-D tensor, or a tokenizer's output with 2-D `input_ids`, even [1, n]; its
    attention mask's padding is removed per row: `utils.validation.INPUTS_DOC`) a list with one such
    pair per row, the rows decoded together; a 1-D tensor is one sequence. With `adaptive_gamma` each
    step drafts the number of tokens (0 .. max(gamma, 16)) that maximises the expected tokens per
    unit of measured cost (`sampling.draft_policy`), so a drafter that cannot pay on this machine
    stops drafting; without it, `gamma` every step. `stats` collects tau, forward passes and
    acceptance by position; `on_step` streams each step. `pad_token_id` is accepted for
    compatibility and unused. A drafter with another tokenizer: pass `tokenizer` (the target's) and
    `drafter_tokenizer` (the drafter's); it drafts in its own vocabulary, inputs and outputs stay
    target ids, greedy and sampling stay exact (`sampling/universal.py`; decoder-only models).
    `drafter_invariant` (sampling): the drafter drafts with the target's own random number of each
    position and a draft is accepted iff it is the token the target samples there, so the output is
    plain seeded sampling's (`autoregressive_generate` with the same generator) whatever gamma,
    adaptive_gamma or timings chose; it accepts less than the standard min(1, p/q) rule. None (the
    default): on with `adaptive_gamma` (draft lengths follow timings: only this makes a seed give
    one output), off with a fixed gamma (the standard rule already reproduces itself there).
    `ngram` (a `MultiDynaGram(8)`, say; one pool shared by a batch's rows, or a list with one per
    row): hybrid drafting: each step and row drafts from the pool or with the model, whichever is
    expected to give more tokens per unit of measured cost (`sampling/hybrid.py`), exact either way.
    """
    return _speculative(
        inputs, drafter, target, encoder_decoder=False, use_cache=use_cache, gamma=gamma,
        max_gen_len=max_gen_len, logits_processor=logits_processor, end_tokens_id=end_tokens_id,
        adaptive_gamma=adaptive_gamma, generator=generator, stats=stats, on_step=on_step,
        tokenizer=tokenizer, drafter_tokenizer=drafter_tokenizer, drafter_invariant=drafter_invariant, ngram=ngram,
    )


def speculative_generate_encoder_decoder(
    inputs: Inputs,
    drafter: PreTrainedModel | Drafter,
    target: PreTrainedModel,
    tokenizer=None,
    gamma: int = 5,
    logits_processor: LogitsProcessor = GreedyProcessor(),
    max_gen_len: int = 40,
    end_tokens_id: int | list[int] | None = None,
    pad_token_id: int | None = None,
    use_cache: bool = True,
    *,
    adaptive_gamma: bool = False,
    generator: torch.Generator | list[torch.Generator] | None = None,
    stats: SpeculativeStats | None = None,
    on_step: OnStep | None = None,
    drafter_tokenizer=None,
    drafter_invariant: bool | None = None,
    ngram: DynaGram | list[DynaGram] | None = None,
) -> tuple[list[int], float] | list[tuple[list[int], float]]:
    """`speculative_generate` for encoder-decoder models: `inputs` are the encoder's ids, in any
    form `speculative_generate` takes (each model's encoder runs once); returns the decoder's generated ids without the start token.
    A `drafter_tokenizer` with another vocabulary is refused (decoder-only models only)."""
    return _speculative(
        inputs, drafter, target, encoder_decoder=True, use_cache=use_cache, gamma=gamma,
        max_gen_len=max_gen_len, logits_processor=logits_processor, end_tokens_id=end_tokens_id,
        adaptive_gamma=adaptive_gamma, generator=generator, stats=stats, on_step=on_step,
        tokenizer=tokenizer, drafter_tokenizer=drafter_tokenizer, drafter_invariant=drafter_invariant, ngram=ngram,
    )
