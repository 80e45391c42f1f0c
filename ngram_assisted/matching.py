"""How long a match a proposal has: the longest earlier occurrence of the text that precedes it.

An n-gram pool sees at most n - 1 tokens of context, but the best evidence that a proposal is a
copy is how far back the text before it repeats an earlier passage (SuffixDecoding drafts as far
as its suffix-tree match is long; prompt lookup extends its match backwards). `CopyIndex` keeps,
for every trigram of the text, where it ended, and measures that length for a proposed token by
comparing backwards from its last few occurrences: O(1) per new token, O(`MAX_MATCH`) per query.
"""

from __future__ import annotations

from collections.abc import Sequence

MAX_MATCH = 32  # context tokens compared at most: longer matches are all "a long copy"
OCCURRENCES = 4  # the most recent occurrences of a trigram that a query compares against


class CopyIndex:
    """Where each trigram of a text occurred; `match_length` of a proposed next token."""

    def __init__(self) -> None:
        self.text: list[int] = []
        self._ends: dict[tuple[int, int, int], list[int]] = {}  # trigram -> indices of its last token

    def extend(self, tokens: Sequence[int]) -> None:
        """Append `tokens` to the text and index the trigrams they end."""
        text = self.text
        for token in tokens:
            text.append(token)
            if len(text) >= 3:
                key = (text[-3], text[-2], token)
                ends = self._ends.setdefault(key, [])
                ends.append(len(text) - 1)
                if len(ends) > OCCURRENCES:
                    del ends[0]

    def match_length(self, history: Sequence[int], token: int) -> int:
        """The most context tokens before an earlier occurrence of `token` in the text that equal
        the last tokens of `history` (0 when `token` never followed history's last two tokens)."""
        if len(history) < 2:
            return 0
        ends = self._ends.get((history[-2], history[-1], token))
        if not ends:
            return 0
        text, best = self.text, 0
        limit = min(MAX_MATCH, len(history))
        for end in ends:
            length = 2
            while length < limit and length < end and text[end - 1 - length] == history[-1 - length]:
                length += 1
            best = max(best, length)
        return best
