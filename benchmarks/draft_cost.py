"""The cost of a target pass over 1 + k new tokens, relative to one token, on this machine.

    python -m benchmarks.draft_cost [--model NAME] [--dtype float32] [--repeats 5]

Prints the machine, then for each k the cost under every combination of the CPU shortcuts
(median and min-max over interleaved repeats), which one is fastest, and the table the library
will use here (`utils.calibration.pass_costs`: from the calibration cache, or calibrated now).
A draft of k tokens pays only if its expected accepted tokens + 1 exceed this ratio. Also the
memory-bandwidth bound of plain decoding: every weight is read once per token, so tokens/s cannot
exceed (measured copy bandwidth) / (weight bytes); a memory-bound model's pass over 1 + k tokens
then costs about one pass, which is what speculation needs.
"""

from __future__ import annotations

import statistics
import time

import torch
from rich.console import Console
from rich.table import Table

from benchmarks import cli
from utils import calibration, cpu_passes
from utils.calibration import pass_costs
from utils.cost_model import DRAFT_SIZES
from utils.loading import load_model
from utils.machine import calibration_key, machine
from utils.runners.model_info import pass_bytes


def describe(choice: cpu_passes.Shortcuts) -> str:
    names = [name for name, on in zip(("linear", "gqa"), choice, strict=True) if on]
    return "+".join(names) or "none"


def copy_bandwidth(megabytes: int = 512, repeats: int = 5) -> float:
    """Bytes per second a tensor copy moves here (read + write), the best of `repeats`."""
    source = torch.ones(megabytes * 2**20 // 4)
    sink = torch.empty_like(source)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        sink.copy_(source)
        best = min(best, time.perf_counter() - start)
    return 2 * source.numel() * 4 / best


def main(argv: list[str] | None = None) -> None:
    parser = cli.benchmark_parser(__doc__)
    cli.add_models(parser, dtype="float32")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved timings of each pass")
    args = cli.parse(parser, argv)
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
    bandwidth, size = copy_bandwidth(), pass_bytes(model)
    bound = bandwidth / size
    measured = 1 / costs.seconds(0) if costs.seconds(0) else None
    console.print(f"memory bound of plain decoding: copy bandwidth {bandwidth / 1e9:.1f} GB/s, weights {size / 1e9:.2f} GB "
                  f"-> at most {bound:.1f} tokens/s; the one-token pass runs "
                  + (f"{measured:.1f} tokens/s ({measured / bound:.0%} of the bound)" if measured else "untimed"))


if __name__ == "__main__":
    main()
