"""Dynagrams: pools of n-grams that learn from the prompt and from the target model while it decodes.

A pool maps a context (the last i - 1 tokens) to the tokens seen after it, with counts and, where
the target scored that context, the probability it gave each token. Its proposal for a context is
the most frequent continuation (ties: the most recent). A context never
seen is a miss: the pool never invents a token. Memory is bounded: at most `max_contexts` contexts
(least recently used evicted first) and `max_continuations` continuations per context; every
lookup and update costs O(1) per token.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Prediction:
    """A pool's proposal: `token` seen `count` times after a context of `match_length` tokens,
    out of `total` observations of that context."""

    token: int
    count: int
    total: int
    match_length: int
    probability: float | None = None  # the target's probability of `token` when it last scored this context
    target_rank: int | None = None  # its rank in the target's top-k then (0: the target's most likely token)


LEARNED_SEQUENCES = 64  # sequences whose learned length a pool remembers (the rows of a batch)


class DynaGram:
    """Base pool over contexts of the lengths in `context_lengths`, looked up longest first."""

    def __init__(self, n: int, *, max_contexts: int = 500_000, max_continuations: int = 8) -> None:
        if isinstance(n, bool) or not isinstance(n, int):
            raise TypeError(f"n must be an int >= 2, got {n!r}")
        if n < 2:
            raise ValueError(f"n must be an int >= 2 (an n-gram is n - 1 context tokens and one next token), got {n}")
        for name, value in (("max_contexts", max_contexts), ("max_continuations", max_continuations)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        self.n = n
        self.max_contexts = max_contexts
        self.max_continuations = max_continuations
        self.context_lengths: tuple[int, ...] = (n - 1,)  # longest first
        self.vocab_size: int | None = None
        self.reset()

    def reset(self) -> None:
        """Forget every n-gram (and the vocabulary the pool was bound to)."""
        # context -> {token: [count, last time seen, target's probability or None, its rank or None]}; the
        # OrderedDict order is recency (LRU).
        self._table: OrderedDict[tuple[int, ...], dict[int, list]] = OrderedDict()
        self._clock = 0
        # Sequences learned from, most recent last: id -> (sequence, its length then). Several at
        # once when a pool is shared by the rows of a batch.
        self._learned: OrderedDict[int, tuple[list[int], int]] = OrderedDict()
        self.vocab_size = None

    def __len__(self) -> int:
        return len(self._table)

    def bind_vocabulary(self, vocab_size: int) -> None:
        """Tie the pool to one model vocabulary; a pool filled under another one is an error."""
        if self.vocab_size is None:
            self.vocab_size = vocab_size
        elif self.vocab_size != vocab_size:
            raise ValueError(
                f"this {type(self).__name__} holds n-grams of a vocabulary of {self.vocab_size} tokens and "
                f"cannot be used with a model of {vocab_size}: call reset() or use a new pool"
            )

    def add(self, context: Sequence[int], token: int, count: int = 1, probability: float | None = None,
            target_rank: int | None = None) -> None:
        """Record that `token` followed `context` (any length; only its last tokens are used) `count`
        times; `probability`, `target_rank`: the target's probability of it there and its rank among
        the target's most likely tokens (both kept until the next score)."""
        self._clock += 1
        for length in self.context_lengths:
            if len(context) >= length:
                self._observe(tuple(context[len(context) - length :]), token, count, probability, target_rank)

    def _observe(self, key: tuple[int, ...], token: int, count: int, probability: float | None,
                 target_rank: int | None) -> None:
        continuations = self._table.get(key)
        if continuations is None:
            continuations = self._table[key] = {}
            if len(self._table) > self.max_contexts:
                self._table.popitem(last=False)  # evict the least recently used context
        else:
            self._table.move_to_end(key)
        entry = continuations.get(token)
        if entry is None:
            if len(continuations) >= self.max_continuations:
                weakest = min(continuations, key=lambda t: continuations[t][:2])
                del continuations[weakest]
            continuations[token] = [count, self._clock, probability, target_rank]
        else:
            entry[0] += count
            entry[1] = self._clock
            if probability is not None:
                entry[2], entry[3] = probability, target_rank

    def fill(self, tokens: Sequence[int], start: int = 0) -> None:
        """Add every n-gram of `tokens` whose next token is at index >= `start`."""
        longest = max(self.context_lengths)
        for i in range(max(start, 1), len(tokens)):
            self.add(tokens[max(0, i - longest) : i], tokens[i])

    def learn(self, sequence: list[int]) -> None:
        """Add the n-grams of `sequence` that the pool has not learned from it yet.

        What the pool learned last is remembered: the same decoding one step later passes the same
        list, only ever appended to (O(1) per new token); the next prompt of a chat repeats the
        earlier turns, and only the positions after the prefix it shares with the sequence learned
        last are added (compared once), so earlier turns are not counted again.
        """
        known = 0
        same = self._learned.get(id(sequence))
        if same is not None and same[0] is sequence and len(sequence) >= same[1]:
            known = same[1]  # the same decoding, one step later (each row of a batch has its own list)
        elif self._learned:
            last, length = next(reversed(self._learned.values()))
            shared = zip(last[:length], sequence, strict=False)
            known = next((i for i, (a, b) in enumerate(shared) if a != b), min(length, len(sequence)))
        longest = max(self.context_lengths)
        self.fill(sequence[max(0, known - longest) :], start=min(known, longest))
        self._learned[id(sequence)] = (sequence, len(sequence))
        self._learned.move_to_end(id(sequence))
        if len(self._learned) > LEARNED_SEQUENCES:
            self._learned.popitem(last=False)

    def predict(self, history: Sequence[int]) -> Prediction | None:
        """The proposal after `history` (longest known context first), or None on a miss."""
        for length in self.context_lengths:  # longest first
            if len(history) < length:
                continue
            continuations = self._table.get(tuple(history[len(history) - length :]))
            if continuations:
                token = max(continuations, key=lambda t: continuations[t][:2])  # count, then recency
                count, _, probability, target_rank = continuations[token]
                total = sum(entry[0] for entry in continuations.values())
                return Prediction(token, count, total, length, probability, target_rank)
        return None

    def candidates(self, history: Sequence[int], limit: int) -> list[Prediction]:
        """Up to `limit` distinct proposals after `history`, most frequent first (ties: most recent):
        the longest known context's continuations, then shorter contexts' (a MultiDynaGram) for
        the tokens not proposed yet. `predict` is the first of them."""
        found: list[Prediction] = []
        for length in self.context_lengths:  # longest first
            if len(found) >= limit or len(history) < length:
                continue
            continuations = self._table.get(tuple(history[len(history) - length :]))
            if not continuations:
                continue
            total = sum(entry[0] for entry in continuations.values())
            ranked = sorted(continuations, key=lambda t: continuations[t][:2], reverse=True)
            seen = {prediction.token for prediction in found}
            found += [Prediction(t, continuations[t][0], total, length, *continuations[t][2:])
                      for t in ranked if t not in seen]
        return found[:limit]

    def __contains__(self, gram: Sequence[int]) -> bool:
        """Whether the n-gram `gram` (context + next token) is in the pool."""
        *context, token = gram
        continuations = self._table.get(tuple(context))
        return continuations is not None and token in continuations and len(context) in self.context_lengths

    def __repr__(self) -> str:
        return f"{type(self).__name__}(n={self.n}, contexts={len(self)})"


class SimpleDynaGram(DynaGram):
    """n-grams of one fixed n: a context of exactly n - 1 tokens proposes the next token."""


class MultiDynaGram(DynaGram):
    """Every i-gram for i in [2, n]: the longest matching context (n - 1 tokens down to 1) proposes."""

    def __init__(self, n: int, *, max_contexts: int = 500_000, max_continuations: int = 8) -> None:
        super().__init__(n, max_contexts=max_contexts, max_continuations=max_continuations)
        self.context_lengths = tuple(range(n - 1, 0, -1))
