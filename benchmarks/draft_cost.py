"""The cost of a target pass over 1 + k new tokens, relative to one token, on this machine.

    python -m benchmarks.draft_cost [--model NAME] [--dtype float32] [--repeats 5]

Prints the machine, then for each k the cost under every combination of the CPU shortcuts
(median and min-max over interleaved repeats), which one is fastest, and the table the library
will use here (`utils.calibration.pass_costs`: from the calibration cache, or calibrated now).
A draft of k tokens pays only if its expected accepted tokens + 1 exceed this ratio.
"""

from __future__ import annotations

import argparse
import statistics

from rich.console import Console
from rich.table import Table

from utils import calibration, cpu_passes
from utils.calibration import calibration_key, machine, pass_costs
from utils.cost_model import DRAFT_SIZES
from utils.loading import load_model


def describe(choice: cpu_passes.Shortcuts) -> str:
    names = [name for name, on in zip(("linear", "gqa"), choice, strict=True) if on]
    return "+".join(names) or "none"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default=None)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    console = Console()
    model, _ = load_model(args.model, dtype=args.dtype, device=args.device)
    console.print(f"machine: {machine()}")
    choices = cpu_passes.available_shortcuts(model)
    times = calibration.time_passes(model, choices, args.repeats, pruned=False)
    base = statistics.median(times[(0, cpu_passes.Shortcuts())])
    console.print(f"one-token pass after {calibration.CONTEXT} tokens: {base * 1000:.1f} ms (median of {args.repeats})")
    table = Table("k", *[describe(c) for c in choices], "fastest",
                  title="cost of 1 + k tokens / one-token pass without shortcuts: median [min-max]")
    for k in (0, *DRAFT_SIZES):
        cells = []
        for choice in choices:
            values = [t / base for t in times[(k, choice)]]
            cells.append(f"{statistics.median(values):.2f} [{min(values):.2f}-{max(values):.2f}]")
        fastest = min(choices, key=lambda c: statistics.median(times[(k, c)]))
        table.add_row(str(k), *cells, describe(fastest))
    console.print(table)
    costs = pass_costs(model)
    used = "measured here" if costs.measured else "the prior (calibration too noisy or switched off)"
    one_token = f"{costs.seconds(0) * 1000:.1f} ms" if costs.seconds(0) else "not timed"
    console.print(f"the library uses ({used}; one-token pass {one_token}, {describe(costs.shortcuts_for(0))}), "
                  "relative to it: " + ", ".join(f"k={k}: {costs(k):.2f} ({describe(costs.shortcuts_for(k))})"
                                                 for k in DRAFT_SIZES))
    console.print(f"calibration key: {calibration_key(model)}")


if __name__ == "__main__":
    main()
