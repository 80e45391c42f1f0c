"""A drafter with another tokenizer: universal speculative decoding, exact in greedy and sampling.

The drafter reads the text so far in its own tokens and drafts in its own vocabulary; the target
only ever sees target tokens, so the loop (`sampling/loop/speculative_loop.py`) and its acceptance rules are
those of the same-tokenizer case.

- Text, target -> drafter (every drafting step, per row): decode the target tokens from an anchor
  on (a clean boundary of both tokenizations, kept `LOOKBEHIND` target tokens behind the end),
  re-encode that text with the drafter's tokenizer, and keep the drafter's cache for the common
  prefix of its old and new tokens: only the tail that moved is read again, never the prompt
  (transformers' `AssistedCandidateGeneratorDifferentTokenizers` does the same with a look-behind).
- Greedy: the drafts are decoded to text and re-encoded with the target's tokenizer (the encoding
  of window text + draft text, less the window's own tokens). They are deterministic drafts
  (q None): a draft is accepted iff it is the target's argmax, so the output is greedy decoding's,
  token for token, however the tokenizers split the text (a draft that re-encodes otherwise is
  simply rejected).
- Sampling: token-level intersection (TLI, Timor et al. 2025). The drafter's scores are restricted
  to the tokens both vocabularies spell alike (`sampling/loop/vocabularies.py`), moved to the target's
  vocabulary and processed as the target's are; q is that distribution (zero outside the
  intersection), each draft maps to the target token of the same string, and speculative sampling
  (min(1, p/q), residual max(0, p - q)) gives the target's law exactly, whatever q is. TLI is
  chosen over sampled text re-encoded as deterministic drafts (the coupled rule, also exact): at
  one position the standard rule accepts with probability sum_x min(p(x), q(x)), the most any
  coupling of the draft and the target's token reaches, where a deterministic draft is accepted
  only when it equals the target's own sample.

The tokenizers are judged on the texts in play, not on a fixed probe: every text a row's drafter
reads (the prompt, then what the target generates, as it enters the re-encoded window) must come
back unchanged from both tokenizers: the drafter's tokens of it decode to it, and the target's
tokenizer encodes it into tokens that decode to it. A row whose text one of them cannot encode
losslessly (an emoji a tokenizer lacks the bytes of, spaces a normaliser drops) drafts nothing from
there on: it decodes plainly, at a verification's cost, and `SpeculativeStats.lossy_text_rows`
counts it. Drafts are only ever proposals (verified by the target), so a lossy tokenizer could
never emit a wrong token; it would only have the drafter read another text than the target's.

The drafter's runner is a static buffer (`utils.runners.factory.make_runner`) where our own forward runs
its model and `max_tokens` is known, sized by `text_budget`; a row whose text would pass it drafts only what
fits, then nothing (`draft`): plain steps, never a pass past the buffer.

Not for encoder-decoder models: their decoder starts from a start token, not from text both
tokenizers can spell (`check_tokenizers` refuses the pair).
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field

import torch
from torch import Tensor
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from sampling.drafters.cascade import Cascade
from sampling.drafters.model_drafter import ModelDrafter
from sampling.loop.drafts import DraftTree
from sampling.loop.randomness import PositionUniforms
from sampling.loop.vocabularies import check_tokenizer, intersection, longest_token_bytes, same_vocabulary
from utils.cost_model import PassCosts
from utils.logits_processors import LogitsProcessor
from utils.runners.model_info import context_length, vocab_size
from utils.runners.protocol import common_prefix
from utils.runners.static import StaticRunner

LOOKBEHIND = 8  # target tokens behind the end re-encoded every step: a word's tokens may still merge
ANCHOR_SEARCH = 16  # anchor candidates tried per step (the anchor moves forward at most this far)
CONTEXT = 4  # drafter tokens decoded before the drafts, so that their first spaces and bytes come out right


def check_tokenizers(tokenizer: object, drafter_tokenizer: object, drafter: PreTrainedModel, target: PreTrainedModel,
                     *, encoder_decoder: bool) -> bool:
    """Whether the drafter drafts with another tokenizer (then `UniversalDrafter`); raises before
    any model runs for a drafter_tokenizer without tokenizer, a tokenizer that is not its model's,
    or an encoder-decoder pair. Whether the tokenizers are lossless is judged on the texts in play,
    row by row, as they are decoded (module docstring), not here on a fixed text."""
    if drafter_tokenizer is None:
        return False
    if tokenizer is None:
        raise ValueError("drafter_tokenizer is given but tokenizer is not: pass the target's tokenizer as "
                         "tokenizer= too (a drafter with another tokenizer reads the target's tokens as text)")
    check_tokenizer(tokenizer, "tokenizer", target, "target")
    check_tokenizer(drafter_tokenizer, "drafter_tokenizer", drafter, "drafter")
    if same_vocabulary(tokenizer, drafter_tokenizer):
        return False
    if encoder_decoder:
        raise ValueError(
            "drafter_tokenizer with another vocabulary than tokenizer is for decoder-only models: an "
            "encoder-decoder's decoder starts from its start token, not from text both tokenizers spell; "
            "use a drafter that shares the target's tokenizer"
        )
    return True


def _decoder(tokenizer: PreTrainedTokenizerBase, drop: frozenset[int]):
    def decode(ids: list[int]) -> str:
        return tokenizer.decode([i for i in ids if i not in drop], skip_special_tokens=False,
                                clean_up_tokenization_spaces=False)
    return decode


def _tail(decode, head: list[int], ids: list[int]) -> str:
    """The text of `ids` after `head` (decoded together: a leading space or a byte split across the
    boundary comes out as in the whole text)."""
    if not head:
        return decode(ids)
    whole, before = decode(head + ids), decode(head)
    return whole[len(before):] if whole.startswith(before) else decode(ids)


@dataclass
class _Bridge:
    """What moves text between two tokenizers: encoders, decoders, and the intersection."""

    encode_target: object
    encode_drafter: object
    decode_target: object
    decode_drafter: object
    drafter_prefix: list[int]  # what the drafter's tokenizer puts before a text (its BOS, if any)
    drafter_ids: Tensor  # the intersection (n,): drafter ids ...
    target_ids: Tensor  # ... and the target ids of the same strings
    target_token_bytes: int  # the most bytes one target token spells


@functools.lru_cache(maxsize=8)
def bridge(tokenizer: PreTrainedTokenizerBase, drafter_tokenizer: PreTrainedTokenizerBase,
           target_width: int, drafter_width: int) -> _Bridge:
    """The bridge of a pair (built once: the intersection reads both vocabularies). Special tokens
    one side has and the other lacks are dropped when their text crosses over."""
    target_added, drafter_added = tokenizer.get_added_vocab(), drafter_tokenizer.get_added_vocab()
    target_drop = frozenset(i for content, i in target_added.items() if content not in drafter_added)
    drafter_drop = frozenset(i for content, i in drafter_added.items() if content not in target_added)
    plain, marked = drafter_tokenizer.encode("a", add_special_tokens=False), drafter_tokenizer.encode("a")
    start = next((i for i in range(len(marked)) if marked[i : i + len(plain)] == plain), 0)
    drafter_ids, target_ids = intersection(tokenizer, drafter_tokenizer, target_width, drafter_width)

    def encoder(tok, width):
        def encode(text: str) -> list[int]:
            ids = tok.encode(text, add_special_tokens=False)
            return ids[: next((i for i, t in enumerate(ids) if t >= width), len(ids))]
        return encode

    return _Bridge(encoder(tokenizer, target_width), encoder(drafter_tokenizer, drafter_width),
                   _decoder(tokenizer, target_drop), _decoder(drafter_tokenizer, drafter_drop),
                   marked[:start], drafter_ids, target_ids, longest_token_bytes(tokenizer, target_width))


DRAFTER_TOKENS_PER_TARGET = 4  # the static buffer's room: a text's drafter tokens per target token (`text_budget`)


def text_budget(bridge: _Bridge, model: PreTrainedModel, max_tokens: int | None) -> int | None:
    """The drafter tokens a row's text and drafts stay within over a static buffer (`draft`), for a row of
    `max_tokens` target tokens (None: no bound known): `DRAFTER_TOKENS_PER_TARGET` a target token at most (a lossless
    row's drafter token spells at least a byte; a bound by the longest token's bytes would size nearly every buffer
    at the drafter's context), capped at that context, past which it would draft from clamped positions."""
    if max_tokens is None:
        return None
    bound = len(bridge.drafter_prefix) + max_tokens * min(bridge.target_token_bytes, DRAFTER_TOKENS_PER_TARGET)
    limit = context_length(model)
    return bound if limit is None else min(bound, limit)


@dataclass
class _RowText:
    """One row's text as the drafter reads it. Target tokens [0, target_anchor) spell the text of
    drafter tokens [0, drafter_anchor); both boundaries are clean and stay fixed."""

    tokens: list[int]  # the drafter's tokens for the text so far
    drafter_anchor: int
    target_anchor: int = 0
    cached: list[int] = field(default_factory=list)  # what the drafter's cache holds (a prefix of tokens + drafts)
    window: list[int] = field(default_factory=list)  # the target tokens from the anchor, at the last sync ...
    window_text: str = ""  # ... and their text
    lossy: bool = False  # a text of this row did not round-trip through both tokenizers: no more drafts


class UniversalDrafter:
    """A tokenizer bridge around a chain drafter: a `ModelDrafter` (`chain`) whose model has
    another tokenizer (module docstring) drafts in its own vocabulary from the bridge's
    tokenization of the text, reading its passes through the bridge (`distribution`, `sample`: q
    in the target's vocabulary), and the bridge returns target tokens.

    `retokenize_seconds`: the time spent moving text between the tokenizers (re-encoding the
    window, mapping drafts), also counted in `seconds_per_draft` for `adaptive_gamma`.
    `lossy_text_rows`: rows that met a text one tokenizer cannot encode losslessly, and went on
    without drafts (module docstring). `max_tokens`: the most target tokens a row may hold before its
    drafts (`sampling.loop.common.max_tokens`), which sizes the drafter's static buffer (`text_budget`,
    module docstring); None: its runner keeps transformers' cache.
    """

    def __init__(self, model: PreTrainedModel, processor: LogitsProcessor, *, tokenizer: PreTrainedTokenizerBase,
                 drafter_tokenizer: PreTrainedTokenizerBase, target_vocab_size: int,
                 uniforms: list[PositionUniforms], use_cache: bool = True, trees: bool = False,
                 coupled: bool = False, costs: PassCosts | None = None, cascade: Cascade | None = None,
                 max_tokens: int | None = None) -> None:
        self.processor, self.vocab_size = processor, target_vocab_size
        self.drafter_tokens = min(len(drafter_tokenizer), vocab_size(model))  # ids past it are padding rows
        self.bridge = bridge(tokenizer, drafter_tokenizer, target_vocab_size, vocab_size(model))
        budget = text_budget(self.bridge, model, max_tokens)
        # No confidence stop (`sampling.policy.draft_confidence`): it reads q at the drafter's token id, and q
        # here lives in the target's vocabulary (or, greedy, is raw scores); `adaptive_gamma` still sizes the drafts.
        self.chain = ModelDrafter(model, processor, vocab_size=target_vocab_size, uniforms=uniforms,
                                  use_cache=use_cache, coupled=coupled, stop=None, costs=costs, cascade=cascade,
                                  reading=self, max_tokens=budget)
        # Over a static buffer, the drafter tokens a row's text and drafts stay within (`draft`); None: the
        # runner's cache grows (transformers'), nothing to keep within.
        self.budget = budget if isinstance(self.chain.runner, StaticRunner) else None
        if not processor.is_greedy and len(self.bridge.drafter_ids) == 0:
            raise ValueError("tokenizer and drafter_tokenizer have no token in common: a sampling drafter "
                             "needs shared tokens (token-level intersection); greedy decoding does not")
        self._to_drafter = torch.full((target_vocab_size,), -1, dtype=torch.long)
        self._to_drafter[self.bridge.target_ids] = self.bridge.drafter_ids
        self._to_target = torch.full((vocab_size(model),), -1, dtype=torch.long)
        self._to_target[self.bridge.drafter_ids] = self.bridge.target_ids
        self.trees = trees  # whether the target verifies token trees (`Runner.supports_trees`)
        self.retokenize_seconds = 0.0
        self.lossy_text_rows = 0
        self._rows: list[_RowText] = []
        self._sequences: list[list[int]] = []  # the target sequences of the running draft step
        self._offsets: list[int] = []  # target position - drafter position of each row's first draft

    @property
    def forward_passes(self) -> int:
        return self.chain.forward_passes

    @property
    def seconds_per_draft(self) -> float | None:
        """What a drafted token costs, in seconds, moving text between the tokenizers included."""
        return self.chain.seconds_per_draft

    def is_warm(self) -> bool:
        return self.chain.is_warm()

    def start(self, sequences: list[list[int]]) -> None:
        self.chain.start(sequences)
        prefix = self.bridge.drafter_prefix
        self._rows = [_RowText(tokens=list(prefix), drafter_anchor=len(prefix)) for _ in sequences]

    # Target text -> drafter tokens ------------------------------------------------------------

    def _lossless(self, base: list[int], tail: list[int], text: str) -> bool:
        """Whether both tokenizers give `text` back: the drafter's `tail` decodes to it after its
        tokens `base`, and the target's tokenizer re-encodes it into tokens that decode to it."""
        b = self.bridge
        return _tail(b.decode_drafter, base[-1:], tail) == text and b.decode_target(b.encode_target(text)) == text

    def _sync(self, row: _RowText, sequence: list[int]) -> bool:
        """Re-encode the row's text from its anchor on; move the anchor to the last clean boundary
        at least LOOKBEHIND target tokens behind the end. False (the row's state unchanged): a
        tokenizer cannot encode the text losslessly."""
        b = self.bridge
        s = row.target_anchor
        head, window = sequence[max(s - 1, 0) : s], sequence[s:]
        base = row.tokens[: row.drafter_anchor]
        same = self._to_drafter[window].tolist()
        if -1 not in same:  # every new token is the drafter's too: it reads the target's own tokens
            row.tokens, row.window, row.window_text = base + same, [], ""
            row.target_anchor, row.drafter_anchor = len(sequence), len(row.tokens)
            return True
        text = _tail(b.decode_target, head, window)
        tail = b.encode_drafter(text)
        if not self._lossless(base, tail, text):
            return False
        row.tokens, row.window, row.window_text = base + tail, window, text
        last = len(window) - LOOKBEHIND
        if last < 1:
            return True
        drafter_texts: dict[str, int] = {}
        for j in range(1, len(tail) + 1):
            drafter_texts.setdefault(_tail(b.decode_drafter, base[-1:], tail[:j]), j)
        for i in range(last, max(0, last - ANCHOR_SEARCH), -1):
            piece = _tail(b.decode_target, head, window[:i])
            if piece and text.startswith(piece) and piece in drafter_texts:
                row.target_anchor, row.drafter_anchor = s + i, len(base) + drafter_texts[piece]
                return True
        return True

    # Drafter tokens -> target tokens ------------------------------------------------------------

    def _greedy_targets(self, row: _RowText, drafts: list[int]) -> list[int]:
        """The target tokens of the drafts' text: the window's text and the drafts' encoded together,
        less the window's tokens (or the drafts' text alone, where the window re-encodes otherwise)."""
        b = self.bridge
        text = _tail(b.decode_drafter, row.tokens[-CONTEXT:], drafts).rstrip("\ufffd")  # a character's missing bytes
        if not text:
            return []
        whole = b.encode_target(row.window_text + text)
        n = len(row.window)
        return whole[n:] if whole[:n] == row.window else b.encode_target(text)

    def _greedy_tree(self, row: _RowText, drafts: list[int], max_drafts: int, max_depth: int) -> DraftTree:
        """Both readings of greedy drafts, verified in one pass: the tokens of their text (what a
        target with more merges emits) and, where they diverge, the same tokens one for one (what a
        target that splits text as the drafter does emits). `max_drafts` nodes at most; a target
        that verifies chains only gets the text reading."""
        by_text = self._greedy_targets(row, drafts)[:max_depth]
        same = self._to_target[drafts].tolist()
        one_for_one = same[: same.index(-1) if -1 in same else len(same)][:max_depth]
        if not self.trees:
            return DraftTree.chain(by_text[:max_drafts])
        common = common_prefix(by_text, one_for_one)
        a, b = by_text[common:], one_for_one[common:]
        while common + len(a) + len(b) > max_drafts:  # trim the longer tail (the one-for-one on a tie)
            if len(a) > len(b):
                a = a[:-1]
            else:
                b = b[:-1]
        tokens = by_text[:common] + a + b
        parents = list(range(-1, common + len(a) - 1))  # the common part and the text's tail: a chain
        if b:  # the one-for-one tail branches off after the common part
            parents += [common - 1] + list(range(common + len(a), common + len(a) + len(b) - 1))
        return DraftTree(tokens, parents)

    def distribution(self, logits: Tensor, history: list[int] | None) -> Tensor:
        """Greedy: the drafter's raw scores over its tokens (its argmax drafts). Sampling: q (V,) in
        the target's vocabulary, the drafter's scores on the intersection processed as p is."""
        if self.processor.is_greedy:
            return logits[: self.drafter_tokens]
        scores = logits.new_full((self.vocab_size,), -torch.inf)
        scores[self.bridge.target_ids.to(logits.device)] = logits[self.bridge.drafter_ids.to(logits.device)]
        q = self.processor(scores[None], self._target_history(history) if self.processor.needs_history else None)[0]
        return q if q.sum() > 0 else scores.softmax(dim=-1)  # a processor that masks every shared token

    def _target_history(self, history: list[int]) -> list[int]:
        """A drafter history (a row's drafter tokens + its drafts so far) -> the row's target
        sequence + the same drafts as target tokens."""
        for row, sequence in zip(self._rows, self._sequences, strict=True):
            n = len(row.tokens)
            if history[:n] == row.tokens:
                return sequence + self._to_target[history[n:]].tolist()
        raise AssertionError("a drafter history that no row has")

    def sample(self, q: Tensor, row: int, position: int) -> int:
        if self.processor.is_greedy:
            return int(q.argmax())
        # Sampled in the target's vocabulary with the random numbers of the target position.
        return int(self._to_drafter[self.chain.sample(q, row, position + self._offsets[row])])

    def draft(self, sequences, max_drafts, max_depths):
        start = time.perf_counter()
        self._sequences, self._offsets, lengths = sequences, [], []
        for b, (sequence, depth) in enumerate(zip(sequences, max_depths, strict=True)):
            row, k = self._rows[b], max(0, min(max_drafts, depth))
            if k and not row.lossy and not self._sync(row, sequence):
                row.lossy = True  # plain decoding for this row from here on
                self.lossy_text_rows += 1
            k = 0 if row.lossy else k
            if k and self.budget is not None:  # only the drafts that fit the budget
                k = max(0, min(k, self.budget - len(row.tokens)))
            if k:
                # Keep the cache's common prefix with the new tokens, and at least one token to feed.
                keep = min(common_prefix(row.cached, row.tokens), len(row.tokens) - 1)
                k = k if keep >= 0 else 0  # no text yet: nothing to draft from
                keep = max(keep, 0)
                self.chain.runner.rollback_row(b, keep)
                row.cached = row.tokens[:keep]
            self._offsets.append(len(sequence) - len(row.tokens))
            lengths.append(k)
        if self.budget is not None and any(lengths) and not self._passes_fit(lengths):
            lengths = [0] * len(lengths)  # a batch's padded pass would pass the buffer: a plain step
        seconds = time.perf_counter() - start
        drafts = self.chain.draft([row.tokens for row in self._rows], max_drafts, lengths)
        start = time.perf_counter()
        out = []
        for b, ((tree, q), k) in enumerate(zip(drafts, lengths, strict=True)):
            row = self._rows[b]
            if tree.tokens:
                row.cached = (row.tokens + tree.tokens)[: self.chain.runner.row_length(b)]  # the last draft unless a cascade fed it
            if not self.processor.is_greedy and tree.tokens:  # sampling: one target token per draft, all in the intersection
                out.append((DraftTree.chain(self._to_target[tree.tokens].tolist()), q))
            else:
                out.append((self._greedy_tree(row, tree.tokens, max_drafts, k) if tree.tokens else DraftTree.chain([]), None))
        seconds += time.perf_counter() - start
        self.retokenize_seconds += seconds
        if any(lengths):  # the running average of a drafted token's cost, re-encoding included
            self.chain.draft_time.amend(seconds / max(lengths))
        return out

    def _passes_fit(self, lengths: list[int]) -> bool:
        """Whether every pass of a step drafting `lengths[b]` tokens for row b stays in the static buffer, every
        row padded to the widest block: the first pass feeds each drafting row its text past its cache and (a
        cascade's proposals) its drafts, later ones at most its drafts, over rows that reach their text and drafts."""
        runner, rows = self.chain.runner, range(len(self._rows))
        cached = [runner.row_length(b) for b in rows]
        drafting = [b for b in rows if lengths[b]]
        widest = max(len(self._rows[b].tokens) - cached[b] + lengths[b] for b in drafting)
        reach = max(cached + [len(self._rows[b].tokens) + lengths[b] for b in drafting])
        return max(cached) + widest <= runner.slots and reach + max(lengths) <= runner.slots

    def counters(self) -> dict[str, float]:
        """The model drafter's counters and its own: time moving text, rows gone plain."""
        return {**self.chain.counters(), "retokenize_seconds": self.retokenize_seconds,
                "lossy_text_rows": self.lossy_text_rows}

    def update(self, sequences, paths, target_logits, p) -> None:
        """Nothing to tell the chain: the next `draft` re-encodes the text and keeps its cache's
        common prefix with it (the chain's own update reads target positions)."""

    def select_rows(self, keep: list[int]) -> None:
        self.chain.select_rows(keep)
        self._rows = [self._rows[b] for b in keep]
