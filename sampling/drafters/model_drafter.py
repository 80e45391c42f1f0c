"""The drafter model kind's drafter: a small language model drafts a chain (`ModelDrafter`)."""

from __future__ import annotations

import time
from typing import Protocol

import torch
from torch import Tensor
from transformers import PreTrainedModel

from sampling.drafters.cascade import Cascade
from sampling.loop.drafts import DraftTree
from sampling.loop.randomness import DRAFT, TARGET, PositionUniforms
from sampling.policy.draft_confidence import ConfidenceStop
from sampling.policy.estimators import RunningAverage
from utils.cost_model import PassCosts
from utils.logits_processors import LogitsProcessor, inverse_cdf
from utils.runners import make_runner
from utils.runners.passes import synchronize
from utils.runners.prompt_cache import PromptCache


class DraftReading(Protocol):
    """How a `ModelDrafter` reads its pass: logits -> q, q -> the draft (`ModelDrafter`'s own
    `distribution` and `sample` by default)."""

    def distribution(self, logits: Tensor, history: list[int] | None) -> Tensor: ...

    def sample(self, q: Tensor, row: int, position: int) -> int: ...


DRAFT_TIME_WEIGHT = 0.2  # weight of one drafting step's timing in the running average


class ModelDrafter:
    """A small language model as drafter (Leviathan et al. 2023): drafts are sampled from q, the
    drafter's distribution under the same logits processor as the target's p. The rows of a batch
    draft in lockstep, one drafter pass per drafted token for all rows (fewer with a `cascade`:
    several drafts from one pass, `sampling/drafters/cascade.py`).

    Each row's cache always holds a prefix of its accepted sequence: what it has not seen yet (the
    target's token, and the last draft when all were accepted) is fed at the next `draft`.

    Host reads: a step's drafts stay on the device (each drawn there and fed to the next pass as a
    tensor block) and are read once, all rows together, after the last pass; only what needs each
    draft on the host reads it as it is drafted (`reads_each_draft`: the per-token stop, the cascade,
    another reading, a history-reading processor).

    `coupled` (drafter-invariant sampling, Daliri et al. 2024 with the inverse-CDF coupling): the
    draft at position t is F_q^{-1}(u_t), with the uniform u_t the target samples that position
    with, and the chain is verified as deterministic drafts: accepted iff F_p^{-1}(u_t) equals it.
    Every emitted token is then F_p^{-1}(u_t), plain sampling's own, whatever was drafted.

    `stop` (adaptive drafting): the per-token rule that ends each chain (`sampling.policy.draft_confidence`);
    None: every row drafts the `max_drafts` it is given. Where a host read waits for the drafter's device
    (`judges_after`), the rule is not asked draft by draft: each chain drafts the stop's `planned_length` (the cost
    model's best for the pair's recent acceptance by position), its confidences stay on the device beside its
    drafts, both are read in the step's one transfer, and the stop keeps the best prefix then.
    """

    DEVICE: bool | None = None  # draft as where a host read waits for the device: True, False, or None (`on_device`)

    def __init__(
        self,
        model: PreTrainedModel,
        processor: LogitsProcessor,
        *,
        vocab_size: int,
        uniforms: list[PositionUniforms],
        use_cache: bool = True,
        encoder_input_ids: list[list[int]] | None = None,
        coupled: bool = False,
        costs: PassCosts | None = None,
        stop: ConfidenceStop | None = None,
        cascade: Cascade | None = None,
        reading: DraftReading | None = None,
        max_tokens: int | None = None,
        timed: bool = True,
    ) -> None:
        rows = len(uniforms)
        # Its costs: its kernels, and its step's cost for adaptive gamma (`utils.calibration.pass_costs`).
        self.runner = make_runner(model, rows=rows, use_cache=use_cache, encoder_input_ids=encoder_input_ids,
                                  costs=costs, max_tokens=max_tokens)
        self.processor = processor
        self.vocab_size = vocab_size  # the target's logit width: q must live in the same space as p
        self.uniforms = uniforms  # row b's draft at position t: the inverse CDF of q at its DRAFT number
        # Drafter-invariant sampling: draft with the very number the target's token at that position
        # uses (TARGET), and hand the chain over as deterministic drafts (q None: the coupled rule).
        self.coupled = coupled
        self._accepted_lengths = [0] * rows  # len(sequence) of each row when the last draft started
        # With adaptive drafting, when to stop: the drafter's confidence in each draft (q of the
        # drafted token) against the measured costs (`sampling.policy.draft_confidence`); None: fixed gamma.
        self.stop = stop
        # Each row's confidences in its drafts of this step (all drafted) and how many the stop kept (`stop.observe_step`).
        self._confidences: list[list[float]] = [[] for _ in range(rows)]
        self._kept = [0] * rows
        self._judged_after = self._reads_each = False  # this step's `judges_after` and `reads_each_draft` (`draft`)
        # Cascade drafting (`sampling.drafters.cascade`): a proposer whose tokens the drafter checks in one
        # pass of its own; None: one pass per drafted token.
        self.cascade = cascade
        # How a pass's logits become q and a draft (None: in the target's vocabulary, `distribution`
        # and `sample`); a drafter with another tokenizer reads them its own way (`sampling.drafters.universal`).
        self.reading = reading if reading is not None else self
        # Seconds a drafting step costs per drafted token (all rows), timed: the catch-up pass over
        # the target's tokens, every drafter pass, the processing and sampling. A running average.
        self.draft_time = RunningAverage(DRAFT_TIME_WEIGHT)
        # Whether to time it: a timing synchronizes the device twice a step (`passes.synchronize`),
        # worth it only where something prices drafts by `seconds_per_draft` (the cost-aware policy).
        self.timed = timed
        # A conversation's kept keys (`utils/runners/prompt_cache.py`), set where the drafter has a cache of its own:
        # one row's first drafting step reads only what its last call did not (`start`); the call keeps its keys at
        # its end (`Generation.results`).
        self.prompt_cache: PromptCache | None = None

    @property
    def forward_passes(self) -> int:
        return self.runner.forward_passes

    @property
    def seconds_per_draft(self) -> float | None:
        """What a drafted token costs, in seconds (None before any drafting was timed)."""
        return self.draft_time.value

    def start(self, sequences: list[list[int]]) -> None:
        for row in range(len(sequences)):
            self.runner.rollback_row(row, 0)
        if self.prompt_cache is not None and len(sequences) == 1:
            self.prompt_cache.restore(self.runner, sequences[0][:-1])
        if self.cascade is not None:
            self.cascade.start(len(sequences))

    def counters(self) -> dict[str, float]:
        """Its own counters for `SpeculativeStats`: the cascade's proposals fed and taken."""
        if self.cascade is None:
            return {}
        return {"cascade_proposed": self.cascade.proposed, "cascade_accepted": self.cascade.accepted}

    def is_warm(self) -> bool:
        """Whether some row's cache holds tokens: the drafter has drafted in this generation."""
        return any(self.runner.row_length(row) for row in range(len(self.uniforms)))

    def distribution(self, logits: Tensor, history: list[int] | None) -> Tensor:
        """Drafter logits (V_d,) after `history` -> q (V,) in the target's vocabulary, processed as
        the target's p is. Columns the target lacks (padding rows) are dropped; columns the drafter
        lacks get q = 0: still a valid proposal."""
        width = logits.shape[-1]
        if width > self.vocab_size:
            logits = logits[: self.vocab_size]
        elif width < self.vocab_size:
            logits = torch.nn.functional.pad(logits, (0, self.vocab_size - width), value=-torch.inf)
        return self.processor(logits[None], history)[0]

    def sample(self, q: Tensor, row: int, position: int) -> int:
        """Row `row`'s draft at sequence position `position` from q, read to the host (`draw`)."""
        return int(self.draw(q, row, position))

    def draw(self, q: Tensor, row: int, position: int) -> Tensor:
        """Row `row`'s draft at sequence position `position` from q, a 0-d tensor on q's device: its
        argmax (greedy), else the inverse CDF of q at the position's DRAFT number (TARGET when `coupled`)."""
        if self.processor.is_greedy:
            return q.argmax()
        stream = TARGET if self.coupled else DRAFT
        uniforms = self.uniforms[row]
        return inverse_cdf(q, uniforms.span(position - uniforms.prefix_length, 1, stream)[0])

    @property
    def reads_each_draft(self) -> bool:
        """Whether a draft is read to the host as it is drafted: by a reading of its own (another
        tokenizer), the confidence stop (q of each draft), the cascade (compares it with its
        proposal) or a processor that needs the history. Otherwise drafts stay on the device, each
        fed to the next pass from there, and a step reads them once (`_read_drafts`)."""
        return (self.reading is not self or (self.stop is not None and not self.judges_after)
                or self.cascade is not None or self.processor.needs_history)

    @classmethod
    def read_waits(cls, device: torch.device) -> bool:
        """Whether a host read waits for a drafter on `device` (`DEVICE` None: it is not a CPU)."""
        return cls.DEVICE if cls.DEVICE is not None else device.type != "cpu"

    @property
    def on_device(self) -> bool:
        """Whether a host read waits for the drafter's device (`read_waits`): there its chains are judged once
        drafted (`judges_after`), its trees grow on the device (`ModelTreeDrafter.on_device`) and the cascade is off
        unless asked for (`sampling.drafters.model_kind`)."""
        return self.read_waits(self.runner.device)

    @property
    def judges_after(self) -> bool:
        """Whether the per-token stop judges a step's chains once they are drafted and read (one host read a step)
        rather than draft by draft: `on_device`, for drafts the drafter reads on the device (no cascade, no other
        reading, no processor that reads the history)."""
        if self.stop is None or self.cascade is not None or self.reading is not self or self.processor.needs_history:
            return False
        return self.on_device

    def _next_draft(self, q: Tensor, row: int, position: int) -> Tensor | int:
        """Row `row`'s draft at `position`: on the device unless `reads_each_draft` (as the step began)."""
        if self.reading is not self:
            return self.reading.sample(q, row, position)
        token = self.draw(q, row, position)
        return int(token) if self._reads_each else token

    @staticmethod
    def _read_drafts(drafts: list[list[Tensor | int]], confidences: list[list[Tensor | float]]
                     ) -> tuple[list[list[int]], list[list[float]]]:
        """Every row's drafts as ids and their confidences as floats: those still on the device read in one host
        transfer (ids in float64, exact below 2^53)."""
        ids = [token for chain in drafts for token in chain if isinstance(token, Tensor)]
        beliefs = [c for row in confidences for c in row if isinstance(c, Tensor)]
        parts = [torch.stack(part).double() for part in (ids, beliefs) if part]  # ids first, then the confidences
        values = iter(torch.cat(parts).tolist() if parts else [])
        ids = [[int(next(values)) if isinstance(token, Tensor) else token for token in chain] for chain in drafts]
        return ids, [[next(values) if isinstance(c, Tensor) else c for c in row] for row in confidences]

    def draft(self, sequences, max_drafts, max_depths):
        self._accepted_lengths = [len(sequence) for sequence in sequences]
        self._confidences, self._kept = [[] for _ in sequences], [0] * len(sequences)
        self._judged_after, self._reads_each = self.judges_after, self.reads_each_draft  # asked once a step
        if self._judged_after:  # the chain is judged once drafted: as long as the pair's recent chains say pays
            max_drafts = min(max_drafts, self.stop.planned_length(len(sequences)))
        lengths = [max(0, min(max_drafts, max_depth)) for max_depth in max_depths]  # a chain: every node is one deeper
        if not any(lengths):
            return [(DraftTree.chain([]), None) for _ in sequences]
        start = self._clock()  # once the queued work is done
        # Each drafting row feeds what it has not seen (the target's token...), then its last draft;
        # with a cascade, proposals after it (`sampling.drafters.cascade`): one pass may give several drafts.
        # A row's pending tokens: a list, or its last draft kept on the device (`reads_each_draft`).
        pending = [sequence[self.runner.row_length(b) :] if k else []
                   for b, (sequence, k) in enumerate(zip(sequences, lengths, strict=True))]
        # A cold catch-up (the prompt, or a long stretch the drafter skipped) is paid once, not per
        # drafted token: timed in, it would price every later draft out of paying.
        cold = max(len(tokens) for tokens in pending) > max(lengths) + 1
        drafts: list[list[Tensor | int]] = [[] for _ in sequences]  # read to the host once, after the loop
        qs: list[list[Tensor]] = [[] for _ in sequences]
        confidences: list[list[Tensor | float]] = [[] for _ in sequences]  # on the device where judged after
        while any(map(len, pending)):
            proposals = [self.cascade.propose(b, sequence, drafts[b], lengths[b] - len(drafts[b]), len(pending[b]),
                                              len(sequences)) if len(pending[b]) and self.cascade is not None and not cold else []
                         for b, sequence in enumerate(sequences)]
            blocks = [(tokens + extra if extra else tokens, None) for tokens, extra in zip(pending, proposals, strict=True)]
            logits = self.runner.forward_rows(blocks, [len(extra) + 1 if len(tokens) else 0
                                                       for tokens, extra in zip(pending, proposals, strict=True)])
            if cold:
                start, cold = self._clock(), False
            for b, sequence in enumerate(sequences):
                if len(pending[b]):
                    pending[b] = self._take(b, sequence, logits[b], proposals[b], drafts, qs, confidences, lengths)
        drafts, confidences = self._read_drafts(drafts, confidences)  # the step's one host read of its drafts
        if self.cascade is not None:
            for b, chain in enumerate(drafts):
                self.cascade.finish(b, chain)
        if self.timed:
            self.draft_time.add((self._clock() - start) / max(lengths))
        if self.stop is not None:  # drafted already: keep what the verification pass can afford
            kept = [self.stop.keep(c, len(sequences)) for c in confidences]
            for c, k in zip(confidences, kept, strict=True):
                if c and not k:
                    self.stop.on_discard()
            drafts, qs = [d[:k] for d, k in zip(drafts, kept, strict=True)], [q[:k] for q, k in zip(qs, kept, strict=True)]
            self._confidences, self._kept = confidences, kept
        deterministic = self.processor.is_greedy or self.coupled
        return [(DraftTree.chain(tokens), None if deterministic or not tokens else torch.stack(q))
                for tokens, q in zip(drafts, qs, strict=True)]

    def _clock(self) -> float:
        """The time once the device's queued work is done (0.0, with no wait, when not `timed`)."""
        if not self.timed:
            return 0.0
        synchronize(*self.runner.devices)
        return time.perf_counter()

    def _take(self, b, sequence, logits, proposals, drafts, qs, confidences, lengths) -> list[int] | Tensor:
        """Row b's drafts from one pass: `logits[j]` follows its j-th proposal (row 0: the fed
        tokens). Each position drafts from its own q as a one-token pass would; a proposal equal to
        the draft lets the next position go on. -> what the row feeds next (its last draft, a (1,)
        tensor when it is on the device, or nothing once its chain is drafted); the cache forgets the proposals it did not take."""
        matched, feed, first = 0, [], len(drafts[b])
        for j in range(len(proposals) + 1):
            i = len(drafts[b])
            history = sequence + drafts[b] if self.processor.needs_history else None  # accepted tokens, its drafts
            q = self.reading.distribution(logits[j], history)
            drafts[b].append(self._next_draft(q, b, len(sequence) + i))
            qs[b].append(q)
            if self._judged_after:  # judged once the chain is drafted and read
                confidences[b].append(self._belief_in(logits[j], q, drafts[b][-1], history))
            elif self.stop is not None:
                confidences[b].append(self._confidence(logits[j], q, drafts[b][-1], history))
                if not self.stop.keep_drafting(confidences[b], len(lengths)):  # lengths: one per row drafting
                    lengths[b] = i + 1
            same = j < len(proposals) and drafts[b][-1] == proposals[j]
            matched += same
            if i + 1 >= lengths[b] or not same:
                last = drafts[b][-1]  # fed only if accepted; from the device when it is there
                feed = (last.view(1) if isinstance(last, Tensor) else [last]) if i + 1 < lengths[b] else []
                break
        if proposals:
            self.cascade.taken(len(drafts[b]) - first - 1)  # drafts beyond the pass's first: passes saved
            self.runner.rollback_row(b, self.runner.row_length(b) - (len(proposals) - matched))
        return feed

    def belief(self, logits: Tensor, history: list[int] | None) -> Tensor:
        """What the drafter believes of each next token (V,): q, or under greedy decoding, whose q is one-hot (every
        draft would read 1.0: a sure draft and a guess alike), the softmax of its processed scores. The per-token
        stop reads its drafts' confidences there, the tree drafter its children's."""
        if not self.processor.is_greedy:
            return self.distribution(logits, history)
        scores = self.processor.scores(logits[None, : self.vocab_size], history)[0]
        return scores.softmax(dim=-1, dtype=torch.promote_types(scores.dtype, torch.float32))  # bfloat16's: too coarse

    def _belief_in(self, logits: Tensor, q: Tensor, draft: Tensor | int, history: list[int] | None) -> Tensor:
        """The drafter's probability of its draft, a 0-d tensor on its device (`belief`, q itself when it is one)."""
        belief = q if not self.processor.is_greedy else self.belief(logits, history)
        return belief[draft] if isinstance(draft, int) else belief.gather(0, draft.view(1)).view(())  # no read

    def _confidence(self, logits: Tensor, q: Tensor, draft: int, history: list[int] | None) -> float:
        """The drafter's probability of its draft, read to the host (for the per-token stop draft by draft)."""
        return float(self._belief_in(logits, q, draft, history))

    def update(self, sequences, paths, target_logits, p) -> None:
        # Keep the accepted drafts each row's cache has seen; drop the rejected ones.
        for b, path in enumerate(paths):
            self.runner.rollback_row(b, min(self.runner.row_length(b), self._accepted_lengths[b] + len(path)))
        if self.stop is not None and any(self._confidences):  # a step that started chains: what it gave
            self.stop.observe_step(self._confidences, self._kept, [len(path) for path in paths])
            self._confidences, self._kept = [[] for _ in paths], [0] * len(paths)

    def select_rows(self, keep: list[int]) -> None:
        self.runner = self.runner.select_rows(keep)
        self.uniforms = [self.uniforms[b] for b in keep]
        self._accepted_lengths = [self._accepted_lengths[b] for b in keep]
        self._confidences = [self._confidences[b] for b in keep]
        self._kept = [self._kept[b] for b in keep]
        if self.cascade is not None:
            self.cascade.select_rows(keep)
