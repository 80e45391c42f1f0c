"""Measure the cost of a target forward pass over 1 + k new tokens, relative to one token.

    python -m benchmarks.draft_cost [--model NAME] [--contexts 100 500] [--repeats 9]

This is the cost model behind NASD's draft length (`ngram_assisted.drafter.CPU_COST_TABLE`):
a draft of k tokens pays only if its expected accepted tokens + 1 exceed this ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from utils.caching import ModelRunner
from utils.loading import load_model

DRAFTS = (0, 1, 2, 4, 8, 16, 32)


def measure(model, context: int, repeats: int) -> dict[int, float]:
    """Median seconds of a cached forward over 1 + k tokens after `context` tokens, per k."""
    runner = ModelRunner(model)
    generator = torch.Generator().manual_seed(0)
    runner.forward(torch.randint(100, 10_000, (context,), generator=generator).tolist())
    times: dict[int, list[float]] = {k: [] for k in DRAFTS}
    for _ in range(repeats):
        for k in DRAFTS:  # interleaved, so that a slow moment of the machine spreads over all k
            start = time.perf_counter()
            runner.forward(list(range(200, 201 + k)), num_logits=k + 1)
            times[k].append(time.perf_counter() - start)
            runner.rollback(context)
    return {k: statistics.median(v) for k, v in times.items()}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--contexts", type=int, nargs="+", default=[100, 500])
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args(argv)
    model, _ = load_model(args.model)
    for context in args.contexts:
        seconds = measure(model, context, args.repeats)
        ratios = {k: round(s / seconds[0], 2) for k, s in seconds.items()}
        print(f"context {context}: one token {seconds[0] * 1000:.1f} ms; cost of 1 + k tokens by k: {ratios}")


if __name__ == "__main__":
    main()
