"""Plain greedy decoding beside a CPU-bound process against the same on a quiet machine, with the fair share of
threads (`utils/threads.py`, `FairShare`) and without it.

    python -m benchmarks busy --model qwen2.5-coder-1.5b-instruct --max-new-tokens 48 --repeats 5

Five runs a repeat, in an order rotated by one each repeat (5 repeats: each run once in each place): quiet and busy
(beside `python -c "while True: pass"`, started a second before the run and stopped a second before the next, on no
core in particular), each with the fair share (a watcher of its own, its first reading taken before the busy process
starts) and without it (the watcher replaced by a no-op, torch on the thread count found at the start); and quiet on
one thread, without the watcher: the floor of a run that leaves the other process its core. A run is
`autoregressive_generate` of --max-new-tokens tokens (no end token) on the first HumanEval development prompt (an
even task id); its time a token is the run's seconds over its tokens (the prompt pass included). Every output is
checked against the first quiet run's (the thread count must not change a token).

Goals (issue 66): beside the busy process, at most 2x the quiet time a token with the fair share; quiet, the fair
share costs under 3%. Writes busy.json and busy.md to --out, and prints the table.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from benchmarks import cli
from benchmarks.prompts import encode, load_humaneval
from sampling import autoregressive_generate
from utils import threads
from utils.loading import load_model
from utils.machine import machine

CONDITIONS = ("quiet, fair share", "quiet, without", "busy, fair share", "busy, without", "quiet, one thread")
SETTLE_SECONDS = 1.0  # the busy process runs this long before a run, and is gone this long before the next
BUSY_LOOP = "while True: pass"


@contextmanager
def busy_process(busy: bool):
    """A CPU-bound process for the block's duration (when `busy`), after `SETTLE_SECONDS` (busy or not)."""
    process = subprocess.Popen([sys.executable, "-c", BUSY_LOOP]) if busy else None
    try:
        time.sleep(SETTLE_SECONDS)
        yield
    finally:
        if process is not None:
            process.kill()
            process.wait()
            time.sleep(SETTLE_SECONDS)  # the next run starts on a machine that has calmed down


@contextmanager
def run_threads(condition: str, threads_found: int):
    """The run's threads: with the fair share, a watcher of its own that takes its first reading now, before the busy
    process starts (the process's watcher, idle through the runs without it, would compare with a reading from before
    them); without it, a no-op in its place and torch on `threads_found` threads, or on one."""
    watcher = threads.fair_share
    torch.set_num_threads(1 if condition.endswith("one thread") else threads_found)
    if condition.endswith("fair share"):
        threads.fair_share = threads.FairShare()
        threads.fair_share()  # the first reading: what the first pass compares with
    else:
        threads.fair_share = lambda: None
    try:
        yield
    finally:
        threads.fair_share = watcher
        torch.set_num_threads(threads_found)


def run(model, prompt: list[int], new_tokens: int, repeats: int) -> list[dict]:
    """One record per (repeat, condition): seconds, tokens, whether the output differs from the first quiet run's."""
    threads_found = torch.get_num_threads()

    def decode() -> list[int]:
        return autoregressive_generate(prompt, model, max_gen_len=new_tokens, end_tokens_id=None)

    reference = decode()  # the warm-up, and every run's reference
    records = []
    for repeat in range(repeats):
        shift = repeat % len(CONDITIONS)
        for condition in CONDITIONS[shift:] + CONDITIONS[:shift]:
            with run_threads(condition, threads_found), busy_process(condition.startswith("busy")):
                start = time.perf_counter()
                output = decode()
                seconds = time.perf_counter() - start
            records.append({"condition": condition, "repeat": repeat, "seconds": seconds, "tokens": len(output),
                            "differs": output != reference})
    return records


def summarise(records: list[dict]) -> dict:
    """condition -> {ms_per_token (median over repeats), min, max, differing outputs}; and the ratios."""
    summary = {}
    for condition in CONDITIONS:
        times = [1e3 * r["seconds"] / r["tokens"] for r in records if r["condition"] == condition]
        summary[condition] = {"ms_per_token": statistics.median(times), "min": min(times), "max": max(times),
                              "differing": sum(r["differs"] for r in records if r["condition"] == condition)}
    ms = {condition: row["ms_per_token"] for condition, row in summary.items()}
    ratios = {"busy / quiet, fair share": ms["busy, fair share"] / ms["quiet, fair share"],
              "busy / quiet, without": ms["busy, without"] / ms["quiet, without"],
              "quiet: fair share / without": ms["quiet, fair share"] / ms["quiet, without"],
              "busy with the fair share / quiet on one thread": ms["busy, fair share"] / ms["quiet, one thread"]}
    return {"conditions": summary, "ratios": ratios}


def goal_lines(ratios: dict) -> list[str]:
    busy, quiet = ratios["busy / quiet, fair share"], ratios["quiet: fair share / without"]
    return [f"busy / quiet with the fair share: {busy:.2f}x (goal <= 2x) {'met' if busy <= 2 else 'NOT met'}",
            f"quiet, fair share / without: {quiet:.3f} (goal within 3%) {'met' if abs(quiet - 1) <= 0.03 else 'NOT met'}"]


def main(argv: list[str] | None = None) -> dict:
    parser = cli.benchmark_parser(__doc__)
    cli.add_models(parser, device=False)
    cli.add_run(parser, max_new_tokens=48, repeats=5, out=Path("bench_results"), quiet=True)
    args = cli.parse(parser, argv)
    model, tokenizer = load_model(args.model, dtype=args.dtype)
    prompt = encode(tokenizer, load_humaneval(1)[0][1])
    records = run(model, prompt, args.max_new_tokens, args.repeats)
    summary = summarise(records)
    settings = {"model": args.model or "SmolLM2-135M-Instruct", "dtype": str(model.dtype),
                "prompt": "the first HumanEval development prompt", "prompt_tokens": len(prompt),
                "max_new_tokens": args.max_new_tokens, "repeats": args.repeats,
                "threads": torch.get_num_threads(), "date": time.strftime("%Y-%m-%d"), "machine": machine()}
    goals = goal_lines(summary["ratios"])
    lines = [f"Plain greedy decoding beside one CPU-bound process (`python -c \"{BUSY_LOOP}\"`) and quiet, with the fair "
             f"share of threads and without it (ms a token, median of {args.repeats} repeats, min-max).", "",
             f"Machine: {settings['machine']}", "", f"Settings: {settings}", "",
             "| run | ms a token | min-max | outputs differing |", "|---|---|---|---|"]
    for condition, row in summary["conditions"].items():
        lines.append(f"| {condition} | {row['ms_per_token']:.1f} | {row['min']:.1f}-{row['max']:.1f} | {row['differing']} |")
    lines += [""] + [f"- {name}: {value:.2f}" for name, value in summary["ratios"].items()]
    lines += [f"- {line}" for line in goals]
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "busy.json").write_text(json.dumps({"settings": settings, "summary": summary, "records": records},
                                                   indent=1))
    (args.out / "busy.md").write_text("\n".join(lines) + "\n")
    console = Console(quiet=args.quiet)
    table = Table("run", "ms a token", "min-max", "outputs differing", title=f"plain greedy decoding, {settings['model']}")
    for condition, row in summary["conditions"].items():
        table.add_row(condition, f"{row['ms_per_token']:.1f}", f"{row['min']:.1f}-{row['max']:.1f}", str(row["differing"]))
    console.print(table)
    for line in goals:
        console.print(line)
    return summary


if __name__ == "__main__":
    main()
