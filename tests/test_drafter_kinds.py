"""A drafter kind is one object and one registry line (docs/architecture.md, "Where to add"): the
smallest kind, added to the registry here, drafts through `speculative_generate` exactly (greedy
identity with plain decoding, batches included) and its own counters reach the stats."""

import pytest

import sampling.drafter_kinds
from sampling import DraftTree, SpeculativeStats, autoregressive_generate, speculative_generate
from sampling.draft_policy import DraftLength
from sampling.drafter_kinds import KINDS, drafter_kind
from sampling.hybrid import HybridKind
from sampling.model_drafting import ModelDrafterKind
from sampling.options import Drafting, SpeculativeOptions
from tests.models import DECODER_ONLY, prompt, tiny_model


class RepeatDrafter:
    """Drafts each row's last token again, as deep as it may: the `Drafter` protocol at its smallest."""

    forward_passes = 0

    def __init__(self) -> None:
        self.steps = 0

    def start(self, sequences):
        pass

    def draft(self, sequences, max_drafts, max_depths):
        self.steps += 1
        return [(DraftTree.chain([s[-1]] * max(0, min(max_drafts, d))), None)
                for s, d in zip(sequences, max_depths, strict=True)]

    def update(self, sequences, paths, target_logits, p):
        pass

    def select_rows(self, keep):
        pass


class RepeatKind:
    """The kind: `speculative_generate(inputs, "repeat", target)`; its options checked in `check`,
    its drafter built once the target's runner exists, its own counter for the stats."""

    def takes(self, options):
        return isinstance(options.drafter, str) and options.drafter == "repeat"

    def check(self, request, options):
        def build(gen):
            drafter = RepeatDrafter()
            return Drafting(drafter, DraftLength(options.gamma), lambda: {"repeat_steps": drafter.steps})

        return build


@pytest.fixture
def with_repeat_kind(monkeypatch):
    monkeypatch.setattr(sampling.drafter_kinds, "KINDS", [RepeatKind(), *KINDS])  # the one registry line


@pytest.mark.parametrize("name", DECODER_ONLY[:2])
def test_a_new_kind_drafts_exactly_and_brings_its_counters(with_repeat_kind, name):
    target = tiny_model(name)
    rows = [prompt(0), prompt(1, length=5) * 2]
    stats = SpeculativeStats()
    results = speculative_generate(rows, "repeat", target, gamma=3, max_gen_len=12, stats=stats)
    assert [ids for ids, _ in results] == autoregressive_generate(rows, target, max_gen_len=12)
    assert stats.counters["repeat_steps"] > 0 and stats.drafts_proposed > 0


def test_the_registry_picks_each_kind_by_its_options():
    model = tiny_model("llama")
    assert isinstance(drafter_kind(SpeculativeOptions(drafter=model)), ModelDrafterKind)
    assert isinstance(drafter_kind(SpeculativeOptions(drafter=model, ngram=object())), HybridKind)
    assert type(drafter_kind(SpeculativeOptions(drafter=RepeatDrafter()))).__name__ == "CustomDrafterKind"


def test_stats_add_a_kinds_counters_to_their_fields_or_to_counters():
    stats = SpeculativeStats()
    stats.add({"cascade_proposed": 3, "mine": 2})
    stats.add({"cascade_proposed": 1, "mine": 1})
    assert stats.cascade_proposed == 4 and stats.counters == {"mine": 3}
