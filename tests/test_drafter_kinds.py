"""A drafter kind is one object, its options and one registration (docs/architecture.md, "Add a
drafter kind"): the smallest kind, registered here, drafts through `speculative_generate` exactly
(greedy identity with plain decoding, batches included), takes its own option as a keyword, and its
own counters reach the stats; the registry has no order to get wrong."""

from dataclasses import dataclass

import pytest

import sampling.drafters.registry
from sampling import DraftTree, SpeculativeStats, autoregressive_generate, speculative_generate
from sampling.drafters.custom_drafters import CustomDrafterKind
from sampling.drafters.drafter_kinds import drafter_kind
from sampling.drafters.hybrid import HybridKind
from sampling.drafters.model_kind import ModelDrafterKind
from sampling.drafters.registry import register_kind
from sampling.loop.options import Drafting
from sampling.policy.draft_policy import DraftLength
from tests.models import DECODER_ONLY, prompt, tiny_model


class RepeatDrafter:
    """Drafts each row's last token again, as deep as it may: the `Drafter` protocol at its smallest."""

    forward_passes = 0

    def __init__(self, token: int | None = None) -> None:
        self.steps, self.token = 0, token

    def start(self, sequences):
        pass

    def draft(self, sequences, max_drafts, max_depths):
        self.steps += 1
        return [(DraftTree.chain([s[-1] if self.token is None else self.token] * max(0, min(max_drafts, d))), None)
                for s, d in zip(sequences, max_depths, strict=True)]

    def update(self, sequences, paths, target_logits, p):
        pass

    def select_rows(self, keep):
        pass


@dataclass(frozen=True, kw_only=True)
class RepeatOptions:
    """The kind's own option: the token drafted (None: each row's last token)."""

    token: int | None = None

    def __post_init__(self):
        if self.token is not None and (isinstance(self.token, bool) or not isinstance(self.token, int)):
            raise TypeError(f"token must be an int or None, got {self.token!r}")


class RepeatKind:
    """The kind: `speculative_generate(inputs, "repeat", target, token=...)`; its options checked as
    they are built, its drafter built once the target's runner exists, its own counter for the stats."""

    Options = RepeatOptions
    what = 'the word "repeat"'

    def takes(self, drafter, given):
        return drafter == "repeat"

    def check(self, request, shared, drafter, options):
        def build(gen):
            repeat = RepeatDrafter(options.token)
            return Drafting(repeat, shared.draft_policy or DraftLength(shared.gamma),
                            lambda: {"repeat_steps": repeat.steps})

        return build


@pytest.fixture
def with_repeat_kind(monkeypatch):
    monkeypatch.setattr(sampling.drafters.registry, "KINDS", list(sampling.drafters.registry.KINDS))  # undone after the test
    register_kind(RepeatKind())  # the one registration


@pytest.mark.parametrize("name", DECODER_ONLY[:2])
def test_a_new_kind_drafts_exactly_and_brings_its_counters(with_repeat_kind, name):
    target = tiny_model(name)
    rows = [prompt(0), prompt(1, length=5) * 2]
    stats = SpeculativeStats()
    results = speculative_generate(rows, "repeat", target, gamma=3, max_gen_len=12, stats=stats)
    assert [ids for ids, _ in results] == autoregressive_generate(rows, target, max_gen_len=12)
    assert stats.counters["repeat_steps"] > 0 and stats.drafts_proposed > 0
    again = speculative_generate(rows, "repeat", target, gamma=3, max_gen_len=12, token=rows[0][-1])
    assert [ids for ids, _ in again] == [ids for ids, _ in results]  # exact whatever token it repeats


def test_a_kinds_option_is_checked_and_refused_by_the_other_kinds(with_repeat_kind):
    target = tiny_model("llama")
    with pytest.raises(TypeError, match="token must be an int or None, got 'a'"):
        speculative_generate(prompt(0), "repeat", target, token="a")
    with pytest.raises(ValueError, match=r"token=3 is not taken with a transformers PreTrainedModel.*"
                                         r'an option for the word "repeat"'):
        speculative_generate(prompt(0), target, target, token=3)


def test_the_registry_picks_each_kind_by_its_drafter_and_options():
    model = tiny_model("llama")
    assert isinstance(drafter_kind(model, {}), ModelDrafterKind)
    assert isinstance(drafter_kind(model, {"ngram": object()}), HybridKind)
    assert isinstance(drafter_kind(RepeatDrafter(), {}), CustomDrafterKind)


def test_an_unclaimed_or_ambiguous_drafter_is_a_type_error(with_repeat_kind):
    with pytest.raises(TypeError, match="drafter must be .* or the word \"repeat\"; got a int, which no drafter kind"):
        drafter_kind(3, {})

    class Greedy(RepeatKind):
        def takes(self, drafter, given):
            return isinstance(drafter, str)

    register_kind(Greedy())
    with pytest.raises(TypeError, match="the drafter kinds RepeatKind, Greedy all claim a str"):
        drafter_kind("repeat", {})


def test_stats_add_a_kinds_counters_to_their_fields_or_to_counters():
    stats = SpeculativeStats()
    stats.add({"cascade_proposed": 3, "mine": 2})
    stats.add({"cascade_proposed": 1, "mine": 1})
    assert stats.cascade_proposed == 4 and stats.counters == {"mine": 3}
