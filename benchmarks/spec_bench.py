"""Spec-Bench: our decoding methods against transformers' own, interleaved in one process.

    python -m benchmarks.spec_bench --per-category 2          # or: make bench

Every method runs on each prompt in turn (after a warm-up), greedy, and every output is checked
token for token against transformers' greedy `generate`. Writes results.json, report.md and
speedup.png to --out, and prints the table.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import threading
import time
from collections import defaultdict
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table
from tqdm import tqdm

from ngram_assisted import MultiDynaGram, SimpleDynaGram, ngram_assisted_speculative_generate
from sampling import SpeculativeStats, autoregressive_generate, speculative_generate
from utils.loading import end_token_ids, load_model

MT_BENCH = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
TASKS = ["multi-turn conversation", "translation", "summarization", "qa", "math_reasoning", "rag"]
METHODS = ["hf_greedy", "ours_ar", "hf_prompt_lookup", "ours_nasd", "ours_anpd", "hf_assisted", "ours_sd"]
GOALS = {  # method: (compared with, minimum speed ratio, over which tasks)
    "ours_ar": ("hf_greedy", 1.0), "ours_nasd": ("hf_greedy", 1.3), "ours_sd": ("hf_assisted", 1.1),
}
DEFAULT_DATA = Path(__file__).resolve().parent.parent.parent / "shared" / "data" / "spec_bench_dev.jsonl"


def task_of(category: str) -> str:
    return "multi-turn conversation" if category in MT_BENCH else category


def load_prompts(path: Path, per_category: int) -> list[tuple[str, str]]:
    """(task, first turn) pairs, at most `per_category` per task, in file order."""
    chosen: dict[str, list[str]] = defaultdict(list)
    for line in path.read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            task = task_of(record["category"])
            if len(chosen[task]) < per_category:
                chosen[task].append(record["turns"][0])
    return [(task, text) for task in TASKS for text in chosen.get(task, [])]


def encode(tokenizer, text: str) -> list[int]:
    if getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)
    return tokenizer(text)["input_ids"]


class PeakMemory:
    """Peak resident memory (MiB) of this process while the block runs, sampled every 5 ms."""

    def __enter__(self):
        import psutil

        self._process, self._stop, self.peak = psutil.Process(), threading.Event(), 0.0
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while True:
            self.peak = max(self.peak, self._process.memory_info().rss / 2**20)
            if self._stop.wait(0.005):
                return

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


class Runner:
    """One callable per method: ids -> (generated ids, stats or None)."""

    def __init__(self, target, drafter, end_tokens: list[int], max_new_tokens: int) -> None:
        self.target, self.drafter, self.end, self.n = target, drafter, end_tokens, max_new_tokens

    def hf(self, ids, **kwargs):
        out = self.target.generate(
            torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), do_sample=False,
            max_new_tokens=self.n, eos_token_id=self.end, pad_token_id=self.end[0] if self.end else None, **kwargs,
        )
        return out[0, len(ids):].tolist(), None

    def run(self, method: str, ids: list[int]):
        stats = SpeculativeStats()
        common = dict(max_gen_len=self.n, end_tokens_id=self.end)
        if method == "hf_greedy":
            return self.hf(ids)
        if method == "hf_prompt_lookup":
            return self.hf(ids, prompt_lookup_num_tokens=10, max_matching_ngram_size=3)
        if method == "hf_assisted":
            return self.hf(ids, assistant_model=self.drafter)
        if method == "ours_ar":
            return autoregressive_generate(ids, self.target, **common), None
        if method == "ours_nasd":
            out, _ = ngram_assisted_speculative_generate(ids, MultiDynaGram(6), self.target, stats=stats, **common)
        elif method == "ours_anpd":
            out, _ = ngram_assisted_speculative_generate(ids, SimpleDynaGram(3), self.target, gamma=5, top_k_filler=1,
                                                         stop_if_unknown=False, stats=stats, **common)
        elif method == "ours_sd":
            out, _ = speculative_generate(ids, self.drafter, self.target, gamma=4, adaptive_gamma=True, stats=stats,
                                          **common)
        else:
            raise ValueError(f"unknown method {method!r}; choose from {METHODS}")
        return out, stats


def geometric_mean(values: list[float]) -> float:
    return math.exp(statistics.fmean(math.log(v) for v in values)) if values else float("nan")


def summarise(records: list[dict], methods: list[str]) -> dict:
    """Per method and task: speedup vs hf_greedy (ratio of summed times), tokens/s, tau, alpha."""
    summary: dict = {}
    for method in methods:
        rows = {}
        for task in TASKS:
            mine = [r for r in records if r["method"] == method and r["task"] == task]
            base = [r for r in records if r["method"] == "hf_greedy" and r["task"] == task]
            if not mine:
                continue
            time_mine = sum(r["seconds"] for r in mine)
            rows[task] = {
                "speedup": sum(r["seconds"] for r in base) / time_mine if base else float("nan"),
                "tokens_per_s": sum(r["tokens"] for r in mine) / time_mine,
                "tau": statistics.fmean(r["tau"] for r in mine) if mine[0]["tau"] is not None else None,
                "alpha": statistics.fmean(r["alpha"] for r in mine) if mine[0]["alpha"] is not None else None,
                "mismatches": sum(not r["matches_hf_greedy"] for r in mine),
                "peak_rss_mib": max(r["peak_rss_mib"] for r in mine),
            }
        overall = geometric_mean([row["speedup"] for row in rows.values() if not math.isnan(row["speedup"])])
        summary[method] = {"tasks": rows, "overall": overall}
    return summary


def goal_lines(summary: dict) -> list[str]:
    lines = []
    for method, (other, minimum) in GOALS.items():
        if method in summary and other in summary:
            ratio = summary[method]["overall"] / summary[other]["overall"]
            lines.append(f"{method} / {other}: {ratio:.2f}x (goal >= {minimum}x) {'met' if ratio >= minimum else 'NOT met'}")
    if "ours_nasd" in summary:
        worst = min((row["speedup"] for row in summary["ours_nasd"]["tasks"].values()), default=float("nan"))
        lines.append(f"ours_nasd worst task: {worst:.2f}x (goal >= 1.0x) {'met' if worst >= 1.0 else 'NOT met'}")
        if "hf_prompt_lookup" in summary:
            ratio = summary["ours_nasd"]["overall"] / summary["hf_prompt_lookup"]["overall"]
            lines.append(f"ours_nasd / hf_prompt_lookup: {ratio:.2f}x (goal >= 1.5x) {'met' if ratio >= 1.5 else 'NOT met'}")
    return lines


def write_report(out: Path, summary: dict, settings: dict, methods: list[str]) -> str:
    header = "| method | " + " | ".join(TASKS) + " | overall | peak RSS (MiB) |"
    lines = [f"Speedup against transformers' greedy `generate` (ratio of summed times); settings: {json.dumps(settings)}",
             "", header, "|" + "---|" * (len(TASKS) + 3)]
    for method in methods:
        tasks = summary[method]["tasks"]
        cells = [f"{tasks[t]['speedup']:.2f}x" + (f" (tau {tasks[t]['tau']:.2f})" if tasks[t]["tau"] else "")
                 if t in tasks else "-" for t in TASKS]
        peak = max(row["peak_rss_mib"] for row in tasks.values())
        lines.append(f"| {method} | " + " | ".join(cells) + f" | {summary[method]['overall']:.2f}x | {peak:.0f} |")
    lines += ["", *[f"- {line}" for line in goal_lines(summary)]]
    text = "\n".join(lines) + "\n"
    (out / "report.md").write_text(text)
    return text


def write_chart(out: Path, summary: dict, methods: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(11, 4.5))
    width = 0.8 / len(methods)
    for i, method in enumerate(methods):
        tasks = summary[method]["tasks"]
        ax.bar([t + i * width for t in range(len(TASKS))], [tasks.get(name, {}).get("speedup", 0) for name in TASKS],
               width, label=method)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([t + 0.4 - width / 2 for t in range(len(TASKS))], TASKS, fontsize=8)
    ax.set_ylabel("speedup vs transformers greedy")
    ax.legend(fontsize=7, ncol=4)
    fig.tight_layout()
    fig.savefig(out / "speedup.png", dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", type=Path, default=DEFAULT_DATA)
    parser.add_argument("--per-category", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--model", default=None, help="target (default: the built-in SmolLM2-135M-Instruct)")
    parser.add_argument("--drafter", default=None, help="drafter (default: a bfloat16 copy of the target)")
    parser.add_argument("--device-map", default=None, help="accelerate placement of the target, e.g. auto")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path("bench_results"))
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = set(methods) - set(METHODS)
    if unknown:
        parser.error(f"unknown methods {sorted(unknown)}; choose from {METHODS}")
    if "hf_greedy" not in methods:
        methods.insert(0, "hf_greedy")  # the reference for speed and for the outputs
    if not args.data.exists():
        parser.error(f"--data {args.data} does not exist")
    torch.manual_seed(args.seed)
    console = Console(quiet=args.quiet)
    target, tokenizer = load_model(args.model, device_map=args.device_map)
    if args.drafter or args.device_map:  # a dispatched target cannot be deep-copied: load the copy
        drafter = load_model(args.drafter or args.model, dtype="bfloat16" if not args.drafter else "float32")[0]
    else:
        drafter = copy.deepcopy(target).to(torch.bfloat16)
    runner = Runner(target, drafter, end_token_ids(target, tokenizer), args.max_new_tokens)
    prompts = [(task, encode(tokenizer, text)) for task, text in load_prompts(args.data, args.per_category)]
    for method in methods:  # warm-up
        runner.run(method, prompts[0][1][:32])

    records = []
    for task, ids in tqdm(prompts, desc="prompts", disable=args.quiet):
        reference = None
        for method in methods:
            with PeakMemory() as memory:
                start = time.perf_counter()
                out, stats = runner.run(method, ids)
                seconds = time.perf_counter() - start
            reference = out if method == "hf_greedy" else reference
            records.append({
                "task": task, "method": method, "prompt_tokens": len(ids), "tokens": len(out), "seconds": seconds,
                "tau": stats.tau if stats else None, "alpha": stats.alpha if stats else None,
                "matches_hf_greedy": out == reference, "peak_rss_mib": memory.peak,
            })
    summary = summarise(records, methods)
    settings = {"model": args.model or "SmolLM2-135M-Instruct", "drafter": args.drafter or "bf16 copy of target",
                "max_new_tokens": args.max_new_tokens, "per_category": args.per_category, "greedy": True,
                "threads": torch.get_num_threads(), "date": time.strftime("%Y-%m-%d")}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps({"settings": settings, "summary": summary, "records": records},
                                                      indent=1))
    report = write_report(args.out, summary, settings, methods)
    write_chart(args.out, summary, methods)

    table = Table("method", *TASKS, "overall", "mismatches", "peak RSS MiB", title="speedup vs transformers greedy")
    for method in methods:
        tasks = summary[method]["tasks"]
        table.add_row(method, *[f"{tasks[t]['speedup']:.2f}x" if t in tasks else "-" for t in TASKS],
                      f"{summary[method]['overall']:.2f}x", str(sum(r["mismatches"] for r in tasks.values())),
                      f"{max(r['peak_rss_mib'] for r in tasks.values()):.0f}")
    console.print(table)
    for line in goal_lines(summary):
        console.print(line)
    console.print(f"written to {args.out}/ (results.json, report.md, speedup.png)")
    return {"summary": summary, "records": records, "report": report}


if __name__ == "__main__":
    main()
