"""Throughput of batched decoding: transformers' batched `generate` against our batched methods.

    python -m benchmarks.throughput --prompts 8 --batch-sizes 1,2,4,8 --max-new-tokens 96
    python -m benchmarks.throughput --workload humaneval --prompts 8   # HumanEval's code prompts

The same held-out prompts (from the end of the workload's file in `benchmarks/data/`: Spec-Bench's
or HumanEval's) are decoded in batches of B for each B, greedy: transformers' `generate` with left padding (`hf_batched`), our
`autoregressive_generate` (`ours_ar`) and NASD with one fresh `MultiDynaGram(8)` per row
(`ours_nasd`) over the same batches, batch by batch with the methods in a rotating order (the machine's speed drifts over minutes).
Figures are tokens/s over all prompts (medians over repeats) and ratios against `hf_batched` at
the same B; every output is checked against our batch-1 greedy output of the same prompt (our
batched rows must equal it; transformers' left padding may change a near-tie): one that differs is
a near-tie or a defect (`benchmarks/exactness.py`), both counted in the table.
Writes throughput.json and throughput.md to --out.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from benchmarks import cli
from benchmarks.exactness import Classifier, counts, describe
from benchmarks.prompts import encode, load_workload
from ngram_assisted import MultiDynaGram, ngram_assisted_speculative_generate
from sampling import autoregressive_generate, speculative_generate
from utils.loading import end_token_ids, load_model
from utils.machine import machine
from utils.runners.model_info import input_device

METHODS = ["hf_batched", "ours_ar", "ours_nasd"]
GOALS = [("ours_ar", "hf_batched", 0.97, "every B"), ("ours_nasd", "hf_batched", 1.2, 4),
         ("ours_nasd", "ours_ar", 0.97, "every B"), ("ours_nasd", "ours_ar", 1.3, 4), ("ours_sd", "ours_ar", 1.2, 4),
         ("ours_sd", "ours_ar", 0.97, "every B")]


class Methods:
    def __init__(self, model, end_tokens: list[int], max_new_tokens: int, drafter=None) -> None:
        self.model, self.end, self.n, self.drafter = model, end_tokens, max_new_tokens, drafter
        self.names = METHODS + (["ours_sd"] if drafter is not None else [])

    def hf_batched(self, batch: list[list[int]]) -> list[list[int]]:
        width, pad = max(map(len, batch)), self.end[0]
        device = input_device(self.model)  # transformers' baseline gets its ids where the model runs
        ids = torch.tensor([[pad] * (width - len(row)) + row for row in batch], device=device)
        mask = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in batch], device=device)
        out = self.model.generate(ids, attention_mask=mask, max_new_tokens=self.n, do_sample=False,
                                  eos_token_id=self.end, pad_token_id=pad)
        rows = []
        for row in out[:, width:].tolist():  # cut each row after its end token (the rest is padding)
            end = next((i + 1 for i, token in enumerate(row) if token in self.end), len(row))
            rows.append(row[:end])
        return rows

    def ours_ar(self, batch):
        return autoregressive_generate(batch, self.model, max_gen_len=self.n, end_tokens_id=self.end)

    def ours_sd(self, batch):
        return [ids for ids, _ in speculative_generate(batch, self.drafter, self.model, adaptive_gamma=True,
                                                       max_gen_len=self.n, end_tokens_id=self.end)]

    def ours_nasd(self, batch):
        pools = [MultiDynaGram(8) for _ in batch]
        return [ids for ids, _ in ngram_assisted_speculative_generate(batch, pools, self.model, max_gen_len=self.n,
                                                                      end_tokens_id=self.end)]


def run(methods: Methods, prompts: list[list[int]], batch_sizes: list[int], repeats: int) -> list[dict]:
    """One record per (repeat, batch size, method): tokens, seconds, mismatches against batch 1 (of
    which near-ties and defects: benchmarks/exactness.py)."""
    reference = [methods.ours_ar(row) for row in prompts]
    classify = Classifier(methods.model)
    for method in methods.names:  # warm-up
        getattr(methods, method)(prompts[:2])
    records = []
    names = methods.names
    for repeat in range(repeats):
        for b, size in enumerate(batch_sizes):
            # Batch by batch, the methods in a rotating order: the machine's speed drifts over minutes
            # (a 2-core VM here: the same method 136 -> 166 ms a token), so no method gets a stretch of its own.
            outputs, seconds = {name: [] for name in names}, dict.fromkeys(names, 0.0)
            for j, i in enumerate(range(0, len(prompts), size)):
                shift = (repeat + b + j) % len(names)
                for method in names[shift:] + names[:shift]:
                    start = time.perf_counter()
                    outputs[method] += getattr(methods, method)(prompts[i : i + size])
                    seconds[method] += time.perf_counter() - start
            for method in names:
                differences = [classify(prompt, ref, out) if out != ref else None
                               for prompt, out, ref in zip(prompts, outputs[method], reference, strict=True)]
                records.append({"method": method, "batch_size": size, "repeat": repeat, "seconds": seconds[method],
                                "tokens": sum(map(len, outputs[method])),
                                "mismatches": sum(d is not None for d in differences), **counts(differences)})
    return records


def summarise(records: list[dict], batch_sizes: list[int]) -> dict:
    """method -> batch size -> {tokens_per_s (median over repeats), vs_hf, mismatches, defects,
    near_ties (the most of any repeat)}."""
    summary: dict = {}
    names = list(dict.fromkeys(r["method"] for r in records))
    for method in names:
        for size in batch_sizes:
            mine = [r for r in records if r["method"] == method and r["batch_size"] == size]
            summary.setdefault(method, {})[size] = {
                "tokens_per_s": statistics.median(r["tokens"] / r["seconds"] for r in mine),
                "mismatches": max(r["mismatches"] for r in mine), "defects": max(r.get("defects", 0) for r in mine),
                "near_ties": max(r.get("near_ties", 0) for r in mine)}
    for method in names:
        for size in batch_sizes:
            summary[method][size]["vs_hf"] = summary[method][size]["tokens_per_s"] / summary["hf_batched"][size]["tokens_per_s"]
    return summary


def goal_lines(summary: dict, batch_sizes: list[int]) -> list[str]:
    lines = []
    for method, other, minimum, where in GOALS:
        if method not in summary:
            continue
        sizes = batch_sizes if where == "every B" else [where] if where in batch_sizes else []
        if not sizes:
            continue
        value = min(summary[method][s]["tokens_per_s"] / summary[other][s]["tokens_per_s"] for s in sizes)
        scope = "every B" if where == "every B" else f"B = {where}"
        lines.append(f"{method} / {other} ({scope}): {value:.2f}x (goal >= {minimum}x) {'met' if value >= minimum else 'NOT met'}")
    return lines


def main(argv: list[str] | None = None) -> dict:
    parser = cli.benchmark_parser(__doc__)
    cli.add_workload(parser, per_category=None)
    parser.add_argument("--prompts", type=int, default=8, help="held-out prompts (a multiple of every batch size)")
    parser.add_argument("--batch-sizes", default="1,2,4,8")
    cli.add_run(parser, max_new_tokens=96, repeats=2, out=Path("bench_results"), quiet=True)
    cli.add_models(parser, drafter="a drafter model sharing the target's tokenizer: adds speculative decoding "
                   "with it (adaptive_gamma) to the methods")
    args = cli.parse(parser, argv)
    batch_sizes = [int(size) for size in args.batch_sizes.split(",")]
    if any(size < 1 for size in batch_sizes):
        parser.error("--batch-sizes must be integers >= 1")
    per_task = -(-args.prompts // 6) if args.workload == "spec_bench" else args.prompts  # Spec-Bench: six tasks
    texts = [text for _, text in load_workload(args.workload, per_task, held_out=True, path=args.data)][: args.prompts]
    if not texts:
        parser.error(f"no prompts: --prompts {args.prompts} of workload {args.workload}")
    model, tokenizer = load_model(args.model, dtype=args.dtype, device=args.device)
    prompts = [encode(tokenizer, text) for text in texts]
    drafter = load_model(args.drafter, dtype=model.dtype, device=args.device)[0] if args.drafter else None
    methods = Methods(model, end_token_ids(model, tokenizer), args.max_new_tokens, drafter)
    records = run(methods, prompts, batch_sizes, args.repeats)
    summary = summarise(records, batch_sizes)
    settings = {"workload": args.workload, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens, "repeats": args.repeats,
                "model": args.model or "SmolLM2-135M-Instruct", "drafter": args.drafter, "dtype": str(model.dtype),
                "date": time.strftime("%Y-%m-%d"), "machine": machine()}
    goals = goal_lines(summary, batch_sizes)
    lines = [f"Throughput, greedy (tokens/s over {len(prompts)} held-out prompts, median of {args.repeats} repeats; "
             "x: against transformers' batched `generate` at the same batch size; outputs that differ from our batch-1 "
             "output: defects and near-ties, benchmarks/exactness.py).", "",
             f"Machine: {settings['machine']}", "", f"Settings: {settings}", "",
             "| method | " + " | ".join(f"B = {s}" for s in batch_sizes) + " |", "|---|" + "---|" * len(batch_sizes)]
    for method in methods.names:
        cells = [f"{row['tokens_per_s']:.1f} ({row['vs_hf']:.2f}x){', ' + describe(row) if row['mismatches'] else ''}"
                 for row in (summary[method][s] for s in batch_sizes)]
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    lines += [""] + [f"- {line}" for line in goals]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "throughput.json").write_text(json.dumps({"settings": settings, "summary": summary, "records": records},
                                                         indent=1))
    (args.out / "throughput.md").write_text("\n".join(lines) + "\n")
    console = Console(quiet=args.quiet)
    table = Table("method", *(f"B = {s}" for s in batch_sizes), title="tokens/s (x transformers' batched generate)")
    for method in methods.names:
        table.add_row(method, *(f"{summary[method][s]['tokens_per_s']:.1f} ({summary[method][s]['vs_hf']:.2f}x)"
                                for s in batch_sizes))
    console.print(table)
    for line in goals:
        console.print(line)
    return {"summary": summary, "records": records}


if __name__ == "__main__":
    main()
