import pytest
import torch
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from utils.logits_processors import (
    GreedyProcessor,
    MultinomialProcessor,
    NucleusProcessor,
    TopKNucleusProcessor,
    TopKProcessor,
)


def hf_probs(logits, temperature=1.0, top_k=None, top_p=None):
    scores = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k is not None:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p is not None:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return scores.softmax(dim=-1)


CASES = [
    (MultinomialProcessor(temperature=0.7), dict(temperature=0.7)),
    (TopKProcessor(temperature=1.3, top_k=5), dict(temperature=1.3, top_k=5)),
    (NucleusProcessor(temperature=0.6, top_p=0.9), dict(temperature=0.6, top_p=0.9)),
    (NucleusProcessor(temperature=1.0, top_p=0.05), dict(temperature=1.0, top_p=0.05)),
    (TopKNucleusProcessor(temperature=0.8, top_k=10, top_p=0.7), dict(temperature=0.8, top_k=10, top_p=0.7)),
]


@pytest.mark.parametrize("processor,hf_args", CASES, ids=lambda c: repr(c) if not isinstance(c, dict) else "")
def test_distribution_matches_transformers_warpers(processor, hf_args):
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0)) * 3
    original = logits.clone()
    ours = processor(logits)
    assert torch.equal(logits, original), "the processor modified its input"
    torch.testing.assert_close(ours, hf_probs(logits, **hf_args))
    torch.testing.assert_close(ours.sum(-1), torch.ones(4))


@pytest.mark.parametrize("scale", [8.0, 0.5], ids=["peaked: nucleus among the top candidates", "flat: full sort"])
def test_top_p_over_a_large_vocabulary_matches_transformers(scale):
    logits = torch.randn(6, 5000, generator=torch.Generator().manual_seed(2)) * scale
    logits[:, 0] += scale  # a clear favourite, as language models have
    for top_p in (0.3, 0.9, 0.99):
        torch.testing.assert_close(NucleusProcessor(top_p=top_p)(logits), hf_probs(logits, top_p=top_p))


def test_greedy_is_one_hot_argmax_and_pure():
    logits = torch.randn(3, 20, generator=torch.Generator().manual_seed(1))
    original = logits.clone()
    probs = GreedyProcessor()(logits)
    assert torch.equal(logits, original)
    assert torch.equal(probs.argmax(-1), logits.argmax(-1))
    assert torch.equal(probs.sum(-1), torch.ones(3))
    assert torch.equal(GreedyProcessor().sample(probs), logits.argmax(-1))


def test_at_least_one_token_is_kept():
    logits = torch.tensor([[0.0, 10.0, -5.0, 3.0]])
    assert NucleusProcessor(top_p=1e-6)(logits)[0, 1] == 1.0
    assert TopKProcessor(top_k=1)(logits)[0, 1] == 1.0


def test_sampling_is_reproducible_and_pure():
    probs = MultinomialProcessor()(torch.randn(1000))
    original = probs.clone()
    def draw():
        generator = torch.Generator().manual_seed(3)
        return [int(MultinomialProcessor().sample(probs, generator)) for _ in range(20)]

    assert draw() == draw()
    assert len(set(draw())) > 1  # it really samples
    assert torch.equal(probs, original)


@pytest.mark.parametrize(
    "make,error",
    [
        (lambda: MultinomialProcessor(temperature=0), ValueError),
        (lambda: MultinomialProcessor(temperature=-1.0), ValueError),
        (lambda: MultinomialProcessor(temperature="hot"), TypeError),
        (lambda: TopKProcessor(top_k=0), ValueError),
        (lambda: TopKProcessor(top_k=2.5), TypeError),
        (lambda: NucleusProcessor(top_p=0.0), ValueError),
        (lambda: NucleusProcessor(top_p=1.5), ValueError),
        (lambda: TopKNucleusProcessor(top_k=3, top_p=-0.1), ValueError),
    ],
)
def test_bad_arguments_raise_naming_the_argument(make, error):
    with pytest.raises(error) as info:
        make()
    assert any(name in str(info.value) for name in ("temperature", "top_k", "top_p"))
