"""Exact joint distribution of the first two generated tokens, and a chi-square test against samples."""

from __future__ import annotations

from collections import Counter

import torch
from scipy.stats import chisquare

P_VALUE_THRESHOLD = 1e-3  # a correct sampler fails this test once in a thousand seeds


def exact_two_token_distribution(model, inputs, processor) -> dict[tuple[int, int], float]:
    with torch.no_grad():
        p1 = processor(model(torch.tensor([inputs])).logits[0, -1:].double(), inputs)[0]
        joint = {}
        for x1 in range(len(p1)):
            if p1[x1] == 0:
                continue
            p2 = processor(model(torch.tensor([inputs + [x1]])).logits[0, -1:].double(), inputs + [x1])[0]
            for x2 in range(len(p2)):
                if p2[x2] > 0:
                    joint[(x1, x2)] = float(p1[x1] * p2[x2])
    return joint


def chi_square_p_value(samples: list[tuple[int, int]], joint: dict[tuple[int, int], float]) -> float:
    """Pearson chi-square of the observed pairs against `joint`; cells expected < 5 are pooled."""
    n = len(samples)
    counts = Counter(samples)
    assert set(counts) <= set(joint), f"impossible pairs sampled: {set(counts) - set(joint)}"
    observed, expected, rest_obs, rest_exp = [], [], 0, 0.0
    for cell, prob in joint.items():
        if prob * n >= 5:
            observed.append(counts[cell])
            expected.append(prob * n)
        else:
            rest_obs += counts[cell]
            rest_exp += prob * n
    if rest_exp > 0:
        observed.append(rest_obs)
        expected.append(rest_exp)
    scale = sum(observed) / sum(expected)  # float rounding only
    return float(chisquare(observed, [e * scale for e in expected]).pvalue)


SAMPLES = 1000  # draws per chi-square test
# Drawn as batches of the same prompt: each call decodes ROWS_PER_CALL rows, every row its own random
# stream (derived from the one generator). A row of a batch is the single call with its seed (plain,
# NASD chains and trees, a model drafter under either rule: tests/test_batches.py; another tokenizer:
# tests/test_universal.py), so these are single calls' draws, in half the time or less (a call's own
# work is most of a 2-token generation). Tests whose drafts differ in a batch keep one call per sample.
ROWS_PER_CALL = 100


def first_two_tokens(generate, inputs: list[int], samples: int = SAMPLES, seed: int = 0) -> list[tuple[int, int]]:
    """`samples` draws of the first two generated tokens after `inputs`: `generate(rows, generator)`
    decodes a batch (a list of rows) and returns its outputs, one (ids, alpha) or ids per row."""
    generator = torch.Generator().manual_seed(seed)
    pairs = []
    for _ in range(samples // ROWS_PER_CALL):
        for out in generate([list(inputs) for _ in range(ROWS_PER_CALL)], generator):
            ids = out[0] if isinstance(out, tuple) else out
            pairs.append(tuple(ids[:2]))
    return pairs
