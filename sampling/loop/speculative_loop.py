"""The one speculative loop (Leviathan et al. 2023, Chen et al. 2023): draft -> verify -> accept ->
roll back, over every row of a batch, with any `Drafter` and any `DraftPolicy`; and its counters.

Every speculative function ends here (`sampling/speculative.py`, `ngram_assisted/nasd.py`): only
the drafter differs. Decoder-only versus encoder-decoder is the runner's business.

The words, used with these meanings everywhere in the library (as vLLM's rejection sampler
defines its own):

- **row**: one sequence being generated; a batch has several, each accepts its own drafts.
- **step**: one verification of a row: the target scores the row's last accepted token and its
  drafts in one pass (a batch's rows share that pass: one pass, as many steps as rows). The
  prompt's pass (prefill) is not a step.
- **draft** (draft token, node): a token the drafter proposes for a step, in a chain or a tree
  (`DraftTree`); its **q** is the drafter's distribution it was drawn from (None: deterministic).
- **accepted**: the drafts the target's rule keeps, a path from the root down (greedy: each is the
  target's argmax; sampling: min(1, p/q), or the coupled rule for q None); the first rejection ends it.
- **bonus token**: the target's own token after an accepted path that every draft passed; the
  **recovered token**: the one drawn from the residual max(0, p - q) at the first rejection. Every
  step ends with one of the two, so a row gains 1 + accepted tokens a step.
- **budget** (`max_drafts`): the most draft nodes a row may propose in a step, given by the
  `DraftPolicy` (`budget(num_rows)`); `max_budget`, the most any step of a cost-aware policy gives.
- **depth cap** (`max_depths`): per row, the deepest path its drafts may have this step: what
  still fits before `max_gen_len` (and the model's context).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch import Tensor

from sampling.loop.acceptance import Verdict, accept_rows
from sampling.loop.common import Generation, OnStep, Step
from sampling.loop.drafts import Draft, Drafter
from sampling.loop.logprobs import step_logits
from sampling.loop.progress import Progress
from sampling.loop.step_clock import StepClock
from sampling.policy.draft_policy import DraftPolicy, budget_of
from utils.logits_processors import LogitsProcessor
from utils.runners.model_info import model_devices
from utils.runners.protocol import Runner


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
    - `cascade_proposed`, `cascade_accepted`: cascade drafting (`sampling/drafters/cascade.py`): tokens the
      drafter model's own proposer fed to its passes, and those that were the drafter's own drafts
      with a draft after them in the same pass (each one a drafter pass saved: for one row,
      `drafter_forwards` is the cascade-off count less `cascade_accepted`).
    - `retokenize_seconds`, `lossy_text_rows`: a drafter with another tokenizer: time spent moving
      text between the tokenizers; rows decoded plainly after a text one of them could not
      encode losslessly (`sampling/drafters/universal.py`).
    - `counters`: name -> value, a drafter kind's own counters that have no field here (`add`).
    - `seconds` (with `timed=True`): phase -> seconds, summed over calls: "prefill", "draft" (the
      drafter's work, its model's passes included), "target" (the verification pass), "accept",
      "rollback" (the target's cache), "update" (the drafter told what was accepted: its cache, a
      pool's learning) and "rest" (the loop's own bookkeeping). Off by default: on an accelerator
      each phase waits for the device's queued work before it is timed.
    - `logprobs`: one list per row of every call (in call order, a batch's rows in order): for each
      returned token, log softmax of the target's raw logits (before any processor) at that token,
      read from the verification passes (`sampling/loop/logprobs.py`); `collect_logprobs=False` skips them.
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
    cascade_proposed: int = 0
    cascade_accepted: int = 0
    lossy_text_rows: int = 0  # a drafter with another tokenizer: rows decoded plainly after a text one could not round-trip
    retokenize_seconds: float = 0.0  # a drafter with another tokenizer: time spent moving text between tokenizers
    timed: bool = False
    seconds: dict[str, float] = field(default_factory=dict)
    logprobs: list[list[float]] = field(default_factory=list)
    collect_logprobs: bool = True  # False: `logprobs` stays empty (nothing is computed for it)
    counters: dict[str, float] = field(default_factory=dict)  # a drafter kind's own counters without a field here

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

    def add(self, counters: dict[str, float]) -> None:
        """A drafter kind's own counters (`sampling.loop.options.Drafting.counters`): each added to its
        field, or to `counters` when it has none."""
        for name, value in counters.items():
            if name in self.__dataclass_fields__ and name not in ("timed", "seconds", "counters", "collect_logprobs"):
                setattr(self, name, getattr(self, name) + value)
            else:
                self.counters[name] = self.counters.get(name, 0) + value

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


def verification_blocks(sequences: list[list[int]], drafts: list[Draft]) -> list[tuple[list[int], list[int] | None]]:
    """Each row's block for the target's pass: its last accepted token (the root) and its drafted
    nodes; parents None for a chain, else the tree's parents within the block (-1: the root)."""
    trees = [draft.tree for draft in drafts]
    return [([sequence[-1], *tree.tokens], None if tree.is_chain else [-1, *(parent + 1 for parent in tree.parents)])
            for sequence, tree in zip(sequences, trees, strict=True)]


def roll_back(target: Runner, sequences: list[list[int]], drafts: list[Draft], verdicts: list[Verdict]) -> None:
    """Step 4: each row's target cache keeps its accepted path (a chain: its leading drafts) and
    forgets the other drafts; the root of a tree is the row's last accepted token."""
    for i, (sequence, draft, verdict) in enumerate(zip(sequences, drafts, verdicts, strict=True)):
        if draft.tree.is_chain:
            target.rollback_row(i, len(sequence) + len(verdict.path))
        else:
            target.keep_path_row(i, len(sequence) - 1, verdict.path)


def gain(rows: Progress, drafts: list[Draft], verdicts: list[Verdict], logits: list[Tensor]) -> list[tuple[list[int], bool]]:
    """Step 5: each row gains its accepted drafts and the target's token, cut at an end token, its
    length budget or a stopping rule -> per row (the tokens it gained, whether it is finished)."""
    gains = []
    for i, (draft, verdict) in enumerate(zip(drafts, verdicts, strict=True)):
        block_logits = step_logits(logits[i], verdict.path) if rows.needs_logits else None  # what predicted its tokens
        gains.append(rows.extend(i, [draft.tree.tokens[node] for node in verdict.path] + [verdict.token], block_logits))
    return gains


def learn(policy: DraftPolicy, stats: SpeculativeStats, rows: Progress, drafts: list[Draft], verdicts: list[Verdict]) -> None:
    """Step 5: the policy, the stats and each row's own counts learn every row's outcome."""
    for i, (draft, verdict) in enumerate(zip(drafts, verdicts, strict=True)):
        policy.update(len(draft.tree), len(verdict.path))
        rows.count(i, len(draft.tree), len(verdict.path))
        stats.record(len(draft.tree), len(verdict.path), draft.tree.depth())


def stream(on_step: OnStep, live: list[int], drafts: list[Draft], verdicts: list[Verdict],
           gains: list[tuple[list[int], bool]]) -> None:
    """Step 5: `on_step` hears each row's step, its accepted drafts first, then the rejected ones."""
    for row, draft, verdict, (new_tokens, _) in zip(live, drafts, verdicts, gains, strict=True):
        accepted = [draft.tree.tokens[node] for node in verdict.path]
        rejected = [draft.tree.tokens[node] for node in range(len(draft.tree)) if node not in verdict.path]
        on_step(Step(drafts=tuple(accepted + rejected), accepted=len(verdict.path), tokens=tuple(new_tokens), row=row))


def speculative_loop(
    gen: Generation,
    drafter: Drafter,
    *,
    logits_processor: LogitsProcessor,
    policy: DraftPolicy,
    stats: SpeculativeStats | None = None,
    on_step: OnStep | None = None,
) -> tuple[list[int], float] | list[tuple[list[int], float]]:
    """The draft -> verify -> accept -> roll back loop over every row of `gen` -> (generated ids, alpha),
    or for a batch a list with one such pair per row. Invariant: the target's cache holds every
    accepted token of a row but the last, fed with the row's drafts, so one pass scores the last token
    and all drafts of every row. Each row accepts its own drafts; a finished row leaves the batch.
    Random numbers: each row's `gen.uniforms`. `policy`: each step's budget, told each row's outcome."""
    target, rows = gen.runner, Progress(gen, logprobs=stats is not None and stats.collect_logprobs)
    stats = stats if stats is not None else SpeculativeStats()
    clock = StepClock(stats.seconds if stats.timed else None, model_devices(target.model))
    drafter.start(rows.sequences)
    drafter_passes, target_passes = drafter.forward_passes, target.forward_passes
    gen.prefill()  # all but each row's last token, less a kept prompt
    clock.lap("prefill")
    while rows.live:
        active = rows.active()
        # 1. Draft (a chain, or a tree from an n-gram pool) for every row: the step's budget of
        #    nodes at most, no path deeper than the row's `max_depths` (what fits before max_gen_len).
        drafts = [Draft(*draft) for draft in drafter.draft(active, budget_of(policy, len(rows.live)), rows.max_depths())]
        clock.lap("draft")
        # 2. Verify: one target pass over each row's last accepted token and every drafted node.
        blocks = verification_blocks(active, drafts)
        logits = target.forward_rows(blocks, [len(tokens) for tokens, _ in blocks])
        clock.lap("target")
        # 3. Accept, every row at once: a path of drafts, then one token from the target.
        verdicts = accept_rows(logits, drafts, active, logits_processor, rows.uniforms())
        clock.lap("accept")
        # 4. Roll back the target: keep the accepted paths, forget the rest.
        roll_back(target, active, drafts, verdicts)
        clock.lap("rollback")
        # 5. Learn: each row gains its tokens; the policy, the stats and `on_step` hear of its step.
        gains = gain(rows, drafts, verdicts, logits)
        learn(policy, stats, rows, drafts, verdicts)
        if on_step is not None:
            stream(on_step, rows.live, drafts, verdicts, gains)
        clock.lap("rest")
        # 6. Update the drafter: what was accepted (it rolls back its cache, an n-gram pool learns).
        drafter.update(active, [verdict.path for verdict in verdicts], logits, [verdict.p for verdict in verdicts])
        clock.lap("update")
        # 7. Narrow: finished rows leave the batch; the target's runner and the drafter keep the others.
        going_on = [i for i, (_, finished) in enumerate(gains) if not finished]
        if rows.keep(going_on):
            target = gen.narrow(going_on)
            drafter.select_rows(going_on)
        clock.lap("rest")
    stats.generated_tokens += sum(len(tokens) for tokens in rows.generated)
    stats.target_forwards += target.forward_passes - target_passes
    stats.drafter_forwards += drafter.forward_passes - drafter_passes
    if rows.logprobs is not None:
        stats.logprobs += rows.logprobs.lists()
    return gen.results(list(zip(rows.generated, rows.alphas(), strict=True)), rows.sequences)
