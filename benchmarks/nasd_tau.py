"""Tau of NASD drafting policies on held-out Spec-Bench prompts: real greedy decoding, no clock.

    python -m benchmarks.nasd_tau --per-category 2 --branching 1 3     # ~3 min on 2 CPU cores

Tau (tokens per verification step, the prompt pass excluded) depends only on the drafts and the target's tokens, not on the
machine's speed, so it can be measured while the machine is busy. Prompts come from the end of the
data file (the benchmark's come from the start). Settings are #11's: MultiDynaGram(3), gamma 8,
128 new tokens, stop_if_unknown=False (no cost cut). Prints tau per task for each branching, and
each one's geometric-mean ratio over the first.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict

from benchmarks import cli
from benchmarks.prompts import DEFAULT_DATA, encode, load_prompts
from ngram_assisted import MultiDynaGram, ngram_assisted_speculative_generate
from sampling import SpeculativeStats
from utils.loading import end_token_ids, load_model


def main(argv: list[str] | None = None) -> None:
    parser = cli.benchmark_parser(__doc__)
    cli.add_workload(parser, workload=None, data=DEFAULT_DATA)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--gamma", type=int, default=8)
    parser.add_argument("--branching", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--top-k-filler", type=int, default=3)
    parser.add_argument("--cut", action="store_true", help="stop_if_unknown=True (the cost cut)")
    cli.add_models(parser)
    args = cli.parse(parser, argv)

    model, tokenizer = load_model(args.model, dtype=args.dtype, device=args.device)
    end = end_token_ids(model, tokenizer)
    prompts = load_prompts(args.data, args.per_category, held_out=True)
    tau: dict[int, dict[str, list[float]]] = {b: defaultdict(list) for b in args.branching}
    for task, text in prompts:
        prompt = encode(tokenizer, text)
        for branching in args.branching:
            stats = SpeculativeStats()
            ngram_assisted_speculative_generate(
                prompt, MultiDynaGram(3), model, gamma=args.gamma, max_gen_len=args.max_new_tokens, end_tokens_id=end,
                top_k_filler=args.top_k_filler, stop_if_unknown=args.cut, branching=branching, stats=stats,
            )
            tau[branching][task].append(stats.tau)
    first = args.branching[0]
    for branching in args.branching:
        per_task = {task: statistics.fmean(values) for task, values in tau[branching].items()}
        ratios = [per_task[task] / statistics.fmean(tau[first][task]) for task in per_task]
        geomean = math.exp(statistics.fmean(math.log(r) for r in ratios))
        print(f"branching={branching}: " + " ".join(f"{task.split()[0]}={v:.2f}" for task, v in per_task.items())
              + f" | x{geomean:.3f} over branching={first}")


if __name__ == "__main__":
    main()
