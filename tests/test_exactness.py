"""benchmarks/exactness.py: a differing greedy output is a near-tie (the target's two logits within
its dtype's rounding) or a defect, decided on a tiny model whose logits we set."""

import copy

import torch

from benchmarks.exactness import TIE_ULPS, Classifier, classify, counts, describe, first_difference
from tests.models import tiny_model

PROMPT = [5, 6, 7, 8]


def model_with_twin(dtype: torch.dtype, scale: float = 1.0):
    """A tiny llama whose next token after PROMPT is `best`, and token `twin`'s output row is best's
    times `scale`: its logit is the best one's, up to that factor. Returns (model, best, twin, worst)."""
    model = copy.deepcopy(tiny_model("llama", dtype=torch.float32))  # the tests' models are shared: change a copy
    with torch.no_grad():
        head = model.lm_head.weight
        assert head is not model.get_input_embeddings().weight  # only the output row changes
        logits = model(input_ids=torch.tensor([PROMPT])).logits[0, -1]
        best, worst = int(logits.argmax()), int(logits.argmin())
        twin = next(t for t in range(len(logits)) if t not in (best, worst, *PROMPT))
        head[twin] = head[best] * scale
    return model.to(dtype), best, twin, worst


def test_the_same_output_has_no_difference_and_the_first_difference_is_found():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 4, 3]) == 1 and first_difference([1, 2], [1, 2, 3]) == 2
    model, best, _, _ = model_with_twin(torch.float32)
    assert classify(model, PROMPT, [best, 9], [best, 9]) is None


def test_a_swap_of_two_equal_logits_is_a_near_tie_and_a_clearly_worse_token_a_defect():
    for dtype in (torch.float32, torch.bfloat16):
        model, best, twin, worst = model_with_twin(dtype)
        tie = classify(model, PROMPT, [best, 3], [twin, 3])
        assert tie.kind == "near-tie" and tie.position == 0 and tie.gap <= tie.tolerance
        assert (tie.reference_token, tie.output_token) == (best, twin)
        bug = classify(model, PROMPT, [best, 3], [worst, 3])  # a wrong token: what a broken rollback gives
        assert bug.kind == "defect" and bug.gap > bug.tolerance and bug.ulps > TIE_ULPS


def test_the_tolerance_is_the_dtype_resolution():
    """Logits 0.2% apart: within bfloat16's rounding (eps 2^-7), far outside float32's (2^-23)."""
    float32, best, twin, _ = model_with_twin(torch.float32, scale=1 + 2**-9)
    assert classify(float32, PROMPT, [best], [twin]).kind == "defect"
    bfloat16, best, twin, _ = model_with_twin(torch.bfloat16, scale=1 + 2**-9)
    assert classify(bfloat16, PROMPT, [best], [twin]).kind == "near-tie"


def test_an_output_that_stops_early_or_late_is_a_defect_and_counts_read_as_a_report_says():
    model, best, twin, worst = model_with_twin(torch.float32)
    stopped = classify(model, PROMPT, [best, 3, 4], [best, 3])
    assert stopped.kind == "defect" and stopped.position == 2 and stopped.gap is None
    classifier = Classifier(model)
    found = [classifier(PROMPT, [best], [twin]), classifier(PROMPT, [best], [twin]), classifier(PROMPT, [best], [worst]),
             classifier(PROMPT, [best], [best])]
    assert counts(found) == {"defects": 1, "near_ties": 2} == counts([d and d.as_dict() for d in found])
    assert describe(counts(found)) == "1 defect, 2 near-ties" and describe(counts([])) == "0 defects, 0 near-ties"
