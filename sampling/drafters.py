"""Drafters: where speculative decoding gets its guesses. The loop in `sampling/speculative.py`
only talks to this interface, so a small model and an n-gram pool (`ngram_assisted/`) plug into the
same draft -> verify -> accept loop."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import Tensor
from transformers import PreTrainedModel

from sampling.randomness import DRAFT, PositionUniforms
from utils.caching import ModelRunner, synchronize
from utils.logits_processors import LogitsProcessor, inverse_cdf


@dataclass(frozen=True)
class DraftTree:
    """Drafted tokens as a tree: node i proposes `tokens[i]` after its parent, `parents[i]` < i
    (-1: after the last accepted token). Siblings propose distinct tokens. A chain, what a model
    drafter proposes, has parents [-1, 0, 1, ...]."""

    tokens: list[int]
    parents: list[int]

    @classmethod
    def chain(cls, tokens: list[int]) -> DraftTree:
        return cls(list(tokens), list(range(-1, len(tokens) - 1)))

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def is_chain(self) -> bool:
        return all(parent == node - 1 for node, parent in enumerate(self.parents))

    def path_to(self, node: int) -> list[int]:
        """The tokens from the root's first child down to `node` (none for -1)."""
        path = []
        while node >= 0:
            path.append(self.tokens[node])
            node = self.parents[node]
        return path[::-1]

    def depth(self) -> int:
        depths: list[int] = []
        for parent in self.parents:
            depths.append(1 + (depths[parent] if parent >= 0 else 0))
        return max(depths, default=0)


class Drafter(Protocol):
    """What the speculative loop needs from a source of drafts.

    `sequence` is always the whole accepted sequence (decoder prefix + generated tokens).
    """

    forward_passes: int  # model forward passes spent drafting (0 for an n-gram pool)

    def start(self, sequence: list[int]) -> None:
        """A new generation begins with `sequence` (the prompt)."""

    def draft(self, sequence: list[int], max_drafts: int, max_depth: int) -> tuple[DraftTree, Tensor | None]:
        """Propose up to `max_drafts` (possibly 0) nodes, no path deeper than `max_depth` (the room
        left before `max_gen_len`), after `sequence` -> (tree, q).

        q: (len(tree), V) the processed distributions a chain's drafts were sampled from, or None
        when the drafts are deterministic (q one-hot) or the processor is greedy. Only deterministic
        drafters propose trees that are not chains.
        """

    def update(self, sequence: list[int], path: list[int], target_logits: Tensor, p: Tensor | None) -> None:
        """The target accepted the nodes `path` (root to leaf) of the last tree; `sequence` now ends
        with their tokens and the target's own. `target_logits`: (1 + len(tree), V), the target's
        scores at the root (row 0) and after every node i (row 1 + i), accepted or not; `p`: the
        same rows processed (None when greedy)."""


DRAFT_TIME_WEIGHT = 0.2  # weight of one drafting step's timing in the running average


class ModelDrafter:
    """A small language model as drafter (Leviathan et al. 2023): drafts are sampled from q, the
    drafter's distribution under the same logits processor as the target's p.

    The drafter's cache always holds a prefix of the accepted sequence: what it has not seen yet
    (the target's token, and the last draft when all were accepted) is fed at the next `draft`.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        processor: LogitsProcessor,
        *,
        vocab_size: int,
        use_cache: bool = True,
        encoder_input_ids: list[int] | None = None,
        uniforms: PositionUniforms | None = None,
    ) -> None:
        self.runner = ModelRunner(model, use_cache=use_cache, encoder_input_ids=encoder_input_ids)
        self.processor = processor
        self.vocab_size = vocab_size  # the target's logit width: q must live in the same space as p
        self.uniforms = uniforms or PositionUniforms()  # draft at position t: the inverse CDF of q at its DRAFT number
        self._accepted_length = 0  # len(sequence) when the last draft started
        # Seconds a drafting step costs per drafted token, timed (the catch-up pass over the
        # target's token, every drafter pass, the processing and sampling): a running average.
        self.seconds_per_draft: float | None = None

    @property
    def forward_passes(self) -> int:
        return self.runner.forward_passes

    def start(self, sequence: list[int]) -> None:
        self.runner.rollback(0)

    def _distribution(self, logits: Tensor, history: list[int] | None) -> Tensor:
        """Drafter logits (V_d,) after `history` -> q (V,) in the target's vocabulary, processed as
        the target's p is. Columns the target lacks (padding rows) are dropped; columns the drafter
        lacks get q = 0: still a valid proposal."""
        width = logits.shape[-1]
        if width > self.vocab_size:
            logits = logits[: self.vocab_size]
        elif width < self.vocab_size:
            logits = torch.nn.functional.pad(logits, (0, self.vocab_size - width), value=-torch.inf)
        return self.processor(logits[None], history)[0]

    def draft(self, sequence: list[int], max_drafts: int, max_depth: int) -> tuple[DraftTree, Tensor | None]:
        self._accepted_length = len(sequence)
        max_drafts = min(max_drafts, max_depth)  # a chain: every node is one deeper
        if max_drafts <= 0:
            return DraftTree.chain([]), None
        start = time.perf_counter()
        logits = self.runner.forward(sequence[len(self.runner) :])  # catch up on unseen tokens
        drafts, qs = [], []
        for i in range(max_drafts):
            history = sequence + drafts if self.processor.needs_history else None  # accepted tokens, its drafts
            q = self._distribution(logits[-1], history)
            if self.processor.is_greedy:
                token = int(q.argmax())
            else:
                position = len(sequence) + i - self.uniforms.prefix_length
                token = int(inverse_cdf(q, self.uniforms(position, DRAFT)))
            drafts.append(token)
            qs.append(q)
            if i + 1 < max_drafts:  # the last draft is fed only if accepted (next round)
                logits = self.runner.forward([token])
        q = None if self.processor.is_greedy else torch.stack(qs)
        synchronize(self.runner.device)
        seconds = (time.perf_counter() - start) / max_drafts
        previous = self.seconds_per_draft
        self.seconds_per_draft = seconds if previous is None else previous + DRAFT_TIME_WEIGHT * (seconds - previous)
        return DraftTree.chain(drafts), q

    def update(self, sequence: list[int], path: list[int], target_logits: Tensor, p: Tensor | None) -> None:
        # Keep the accepted drafts the runner has seen; drop the rejected ones.
        seen_drafts = len(self.runner) - self._accepted_length
        self.runner.rollback(self._accepted_length + min(len(path), seen_drafts))
