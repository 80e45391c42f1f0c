"""NASD against SuffixDecoding, both in this library's loop, on held-out Spec-Bench prompts.

    python -m benchmarks.suffix_decoding --build          # once
    python -m benchmarks.suffix_compare --per-category 2  # greedy, 128 new tokens

For each task: tau (tokens per verification step, prefill excluded: `SpeculativeStats.tau`), drafted
nodes per step, alpha, and the modelled speed: generated tokens / the sum over steps of the measured cost of the step's
pass (`utils.calibration.pass_costs`: a pass over 1 + k tokens relative to a one-token pass), i.e.
tau / mean step cost; a drafter that drafts more for the same tau is slower. Every output is
checked against greedy autoregressive decoding. SuffixDecoding runs with vLLM's defaults (tree
depth 24, max_spec_factor 1.0, min_token_prob 0.1, 8 tokens at most) and one global cache of
earlier responses across prompts; without the built peer, the pure-Python stand-in runs instead
(said in the report). Writes suffix_compare.json and suffix_compare.md to --out.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from benchmarks import cli
from benchmarks.exactness import Classifier, counts, describe
from benchmarks.nasd_replay import summarise as per_task
from benchmarks.prompts import DEFAULT_DATA, encode, load_prompts
from benchmarks.suffix_decoding import MAX_TREE_DEPTH, PythonSuffixCache, load_peer, run_suffix
from benchmarks.summary import TASKS
from ngram_assisted import MultiDynaGram, ngram_assisted_speculative_generate
from sampling import SpeculativeStats, autoregressive_generate
from utils.calibration import pass_costs
from utils.loading import end_token_ids, load_model
from utils.machine import machine


def measure(prompts, model, end_tokens, max_new_tokens: int, cache, n: int = 8) -> list[dict]:
    costs = pass_costs(model)
    classify = Classifier(model)  # a differing output: a near-tie or a defect (benchmarks/exactness.py)
    records = []
    for index, (task, ids) in enumerate(prompts):
        reference = autoregressive_generate(ids, model, max_gen_len=max_new_tokens, end_tokens_id=end_tokens)
        for method in ("nasd", "suffix"):
            stats, steps = SpeculativeStats(), []
            if method == "nasd":
                out, _ = ngram_assisted_speculative_generate(ids, MultiDynaGram(n), model, max_gen_len=max_new_tokens,
                                                             end_tokens_id=end_tokens, stats=stats, on_step=steps.append)
            else:
                out, _ = run_suffix(ids, model, cache, max_new_tokens=max_new_tokens, end_tokens=end_tokens,
                                    stats=stats, on_step=steps.append)
            records.append({
                "task": task, "prompt": index, "method": method, "tokens": len(out), "steps": len(steps),
                "nodes": stats.drafts_proposed, "accepted": stats.drafts_accepted,
                "cost": sum(costs(len(step.drafts)) for step in steps), "mismatch": out != reference,
                "difference": difference.as_dict() if (difference := classify(ids, reference, out)) else None,
            })
    return records


def summarise(records: list[dict]) -> dict:
    """Per method, `nasd_replay.summarise`'s table (per task and overall) with the mismatches."""
    summary = {}
    for method in ("nasd", "suffix"):
        mine = [r for r in records if r["method"] == method]
        if mine:
            summary[method] = per_task(mine)
            for task, row in summary[method].items():
                row["mismatches"] = sum(r["mismatch"] for r in mine if task == "overall" or r["task"] == task)
    return summary


def main(argv: list[str] | None = None) -> dict:
    parser = cli.benchmark_parser(__doc__)
    cli.add_workload(parser, workload=None, data=DEFAULT_DATA)
    parser.add_argument("--offset", type=int, default=0, help="skip each task's last held-out prompts (2..5: nasd_replay's tuning set)")
    cli.add_run(parser, max_new_tokens=128, out=Path("bench_results"))
    cli.add_models(parser)
    parser.add_argument("--n", type=int, default=8, help="NASD's pool: MultiDynaGram(n), the benchmark's setting")
    args = cli.parse(parser, argv)
    model, tokenizer = load_model(args.model, dtype=args.dtype, device=args.device)
    peer, why = load_peer()
    cache = peer(max_tree_depth=MAX_TREE_DEPTH) if peer else PythonSuffixCache(max_tree_depth=MAX_TREE_DEPTH)
    chosen = load_prompts(args.data, args.per_category, held_out=True, offset=args.offset)
    prompts = [(task, encode(tokenizer, text)) for task, text in chosen]
    records = measure(prompts, model, end_token_ids(model, tokenizer), args.max_new_tokens, cache, args.n)
    summary = summarise(records)
    settings = {"peer": "arctic-inference suffix tree (built)" if peer else f"pure-Python stand-in ({why})",
                "prompts": len(prompts), "offset": args.offset, "nasd_pool": f"MultiDynaGram({args.n})",
                "max_new_tokens": args.max_new_tokens, "date": time.strftime("%Y-%m-%d"),
                "machine": machine(), "cost_table": pass_costs(model).table()}
    lines = [f"NASD (defaults, {settings['nasd_pool']}) against SuffixDecoding in the same loop, greedy, held-out prompts. "
             f"Peer: {settings['peer']}.",
             "", f"Machine: {settings['machine']}", "", f"Cost table: {settings['cost_table']}", "",
             "| task | NASD tau | NASD nodes/step | NASD alpha | NASD speed | suffix tau | suffix nodes/step | "
             "suffix alpha | suffix speed | NASD / suffix |", "|---|" + "---|" * 9]
    for task in [*TASKS, "overall"]:
        n, s = summary["nasd"].get(task), summary["suffix"].get(task)
        if n and s:
            lines.append(f"| {task} | {n['tau']:.2f} | {n['nodes_per_step']:.2f} | {n['alpha']:.2f} | {n['modelled_speed']:.3f} | "
                         f"{s['tau']:.2f} | {s['nodes_per_step']:.2f} | {s['alpha']:.2f} | {s['modelled_speed']:.3f} | "
                         f"{n['modelled_speed'] / s['modelled_speed']:.3f}x |")
    mismatches = sum(r["mismatch"] for r in records)
    lines += ["", f"Mismatches against greedy decoding: {mismatches} of {len(records)} outputs "
              f"({describe(counts([r['difference'] for r in records]))}).",
              f"Modelled speed, geometric mean over tasks: NASD {summary['nasd']['overall']['modelled_speed_geomean']:.3f}, "
              f"suffix {summary['suffix']['overall']['modelled_speed_geomean']:.3f}."]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "suffix_compare.json").write_text(json.dumps({"settings": settings, "summary": summary, "records": records},
                                                             indent=1))
    (args.out / "suffix_compare.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return {"summary": summary, "records": records}


if __name__ == "__main__":
    main()
