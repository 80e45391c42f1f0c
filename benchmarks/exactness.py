"""Near-ties told from defects: why a greedy output differs from the reference greedy output.

Two exact greedy decoders can still disagree where the target's two best logits are closer than
the rounding of its dtype: a batched, cached or speculative pass adds in another order than a
one-token pass, and a difference of a few units in the last place can swap the argmax. At the
first token where `output` and `reference` differ, `classify` runs the target once on the common
prefix (a plain forward over prompt + prefix, no cache) and compares the logits of the two tokens:

    near-tie  iff  |l_ref - l_out| <= TIE_ULPS * eps(dtype) * max(|l_ref|, |l_out|)

with eps = torch.finfo(the model's dtype).eps (bfloat16 2^-7, float16 2^-10, float32 2^-23): the two
logits are within TIE_ULPS units of relative rounding of the dtype. Anything else is a defect: a
token the target clearly does not prefer, or an output that stops earlier or later than the
reference with the same tokens up to there.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from utils.runners.model_info import input_device

TIE_ULPS = 4  # a few units of the dtype's relative rounding: what a different order of additions moves


@dataclass(frozen=True)
class Difference:
    """The first difference of an output from its reference. `kind`: "near-tie" or "defect";
    `position`: index in the generated tokens; `gap`: |l_ref - l_out| (None when one output ended);
    `tolerance`: the rule's bound there; `ulps`: gap / (eps * max(|l_ref|, |l_out|))."""

    kind: str
    position: int
    reference_token: int | None
    output_token: int | None
    gap: float | None
    tolerance: float | None
    ulps: float | None

    def as_dict(self) -> dict:
        return asdict(self)


def first_difference(reference: list[int], output: list[int]) -> int | None:
    """Index of the first differing generated token (or the shorter length), None if equal."""
    if reference == output:
        return None
    return next((i for i, (a, b) in enumerate(zip(reference, output, strict=False)) if a != b),
                min(len(reference), len(output)))


@torch.no_grad()
def classify(model, prompt: list[int], reference: list[int], output: list[int], *,
             ulps: float = TIE_ULPS) -> Difference | None:
    """None when `output` == `reference` (both generated ids after `prompt`), else their first
    `Difference`, a near-tie or a defect by the rule of this module's docstring."""
    position = first_difference(reference, output)
    if position is None:
        return None
    a = reference[position] if position < len(reference) else None
    b = output[position] if position < len(output) else None
    if a is None or b is None:  # same tokens, but one stopped: no two logits to weigh
        return Difference("defect", position, a, b, None, None, None)
    ids = torch.tensor([prompt + reference[:position]], device=input_device(model))
    logits = model(input_ids=ids).logits[0, -1].float()
    l_a, l_b = float(logits[a]), float(logits[b])
    scale = torch.finfo(model.dtype).eps * max(abs(l_a), abs(l_b))
    gap = abs(l_a - l_b)
    kind = "near-tie" if gap <= ulps * scale else "defect"
    return Difference(kind, position, a, b, gap, ulps * scale, gap / scale if scale else float("inf"))


class Classifier:
    """`classify` with a memory: the same (prompt, reference, output) is weighed once (a benchmark
    repeats its runs, and most repeats give the same outputs)."""

    def __init__(self, model, ulps: float = TIE_ULPS) -> None:
        self.model, self.ulps = model, ulps
        self._seen: dict[tuple, Difference | None] = {}

    def __call__(self, prompt: list[int], reference: list[int], output: list[int]) -> Difference | None:
        key = (tuple(prompt), tuple(reference), tuple(output))
        if key not in self._seen:
            self._seen[key] = classify(self.model, prompt, reference, output, ulps=self.ulps)
        return self._seen[key]


def counts(differences: list[Difference | dict | None]) -> dict[str, int]:
    """{"defects", "near_ties"} among `differences` (None: no difference; dicts from `as_dict`)."""
    kinds = [d["kind"] if isinstance(d, dict) else d.kind for d in differences if d is not None]
    return {"defects": kinds.count("defect"), "near_ties": kinds.count("near-tie")}


def describe(tally: dict[str, int]) -> str:
    """"0 defects, 2 near-ties"."""
    d, t = tally["defects"], tally["near_ties"]
    return f"{d} defect{'s' * (d != 1)}, {t} near-tie{'s' * (t != 1)}"


@torch.no_grad()
def transformers_greedy(model, prompt: list[int], max_new_tokens: int, end_tokens: list[int]) -> list[int]:
    """transformers' greedy `generate` of one prompt: the generated ids, through the first end token."""
    device = input_device(model)
    out = model.generate(torch.tensor([prompt], device=device), attention_mask=torch.ones(1, len(prompt), dtype=torch.long,
                         device=device), max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=end_tokens or None,
                         pad_token_id=end_tokens[0] if end_tokens else None)
    ids = out[0, len(prompt):].tolist()
    return ids[: next((i + 1 for i, token in enumerate(ids) if token in end_tokens), len(ids))]
