"""Cascade drafting: the drafter model is drafted for (Chen et al. 2024, "Cascade Speculative
Drafting", the vertical cascade; Spector & Re 2023, "staged speculative decoding").

A model drafter spends one pass per drafted token, and where a pass over a few tokens costs about
what a one-token pass costs (a CPU computing in bfloat16: docs/results.md, "Figures behind the
code's rules"), 13 drafts cost 13 passes where a few would do. So a cheap proposer (`PromptLookup`: the longest
suffix of the text found earlier in it, the latest occurrence, and the tokens that followed) offers
the drafter m tokens; the drafter scores them in one pass of its own, and takes, position by
position, its OWN draft from its own q_t as it always does (the argmax, or the inverse CDF of q_t at
the position's uniform). While a proposal equals that draft the next position's q is conditioned on
the right prefix, so the drafter goes on; the first mismatch still yields its draft (its q was
conditioned on the right prefix) and the next pass starts from there. The drafts and their q are
therefore exactly those of one-token passes, token for token: the target's verification, greedy
or sampling, is unchanged and exact.

`Cascade` chooses m per pass and row from the drafter's measured cost table (`PassCosts`: a pass
over 1 + k tokens) and an online estimate of how often the proposer's tokens are the drafter's own
drafts (by match length, from a weak prior): the m maximising expected drafts per unit of drafter
cost, m = 0 (today's one-token passes) where the wide pass is dear or the proposals are rarely
right. The estimate is learned from every lookup, fed or not: once a chain is drafted, each lookup's
proposals are compared with the drafts that came after it, so a proposer left unused is still
judged and taken up again when it would pay.
"""

from __future__ import annotations

from collections.abc import Callable

from sampling.policy.draft_policy import best_draft_length
from sampling.policy.estimators import DecayedRate
from utils.runners.protocol import common_prefix

MAX_MATCH = 8  # longest suffix looked up (longer matches are as good as 8 for choosing)


class PromptLookup:
    """Per row, the proposals of prompt lookup over the row's text (its accepted sequence and the
    drafts so far). The sequence's n-grams (n <= `max_match`) are indexed once, incrementally; the
    drafts (a few tokens) are scanned directly. A sequence whose earlier tokens changed (a drafter
    with another tokenizer re-reads its tail) is re-indexed from where it changed."""

    def __init__(self, max_match: int = MAX_MATCH) -> None:
        self.max_match = max_match
        self._texts: list[list[int]] = []  # per row, the sequence indexed
        self._ends: list[dict[tuple[int, ...], list[int]]] = []  # n-gram -> end positions j (text[j] follows it)

    def start(self, rows: int) -> None:
        self._texts = [[] for _ in range(rows)]
        self._ends = [{} for _ in range(rows)]

    def select_rows(self, keep: list[int]) -> None:
        self._texts = [self._texts[b] for b in keep]
        self._ends = [self._ends[b] for b in keep]

    def _index(self, row: int, sequence: list[int]) -> None:
        """Index every n-gram of `sequence` that a token follows (end positions j < len(sequence))."""
        text, ends = self._texts[row], self._ends[row]
        same = len(text) if sequence[: len(text)] == text else common_prefix(text, sequence)
        for j in range(len(text) - 1, same - 1, -1):  # forget n-grams followed by a changed token
            for n in range(1, min(self.max_match, j) + 1):
                ends[tuple(text[j - n : j])].pop()
        for j in range(max(same, 1), len(sequence)):
            for n in range(1, min(self.max_match, j) + 1):
                ends.setdefault(tuple(sequence[j - n : j]), []).append(j)
        self._texts[row] = list(sequence)

    def propose(self, row: int, sequence: list[int], drafts: list[int], limit: int) -> tuple[int, list[int]]:
        """(n, up to `limit` tokens): the longest suffix (n tokens) of sequence + drafts found earlier
        in it, at its latest occurrence, and the tokens that followed there; (0, []) when none."""
        self._index(row, sequence)
        text = sequence + drafts
        length, indexed = len(text), len(sequence)
        ends = self._ends[row]
        for n in range(min(self.max_match, length - 1), 0, -1):
            suffix = text[length - n :]
            for j in range(length - 1, max(indexed, n) - 1, -1):  # latest first: the drafts' own stretch
                if text[j - n : j] == suffix:
                    return n, text[j : j + limit]
            found = ends.get(tuple(suffix))
            if found:
                return n, text[found[-1] : found[-1] + limit]
        return 0, []


class ProposalAcceptance:
    """P(the proposer's next token is the drafter's own draft | the ones before it were), by the
    length of the matched suffix (1, 2, 3, 4+), learned online from a weak prior."""

    PRIOR, PRIOR_WEIGHT = 0.5, 2.0
    FORGET = 0.98  # per judged token: roughly the last 50
    BUCKETS = 4

    def __init__(self) -> None:
        self.buckets = [DecayedRate(self.PRIOR, self.PRIOR_WEIGHT) for _ in range(self.BUCKETS)]

    def __call__(self, match: int) -> float:
        return self.buckets[min(match, self.BUCKETS) - 1].rate

    def update(self, match: int, num_judged: int, num_accepted: int) -> None:
        bucket = self.buckets[min(match, self.BUCKETS) - 1]
        bucket.decay(self.FORGET ** num_judged)
        bucket.add(num_accepted, num_judged)


class Cascade:
    """The proposer and the policy of one model drafter's cascade (one instance per generation).

    `costs(k)`: the drafter's pass over 1 + k tokens relative to a one-token pass (its `PassCosts`;
    a batch's shared pass is priced by `costs.batch_ratio` when it has one). `proposed` and
    `accepted` count the tokens fed to the drafter and those that were its own drafts with a draft
    after them in the same pass (each one a drafter pass saved).
    """

    def __init__(self, costs: Callable[[int], float], max_match: int = MAX_MATCH) -> None:
        self.costs = costs
        self.lookup = PromptLookup(max_match)
        self.acceptance = ProposalAcceptance()
        self.proposed = self.accepted = 0
        self._lookups: list[list[tuple[int, int, list[int]]]] = []  # per row: (drafts before, n, tokens)

    def start(self, rows: int) -> None:
        self.lookup.start(rows)
        self._lookups = [[] for _ in range(rows)]

    def select_rows(self, keep: list[int]) -> None:
        self.lookup.select_rows(keep)
        self._lookups = [self._lookups[b] for b in keep]

    def pass_cost(self, k: int, rows: int) -> float:
        """A drafter pass feeding 1 + k tokens to each of `rows` rows, relative to one token each."""
        batch_ratio = getattr(self.costs, "batch_ratio", None)
        return self.costs(k) if rows == 1 or batch_ratio is None else batch_ratio(rows, 1 + k)

    def choose(self, match: int, available: int, fed: int, rows: int) -> int:
        """How many of `available` proposals (from a suffix match of `match` tokens) to feed after the
        `fed` tokens the pass feeds anyway: the m maximising (1 + expected matches) / pass cost."""
        if not available:
            return 0
        a = min(self.acceptance(match), 0.99)
        return best_draft_length([a] * available, lambda m: self.pass_cost(fed - 1 + m, rows))

    def propose(self, row: int, sequence: list[int], drafts: list[int], needed: int, fed: int, rows: int) -> list[int]:
        """The proposals to feed row `row`'s drafter pass: `needed` drafts are still to come (a pass
        over m proposals yields at most m + 1), `fed` tokens go in anyway."""
        match, tokens = self.lookup.propose(row, sequence, drafts, needed - 1) if needed > 1 else (0, [])
        if tokens:
            self._lookups[row].append((len(drafts), match, tokens))
        tokens = tokens[: self.choose(match, len(tokens), fed, rows)]
        self.proposed += len(tokens)
        return tokens

    def taken(self, num_saved: int) -> None:
        """`num_saved` fed proposals were the drafter's own drafts and the pass went on after them."""
        self.accepted += num_saved

    def finish(self, row: int, drafts: list[int]) -> None:
        """Row `row`'s chain is drafted: judge every lookup of it, fed or not, against the drafts
        that came after it (how many leading proposals were the drafter's own)."""
        for before, match, tokens in self._lookups[row]:
            later = drafts[before:]
            matched = common_prefix(tokens, later)
            judged = min(matched + 1, len(tokens), len(later))
            if judged:
                self.acceptance.update(match, judged, matched)
        self._lookups[row] = []
