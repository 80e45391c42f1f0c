"""llama.cpp against this library: the same GGUF model, the same prompts, greedy, interleaved prompt by prompt.

    make peers    # once: builds llama-cpp-python 0.3.36 for the CPU into .venv (several minutes)
    python -m benchmarks.peers --target qwen2.5-coder-1.5b-instruct --drafter qwen2.5-coder-0.5b-instruct \\
        --workload humaneval --per-category 4 --max-new-tokens 64 --repeats 3

Ours: plain decoding (`ours_ar`), NASD (`ours_nasd`) and, with --drafter, SD and the hybrid (`ours_sd`, `ours_hybrid`,
spec_bench's settings), on the weights `load_model` gives (the GGUF de-quantized, in the dtype it picks). llama.cpp
(`benchmarks/llama_peer.py`): plain, prompt lookup and, with --drafter, draft-model speculation, on the GGUF file
itself (its native quantized types). Both read the same prompt ids (the chat template applied by our tokenizer, the
GGUF's own) and run on as many threads. Every method runs on each prompt `--repeats` times in a rotating order; the
table gives each method's median tokens/s (generated tokens over wall time, prefill included), its ratio to llama.cpp's
plain decoding and to ours, and for our speculative methods their median tau (tokens per step).

Outputs: ours are checked against our plain decoding (a difference is a near-tie or a defect, benchmarks/exactness.py);
llama.cpp's speculative outputs against its plain decoding. The two sides' weights differ (quantized against
de-quantized and rounded to the dtype), so llama.cpp's plain output is not expected to equal ours: its agreement is
reported (the share of identical tokens position by position, and where the outputs first part). Without llama.cpp
(not built, no GGUF file for --target, a failed load) one line says why and ours run alone. Writes results.json and
report.md to --out.
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
from benchmarks.exactness import Classifier, counts, describe, first_difference
from benchmarks.learned import learned_apart
from benchmarks.llama_peer import DRAFT_MAX, PROMPT_LOOKUP, load_peer
from benchmarks.prompts import encode, load_workload
from benchmarks.spec_bench import Runner
from utils.loading import end_token_ids, load_model
from utils.machine import machine
from utils.offline_models import offline_model

OURS_PLAIN, PEER_PLAIN = "ours_ar", "llama_plain"
OURS = ("ours_ar", "ours_nasd")
OURS_WITH_DRAFTER = ("ours_sd", "ours_hybrid")
CONTEXT_SLACK = 64  # cache room past prompt + new tokens: a last verification's drafts


def agreement(reference: list[int], output: list[int]) -> dict:
    """{"identical": the share of positions (of the longer output) holding the same token in both,
    "first_divergence": the first position where they differ, None when equal}."""
    same = sum(a == b for a, b in zip(reference, output, strict=False))
    return {"identical": same / max(len(reference), len(output), 1), "first_divergence": first_difference(reference, output)}


def step_fields(stats) -> dict:
    """A speculative run's steps (spec_bench's record fields; None for plain decoding and llama.cpp's methods): why
    a method is as fast as it is."""
    return {"tau": stats.tau if stats else None, "steps": stats.steps if stats else None,
            "steps_without_drafts": stats.steps_without_drafts if stats else None}


def run_all(ours: Runner, peer, prompts: list[tuple[int, str, list[int]]], methods: list[str], repeats: int,
            clock=time.perf_counter) -> list[dict]:
    """Every (repeat, prompt, method), the methods' order rotated at each (repeat, prompt)."""
    records = []
    for repeat in range(repeats):
        for index, task, ids in prompts:
            shift = (repeat + index) % len(methods)
            for method in methods[shift:] + methods[:shift]:
                start, stats = clock(), None
                if peer is not None and method in peer.methods:
                    out = peer.generate(method, ids, ours.n, ours.end)
                else:
                    with learned_apart(method):
                        out, stats = ours.run(method, ids)
                seconds = clock() - start
                records.append({"task": task, "method": method, "side": "llama.cpp" if method.startswith("llama") else "ours",
                                "prompt": index, "repeat": repeat, "prompt_tokens": len(ids), "tokens": len(out),
                                "seconds": seconds, "output": out, **step_fields(stats)})
    return records


def check_outputs(records: list[dict], prompts: dict[int, list[int]], classify) -> None:
    """Each output against its side's plain decoding of the same (prompt, repeat): `identical`, `agreement` and, for
    ours, `difference` (a near-tie or a defect); llama.cpp's plain output against ours: `agreement_with_ours`."""
    outputs = {(r["method"], r["prompt"], r["repeat"]): r["output"] for r in records}
    for r in records:
        plain = OURS_PLAIN if r["side"] == "ours" else PEER_PLAIN
        reference = outputs[(plain, r["prompt"], r["repeat"])]
        r["identical"], r["agreement"] = r["output"] == reference, agreement(reference, r["output"])
        if r["side"] == "ours":
            difference = None if r["identical"] else classify(prompts[r["prompt"]], reference, r["output"])
            r["difference"] = difference.as_dict() if difference else None
        if r["method"] == PEER_PLAIN and (OURS_PLAIN, r["prompt"], r["repeat"]) in outputs:
            r["agreement_with_ours"] = agreement(outputs[(OURS_PLAIN, r["prompt"], r["repeat"])], r["output"])


def summarise(records: list[dict], methods: list[str]) -> dict:
    """Per method: tokens/s (median, min, max over runs), the ratios of its median to llama.cpp's plain and to ours
    (None where that one did not run), its outputs' identical count, agreement and differences, and for our
    speculative methods the median tokens per step (`tau`)."""
    rates = {m: [r["tokens"] / r["seconds"] for r in records if r["method"] == m] for m in methods}
    median = {m: statistics.median(values) for m, values in rates.items() if values}
    summary = {}
    for method in median:
        mine = [r for r in records if r["method"] == method]
        row = {"side": mine[0]["side"], "tokens_per_s": median[method], "min": min(rates[method]), "max": max(rates[method]),
               "runs": len(mine), "identical": sum(r["identical"] for r in mine),
               "agreement": statistics.mean(r["agreement"]["identical"] for r in mine)}
        for key, plain in (("vs_llama_plain", PEER_PLAIN), ("vs_ours_plain", OURS_PLAIN)):
            row[key] = median[method] / median[plain] if plain in median else None
        if row["side"] == "ours":
            row["differences"] = counts([r["difference"] for r in mine])
        taus = [r["tau"] for r in mine if r.get("tau") is not None]
        if taus:
            row["tau"] = statistics.median(taus)
        with_ours = [r["agreement_with_ours"] for r in mine if "agreement_with_ours" in r]
        if with_ours:
            divergences = [a["first_divergence"] for a in with_ours if a["first_divergence"] is not None]
            row["agreement_with_ours"] = {"identical": statistics.mean(a["identical"] for a in with_ours),
                                          "equal": len(with_ours) - len(divergences),
                                          "first_divergence_median": statistics.median(divergences) if divergences else None}
        summary[method] = row
    return summary


def outputs_cell(method: str, row: dict) -> str:
    """What the table says of a method's outputs."""
    if method in (OURS_PLAIN, PEER_PLAIN):
        theirs = row.get("agreement_with_ours")
        if theirs is None:
            return "the reference"
        part = f", first divergence at token {theirs['first_divergence_median']:g} (median)" if theirs["equal"] < row["runs"] else ""
        return f"vs ours plain: {theirs['identical']:.0%} identical tokens, {theirs['equal']}/{row['runs']} equal{part}"
    plain = "ours plain" if row["side"] == "ours" else "llama.cpp plain"
    text = f"{row['identical']}/{row['runs']} = {plain}"
    if row["side"] == "ours":
        tau = f", tau {row['tau']:.1f}" if "tau" in row else ""
        return f"{text} ({describe(row['differences'])}){tau}"
    return text if row["identical"] == row["runs"] else f"{text}, {row['agreement']:.0%} identical tokens"


def table_rows(summary: dict, weights: dict[str, str]) -> list[list[str]]:
    """method, weights, tokens/s [min-max], vs llama.cpp plain, vs ours plain, outputs: one row a method."""
    def ratio(value):
        return "-" if value is None else f"{value:.2f}x"

    return [[method, weights[row["side"]], f"{row['tokens_per_s']:.2f} [{row['min']:.2f}-{row['max']:.2f}]",
             ratio(row["vs_llama_plain"]), ratio(row["vs_ours_plain"]), outputs_cell(method, row)]
            for method, row in summary.items()]


def goal_line(summary: dict) -> str:
    """The best of ours against llama.cpp's best (the issue's goal: >= 1.0x)."""
    best = {side: max((m for m, r in summary.items() if r["side"] == side), key=lambda m: summary[m]["tokens_per_s"],
                      default=None) for side in ("ours", "llama.cpp")}
    if best["llama.cpp"] is None:
        return "llama.cpp did not run: no comparison"
    ours, theirs = summary[best["ours"]], summary[best["llama.cpp"]]
    return (f"best of ours ({best['ours']}, {ours['tokens_per_s']:.2f} tokens/s) / best of llama.cpp "
            f"({best['llama.cpp']}, {theirs['tokens_per_s']:.2f} tokens/s) = {ours['tokens_per_s'] / theirs['tokens_per_s']:.2f}x")


HEADERS = ("method", "weights", "tokens/s [min-max]", "vs llama.cpp plain", "vs ours plain", "outputs")


def report(summary: dict, weights: dict[str, str], settings: dict, notes: list[str]) -> str:
    """The markdown report: the settings, the table, the goal line."""
    lines = [f"llama.cpp against ours, greedy, {settings['workload']}, {settings['prompts']} prompts, "
             f"{settings['max_new_tokens']} new tokens, {settings['repeats']} repeats, {settings['threads']} threads.",
             "", f"Machine: {settings['machine']}", "", *[f"- {note}" for note in notes], "",
             "| " + " | ".join(HEADERS) + " |", "|---" * len(HEADERS) + "|"]
    lines += ["| " + " | ".join(row) + " |" for row in table_rows(summary, weights)]
    return "\n".join([*lines, "", goal_line(summary)]) + "\n"


def peer_notes(peer, draft_max: int) -> list[str]:
    """What the report says of llama.cpp's settings (nothing when it did not run)."""
    if peer is None:
        return []
    notes = [f"llama.cpp's prompt lookup: LlamaPromptLookupDecoding{PROMPT_LOOKUP}"]
    if "llama_draft" in peer.methods:
        notes.append(f"llama.cpp's drafter model ({getattr(peer, 'drafter_weights', None) or 'its GGUF'}): up to "
                     f"{draft_max} tokens a step, through the binding's draft_model= hook (filled here: the binding "
                     "exposes no draft-model speculation of its own)")
    return notes


def parse_args(argv: list[str] | None):
    parser = cli.benchmark_parser(__doc__)
    cli.add_models(parser, drafter="a drafter model for ours and llama.cpp's draft-model speculation, e.g. "
                   "qwen2.5-coder-0.5b-instruct", device=False, quantize=True)
    cli.add_workload(parser, workload="humaneval", per_category=4)
    cli.add_run(parser, max_new_tokens=64, repeats=3, out=Path("bench_results/peers"))
    parser.add_argument("--llama-draft-max", type=int, default=DRAFT_MAX,
                        help=f"tokens llama.cpp's drafter model drafts at most (llama.cpp's default: {DRAFT_MAX})")
    args = cli.parse(parser, argv)
    if args.llama_draft_max < 1:
        parser.error(f"--llama-draft-max must be >= 1, got {args.llama_draft_max}")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    console = Console()
    texts = load_workload(args.workload, args.per_category, path=args.data)
    if not texts:
        raise SystemExit(f"no prompts: --per-category {args.per_category} of workload {args.workload}")
    target, tokenizer = load_model(args.model, dtype=args.dtype, quantize=args.quantize)
    drafter = load_model(args.drafter, dtype=target.dtype, quantize=args.drafter_quantize)[0] if args.drafter else None
    prompts = [(index, task, encode(tokenizer, text)) for index, (task, text) in enumerate(texts)]
    threads = torch.get_num_threads()
    n_ctx = max(len(ids) for _, _, ids in prompts) + args.max_new_tokens + CONTEXT_SLACK
    peer, note = load_peer(args.model, args.drafter, n_ctx=n_ctx, threads=threads, draft_max=args.llama_draft_max)
    notes = [note] if note else []
    for line in notes:
        console.print(line, highlight=False)
    ours = Runner(target, drafter, end_token_ids(target, tokenizer), args.max_new_tokens, sample=None)
    methods = [*OURS, *(OURS_WITH_DRAFTER if drafter is not None else ()), *(peer.methods if peer else ())]
    for method in methods:  # warm-up (and the cost models' calibration, once per machine)
        if method.startswith("llama"):
            peer.generate(method, prompts[0][2], 4, ours.end)
        else:
            ours.run(method, prompts[0][2][:32])
    records = run_all(ours, peer, prompts, methods, args.repeats)
    check_outputs(records, {index: ids for index, _, ids in prompts}, Classifier(target))
    summary = summarise(records, methods)
    origin = " (the GGUF de-quantized)" if offline_model(args.model) is not None else ""
    quantized = f", {args.quantize} weights" if args.quantize else ""
    if drafter is not None and args.drafter_quantize:
        quantized += f" (the drafter's {args.drafter_quantize})"
    weights = {"ours": f"{str(target.dtype).removeprefix('torch.')}{origin}{quantized}",
               "llama.cpp": peer.weights if peer else "-"}
    notes += peer_notes(peer, args.llama_draft_max)
    settings = {"workload": args.workload, "model": args.model or "smollm2-135m-instruct", "drafter": args.drafter,
                "drafter_quantize": args.drafter_quantize,
                "prompts": len(prompts), "per_category": args.per_category, "max_new_tokens": args.max_new_tokens,
                "repeats": args.repeats, "threads": threads, "n_ctx": n_ctx, "weights": weights,
                "date": time.strftime("%Y-%m-%d"), "machine": machine()}
    text = report(summary, weights, settings, notes)
    table = Table(*HEADERS, title=f"greedy, {len(prompts)} prompts, {args.max_new_tokens} new tokens, medians of tokens/s")
    for row in table_rows(summary, weights):
        table.add_row(*row)
    console.print(table)
    console.print(goal_line(summary), highlight=False)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps({"settings": settings, "notes": notes, "summary": summary,
                                                       "records": records}, indent=1))
    (args.out / "report.md").write_text(text)
    console.print(f"written to {args.out}/ (results.json, report.md)")
    return {"summary": summary, "records": records, "report": text, "notes": notes, "peer": peer is not None}


if __name__ == "__main__":
    main()
