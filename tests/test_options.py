"""Options built whole and valid: every field of the shared options and of each drafter kind's
options is checked as the object is built (argument, value, what is expected), and each default is
stated once: the public signatures' defaults are the options' own."""

import inspect
import re
from dataclasses import fields

import pytest
import torch

import ngram_assisted.nasd
import sampling.speculative
from ngram_assisted import ngram_assisted_speculative_generate
from ngram_assisted.nasd import NgramOptions
from sampling import SpeculativeStats, autoregressive_generate, speculative_generate
from sampling.drafters.custom_drafters import CustomOptions
from sampling.drafters.hybrid import HybridOptions
from sampling.drafters.model_kind import ModelOptions
from sampling.drafters.self_kind import SelfOptions
from sampling.loop.habits import Habits
from sampling.loop.options import DecodingOptions, NasdDecodingOptions
from sampling.policy.draft_policy import DraftLength
from tests.models import tiny_model
from utils.logits_processors import MultinomialProcessor


def signature_defaults(function):
    return {name: p.default for name, p in inspect.signature(function).parameters.items()
            if p.kind is inspect.Parameter.KEYWORD_ONLY}


def field_defaults(*types):
    return [{f.name: f.default for f in fields(t)} for t in types] + [{f.name: f.default for f in fields(Habits)}]


@pytest.mark.parametrize("function, types", [
    (speculative_generate, (DecodingOptions, ModelOptions, HybridOptions, CustomOptions, SelfOptions)),
    (ngram_assisted_speculative_generate, (NasdDecodingOptions, NgramOptions)),
])
def test_every_public_default_is_the_options_own(function, types):
    defaults = signature_defaults(function)
    for name, default in defaults.items():
        owners = [own[name] for own in field_defaults(*types) if name in own]
        assert owners, f"{function.__name__}'s {name} is in no options dataclass"
        assert all(owner is default or owner == default for owner in owners), (name, default, owners)
    assert defaults["gamma"] == (31 if function is ngram_assisted_speculative_generate else 5)


SPECULATIVE = [
    (speculative_generate, sampling.speculative, DecodingOptions, (ModelOptions, HybridOptions, CustomOptions,
                                                                 SelfOptions)),
    (ngram_assisted_speculative_generate, ngram_assisted.nasd, NasdDecodingOptions, (NgramOptions,)),
]


def keyword_names(function) -> set[str]:
    return {name for name, p in inspect.signature(function).parameters.items() if p.kind is inspect.Parameter.KEYWORD_ONLY}


def named(name: str, doc: str) -> bool:
    """Whether a docstring writes `name` in code (`name`, `name=...`)."""
    return re.search(rf"`{name}[`=]", doc) is not None


def field_names(*types) -> set[str]:
    return {f.name for t in types for f in fields(t)} - {"habits"}


@pytest.mark.parametrize("function, module, shared, kinds", SPECULATIVE, ids=lambda x: getattr(x, "__name__", ""))
def test_the_public_signatures_and_docstrings_are_the_options_fields(function, module, shared, kinds):
    """Every field of the shared options, the habits and the kinds' options is a keyword of the public
    function and is named in its docstring, and the function takes nothing else (but `**kind_options`)."""
    assert keyword_names(function) == field_names(shared, Habits, *kinds)
    for name in field_names(shared, Habits, *kinds):
        assert named(name, function.__doc__), f"{function.__name__}'s docstring does not name `{name}`"


def test_plain_decoding_takes_the_shared_options_but_those_of_speculation():
    names = field_names(DecodingOptions, Habits) - {"gamma", "draft_policy"}
    assert keyword_names(autoregressive_generate) == names
    assert all(named(name, autoregressive_generate.__doc__) for name in names)


SHARED_VALUES = {  # a valid value other than the default, for every shared field
    "gamma": 3, "logits_processor": MultinomialProcessor(), "max_gen_len": 7, "end_tokens_id": [1], "pad_token_id": 0,
    "use_cache": False, "stats": SpeculativeStats(), "on_step": print, "draft_policy": DraftLength(2),
    "generator": torch.Generator(),
}


@pytest.mark.parametrize("function, module, shared, kinds", SPECULATIVE, ids=lambda x: getattr(x, "__name__", ""))
def test_every_keyword_reaches_its_options(monkeypatch, function, module, shared, kinds):
    """Each public keyword arrives where it belongs: a shared field in the shared options, a habit in
    their habits, a kind's option (and any `**kind_options`) among the kind keywords, as it was passed."""
    calls = []
    monkeypatch.setattr(module, "run_speculative", lambda inputs, target, drafter, options, keywords, **_:
                        calls.append((options, keywords)))
    kind_values = {name: object() for name in field_names(*kinds)}
    habit_values = {name: object() for name in field_names(Habits)}
    target = tiny_model("llama")
    function([1, 2], object(), target, **SHARED_VALUES, **habit_values, **kind_values, extra=5)
    (options, keywords), = calls
    assert type(options) is shared and all(getattr(options, name) is value for name, value in SHARED_VALUES.items())
    assert all(getattr(options.habits, name) is value for name, value in habit_values.items())
    assert keywords == {**kind_values, "extra": 5}


@pytest.mark.parametrize("field, value, error, message", [
    ("gamma", 0, ValueError, "gamma must be an int >= 1, got 0"),
    ("gamma", 2.0, TypeError, "gamma must be an int >= 1, got 2.0"),
    ("logits_processor", "greedy", TypeError, "logits_processor must be a LogitsProcessor"),
    ("max_gen_len", 0, ValueError, "max_gen_len must be an int >= 1, got 0"),
    ("end_tokens_id", "eos", TypeError, "end_tokens_id must be None, an int or a list of ints"),
    ("end_tokens_id", [1, 2.5], TypeError, "end_tokens_id must be None, an int or a list of ints, found 2.5"),
    ("pad_token_id", -1, ValueError, "pad_token_id must be an int >= 0, got -1"),
    ("use_cache", 1, TypeError, "use_cache must be a bool, got 1"),
    ("generator", 7, TypeError, "generator must be a torch.Generator"),
    ("stats", {}, TypeError, "stats must be a SpeculativeStats"),
    ("on_step", 3, TypeError, "on_step must be a function taking a Step"),
    ("draft_policy", object(), TypeError, r"draft_policy must be an object with the DraftPolicy protocol.*lacks "
                                          r"budget\(\), update\(\)"),
    ("habits", None, TypeError, "habits must be a sampling.loop.habits.Habits"),
])
def test_every_shared_field_is_checked_as_it_is_built(field, value, error, message):
    with pytest.raises(error, match=message):
        DecodingOptions(**{field: value})


@pytest.mark.parametrize("options, field, value, error, message", [
    (ModelOptions, "adaptive_gamma", None, TypeError, "adaptive_gamma must be a bool, got None"),
    (ModelOptions, "drafter_tokenizer", "gpt2", TypeError, "drafter_tokenizer must be a transformers tokenizer"),
    (ModelOptions, "drafter_invariant", "yes", TypeError, "drafter_invariant must be a bool or None"),
    (ModelOptions, "cascade", 0, TypeError, "cascade must be a bool or None, got 0"),
    (ModelOptions, "branching", 0, ValueError, "branching must be an int >= 1, got 0"),
    (HybridOptions, "branching", 1.5, TypeError, "branching must be an int >= 1, got 1.5"),
    (CustomOptions, "adaptive_gamma", "no", TypeError, "adaptive_gamma must be a bool, got 'no'"),
    (NgramOptions, "top_k_filler", 0, ValueError, "top_k_filler must be an int >= 1, got 0"),
    (NgramOptions, "stop_if_unknown", 1, TypeError, "stop_if_unknown must be a bool, got 1"),
    (NgramOptions, "draft_cost", 2.0, TypeError, "draft_cost must be a function of the number of drafts"),
    (NgramOptions, "branching", True, TypeError, "branching must be an int >= 1, got True"),
])
def test_every_kind_field_is_checked_as_it_is_built(options, field, value, error, message):
    with pytest.raises(error, match=message):
        options(**{field: value})


def test_valid_options_build_and_are_frozen():
    options = DecodingOptions(gamma=3, end_tokens_id=[1, 2], generator=[torch.Generator(), torch.Generator()])
    with pytest.raises(AttributeError):
        options.gamma = 4
    assert ModelOptions(branching=2, cascade=None).branching == 2


def test_log_probabilities_are_collected_unless_the_stats_say_not():
    from sampling import SpeculativeStats
    from tests.models import prompt, tiny_model

    target = tiny_model("llama")
    on, off = SpeculativeStats(), SpeculativeStats(collect_logprobs=False)
    first = speculative_generate(prompt(0), target, target, max_gen_len=6, stats=on)
    second = speculative_generate(prompt(0), target, target, max_gen_len=6, stats=off)
    assert first == second and len(on.logprobs[0]) == len(first[0]) and off.logprobs == []
