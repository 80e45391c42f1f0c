"""Spec-Bench: our decoding methods against transformers' own, interleaved in one process.

    python -m benchmarks.spec_bench --per-category 2            # greedy (make bench: a shorter run)
    python -m benchmarks.spec_bench --per-category 2 --sample   # temperature 0.7, top-p 0.9
    python -m benchmarks.spec_bench --workload humaneval --per-category 10   # HumanEval's code prompts
    accelerate launch -m benchmarks.spec_bench --per-category 2  # split over the GPUs of accelerate's config
    accelerate launch --multi_gpu --num_processes 2 -m benchmarks.spec_bench   # 2 processes (CPU-only: gloo)

Every method runs on each prompt `--repeats` times after a warm-up, interleaved in a rotating
order, so that a burst of load on the machine lands on one repeat of one method. Each method learns from
its own runs only (`benchmarks/learned.py`): methods that share a drafter would otherwise share what the
pair learned, the later one drafting from what the earlier had just learned on the same prompt. Greedy: every
output is checked token for token against transformers' greedy `generate`, and one that differs is
a near-tie or a defect (`benchmarks/exactness.py`). Sampling: transformers' assisted generation and
prompt lookup sample too (`do_sample=True`); outputs differ run to run, methods are compared by
tokens/s (fixed seeds per prompt and repeat). The summary, spread and noise verdict are
`benchmarks/summary.py`'s; where the time goes (forward passes, our loop's phases) is
`benchmarks/breakdown.py`'s. Writes results.json, report.md and speedup.png to --out, and prints the table.
"""

from __future__ import annotations

import copy
import json
import os
import threading
import time
from pathlib import Path

import torch
from accelerate import PartialState
from accelerate.utils import gather_object
from rich.console import Console
from rich.table import Table
from tqdm import tqdm

from benchmarks import breakdown, cli
from benchmarks.breakdown import ForwardMeter
from benchmarks.exactness import Classifier, describe
from benchmarks.learned import learned_apart
from benchmarks.prompts import encode, load_workload
from benchmarks.suffix_decoding import cache_with_responses, load_peer, run_suffix
from benchmarks.summary import BASELINE, CONTROL, exactness, goal_lines, noise_verdict, report, summarise, tasks_in
from ngram_assisted import MultiDynaGram, SimpleDynaGram, ngram_assisted_speculative_generate
from sampling import SpeculativeStats, autoregressive_generate, speculative_generate
from utils.calibration import pass_costs
from utils.loading import end_token_ids, load_model
from utils.logits_processors import GreedyProcessor, NucleusProcessor
from utils.machine import machine
from utils.runners.model_info import input_device

METHODS = [BASELINE, CONTROL, "ours_ar", "hf_prompt_lookup", "ours_nasd", "ours_nasd_g10", "ours_nasd_g16",
           "ours_nasd_n3", "ours_nasd_chain", "ours_anpd", "ours_chain_nocut", "ours_tree3_nocut", "hf_assisted", "ours_sd",
           "ours_sd_chain", "ours_hybrid", "ours_self", "ours_self_no_cascade", "ours_self_chain", "ours_self_hybrid"]
OPTIONAL_METHODS = ["suffix",  # SuffixDecoding, once built: python -m benchmarks.suffix_decoding --build
                    "ours_sd_universal", "hf_universal"]  # a --drafter with another tokenizer: ours and transformers'
# NASD settings: the defaults (trees where they pay), a chain, ANPD's, and drafting without the cost cut.
NASD = {
    "ours_nasd": dict(ngram=lambda: MultiDynaGram(8)),
    "ours_nasd_g10": dict(ngram=lambda: MultiDynaGram(8), gamma=10),  # prompt lookup's draft length (10 tokens)
    "ours_nasd_g16": dict(ngram=lambda: MultiDynaGram(8), gamma=16),  # the default before the eleventh round
    "ours_nasd_n3": dict(ngram=lambda: MultiDynaGram(3)),  # the setting before 2026-12-01
    "ours_nasd_chain": dict(ngram=lambda: MultiDynaGram(8), branching=1),
    "ours_anpd": dict(ngram=lambda: SimpleDynaGram(3), gamma=5, top_k_filler=1, stop_if_unknown=False),
    "ours_chain_nocut": dict(ngram=lambda: MultiDynaGram(3), gamma=8, stop_if_unknown=False, branching=1),
    "ours_tree3_nocut": dict(ngram=lambda: MultiDynaGram(3), gamma=8, stop_if_unknown=False, branching=3),
}
# The step-time breakdown's comparisons: ours against transformers' nearest method.
BREAKDOWN_PAIRS = [("ours_nasd_g10", "hf_prompt_lookup", "both draft 10 tokens at most"),
                   ("ours_nasd", "hf_prompt_lookup", "31 (its default, cut by the costs) against 10 tokens at most"),
                   ("ours_sd", "hf_assisted", "the same drafter model"), ("ours_ar", BASELINE, "no drafts")]


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
    """One callable per method: (ids, seed) -> (generated ids, stats or None)."""

    def __init__(self, target, drafter, end_tokens: list[int], max_new_tokens: int, sample: dict | None) -> None:
        self.target, self.drafter, self.end, self.n = target, drafter, end_tokens, max_new_tokens
        self.sample = sample  # None: greedy; else {"temperature": t, "top_p": p}
        self.processor = NucleusProcessor(**sample) if sample else GreedyProcessor()
        self.suffix_responses: dict[tuple[int, ...], list[int]] = {}  # prompt -> the peer's first response to it
        self.tokenizer = self.drafter_tokenizer = None  # the *_universal methods: target's and drafter's tokenizers

    def hf(self, ids, seed: int, **kwargs):
        sampling = dict(do_sample=True, top_k=0, **self.sample) if self.sample else dict(do_sample=False)
        torch.manual_seed(seed)
        device = input_device(self.target)  # transformers' baseline gets its ids where the model runs
        out = self.target.generate(
            torch.tensor([ids], device=device), attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=device),
            max_new_tokens=self.n,
            eos_token_id=self.end, pad_token_id=self.end[0] if self.end else None, **sampling, **kwargs,
        )
        return out[0, len(ids):].tolist(), None

    def run(self, method: str, ids: list[int], seed: int = 0):
        stats = SpeculativeStats(timed=True)  # the loop's phases (benchmarks/breakdown.py)
        common = dict(max_gen_len=self.n, end_tokens_id=self.end, logits_processor=self.processor,
                      generator=torch.Generator().manual_seed(seed))
        if method in (BASELINE, CONTROL):
            return self.hf(ids, seed)
        if method == "hf_prompt_lookup":
            return self.hf(ids, seed, prompt_lookup_num_tokens=10, max_matching_ngram_size=3)
        if method == "hf_assisted":
            return self.hf(ids, seed, assistant_model=self.drafter)
        if method == "hf_universal":  # transformers' universal assisted generation, on the same pair
            return self.hf(ids, seed, assistant_model=self.drafter, tokenizer=self.tokenizer,
                           assistant_tokenizer=self.drafter_tokenizer)
        if method == "ours_ar":
            return autoregressive_generate(ids, self.target, **common), None
        if method in NASD:
            settings = dict(NASD[method])
            pool = settings.pop("ngram")()
            out, _ = ngram_assisted_speculative_generate(ids, pool, self.target, stats=stats, **settings, **common)
        elif method == "suffix":  # the SuffixDecoding peer in our loop, its global cache: the other prompts' responses
            peer, why = load_peer()
            if peer is None:
                raise RuntimeError(why)
            cache = cache_with_responses(peer, [r for key, r in self.suffix_responses.items() if key != tuple(ids)])
            out, _ = run_suffix(ids, self.target, cache, max_new_tokens=self.n, end_tokens=self.end,
                                stats=stats, on_step=None, processor=self.processor, generator=common["generator"])
            self.suffix_responses.setdefault(tuple(ids), out)
        elif method in ("ours_sd", "ours_sd_chain"):  # the default (trees where the costs say), chains only
            out, _ = speculative_generate(ids, self.drafter, self.target, gamma=4, adaptive_gamma=True, stats=stats,
                                          branching=1 if method == "ours_sd_chain" else None, **common)
        elif method == "ours_hybrid":  # the drafter model and NASD's pool, the better per step
            out, _ = speculative_generate(ids, self.drafter, self.target, gamma=4, adaptive_gamma=True, stats=stats,
                                          ngram=MultiDynaGram(8), **common)
        elif method in ("ours_self", "ours_self_no_cascade", "ours_self_chain"):  # docs/self_drafting.md
            # The target's own 4-bit weights draft ("self": built once, kept on the target), as a user calls it (the
            # cascade on, as with every adaptive drafter model; trees where the planner says), without the cascade
            # (what `ours_self` measured through the fourteenth round), and in chains only.
            out, _ = speculative_generate(ids, "self", self.target, gamma=4, adaptive_gamma=True, stats=stats,
                                          cascade=False if method == "ours_self_no_cascade" else None,
                                          branching=1 if method == "ours_self_chain" else None, **common)
        elif method == "ours_self_hybrid":  # the four-bit self-drafter and NASD's pool, the better per step
            out, _ = speculative_generate(ids, "self", self.target, gamma=4, adaptive_gamma=True, stats=stats,
                                          ngram=MultiDynaGram(8), **common)
        elif method == "ours_sd_universal":
            out, _ = speculative_generate(ids, self.drafter, self.target, tokenizer=self.tokenizer,
                                          drafter_tokenizer=self.drafter_tokenizer, gamma=4, adaptive_gamma=True,
                                          stats=stats, **common)
        else:
            raise ValueError(f"unknown method {method!r}; choose from {METHODS}")
        return out, stats


def write_chart(out: Path, summary: dict, methods: list[str], verdict: dict, mode: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = tasks_in(summary)
    fig, ax = plt.subplots(figsize=(11, 4.5))
    width = 0.8 / len(methods)
    for i, method in enumerate(methods):
        rows = [summary[method]["tasks"].get(name) for name in tasks]
        heights = [row["speedup"] if row else 0 for row in rows]
        # Whiskers: the range of single repeats' ratios (the bar, a median over prompts, may lie outside it).
        errors = [[max(0.0, row["speedup"] - row["speedup_min"]) if row else 0 for row in rows],
                  [max(0.0, row["speedup_max"] - row["speedup"]) if row else 0 for row in rows]]
        ax.bar([t + i * width for t in range(len(tasks))], heights, width, yerr=errors, capsize=2, label=method)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([t + 0.4 - width / 2 for t in range(len(tasks))], tasks, fontsize=8)
    ax.set_ylabel(f"speedup vs transformers ({mode})")
    ax.legend(fontsize=7, ncol=4)
    if verdict["noisy"]:
        ax.set_title("NOISY RUN: not to be quoted (" + "; ".join(verdict["reasons"])[:120] + ")", color="red", fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "speedup.png", dpi=120)
    plt.close(fig)


def run_all(runner: Runner, prompts: list[tuple[int, str, list[int]]], methods: list[str], repeats: int, quiet: bool,
            seed: int) -> list[dict]:
    """Every (repeat, prompt, method), methods in an order rotated at each (repeat, prompt).
    `prompts`: (index in the whole run, task, ids), so that the records of several processes merge."""
    records = []
    total = repeats * len(prompts) * len(methods)
    with tqdm(total=total, desc="runs", disable=quiet) as progress:
        for repeat in range(repeats):
            for index, task, ids in prompts:
                shift = (repeat + index) % len(methods)
                for method in methods[shift:] + methods[:shift]:
                    with PeakMemory() as memory, ForwardMeter(target=runner.target, drafter=runner.drafter) as meter:
                        with learned_apart(method):
                            start = time.perf_counter()
                            out, stats = runner.run(method, ids, seed=seed + 1000 * repeat + index)
                            seconds = time.perf_counter() - start
                    records.append({
                        "task": task, "method": method, "prompt": index, "repeat": repeat, "prompt_tokens": len(ids),
                        "tokens": len(out), "seconds": seconds, "tau": stats.tau if stats else None,
                        "alpha": stats.alpha if stats else None, "steps": stats.steps if stats else None,
                        "steps_without_drafts": stats.steps_without_drafts if stats else None, "output": out, "peak_rss_mib": memory.peak,
                        "phases": dict(stats.seconds) if stats else None,
                        "counters": dict(stats.counters) if stats else None, **meter.record(),  # e.g. tree_steps
                    })
                    progress.update()
    check_outputs(records, {index: ids for index, _, ids in prompts}, runner)
    return records


def check_outputs(records: list[dict], prompts: dict[int, list[int]], runner: Runner) -> None:
    """Greedy: every output must equal transformers' (`matches_reference`); one that differs is a
    near-tie or a defect (`difference`, benchmarks/exactness.py). Sampling: nothing to compare."""
    reference = {(r["prompt"], r["repeat"]): r["output"] for r in records if r["method"] == BASELINE}
    classify = Classifier(runner.target)
    for r in records:
        if runner.sample is not None:
            r["matches_reference"], r["difference"] = True, None
            continue
        ref = reference[(r["prompt"], r["repeat"])]
        r["matches_reference"] = r["output"] == ref
        difference = None if r["matches_reference"] else classify(prompts[r["prompt"]], ref, r["output"])
        r["difference"] = difference.as_dict() if difference else None


def main(argv: list[str] | None = None) -> dict:
    parser = cli.benchmark_parser(__doc__)
    cli.add_workload(parser)
    cli.add_run(parser, max_new_tokens=128, repeats=3, out=Path("bench_results"), quiet=True)
    parser.add_argument("--methods", default=",".join(METHODS))
    cli.add_sampling(parser)
    cli.add_models(parser, drafter="drafter, e.g. qwen2.5-coder-0.5b-instruct (default: a bfloat16 copy of the target)",
                   device_map=True, quantize=True)
    parser.add_argument("--seed", type=int, default=0)
    args = cli.parse(parser, argv)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = set(methods) - set(METHODS) - set(OPTIONAL_METHODS)
    if unknown:
        parser.error(f"unknown methods {sorted(unknown)}; choose from {METHODS + OPTIONAL_METHODS}")
    if "suffix" in methods and load_peer()[0] is None:
        parser.error(load_peer()[1])
    for required in (CONTROL, BASELINE):  # the reference for speed and outputs, and the noise control
        if required not in methods:
            methods.insert(0, required)
    texts = load_workload(args.workload, args.per_category, path=args.data)
    if not texts:
        parser.error(f"no prompts: --per-category {args.per_category} of workload {args.workload}")
    mode = "sampling" if args.sample else "greedy"
    # Under `accelerate launch` (several processes: GPUs, or CPU processes with --cpu) each process
    # takes its share of the prompts on its own device; the main process merges and reports.
    state = PartialState(cpu=not torch.cuda.is_available())  # CPU processes talk over gloo
    console = Console(quiet=args.quiet or not state.is_main_process)
    device = str(state.device) if state.num_processes > 1 and state.device.type != "cpu" and not args.device_map else None
    device = args.device or device
    target, tokenizer = load_model(args.model, dtype=args.dtype, device_map=args.device_map, device=device,
                                   quantize=args.quantize)
    if args.drafter or args.device_map or args.quantize:  # a dispatched or quantized target: load the copy
        drafter, drafter_tokenizer = load_model(args.drafter or args.model, dtype=target.dtype if args.drafter else "bfloat16",
                                                device=device, quantize=args.drafter_quantize)
    else:
        drafter, drafter_tokenizer = copy.deepcopy(target).to(torch.bfloat16), tokenizer
    sample = cli.sampling_settings(args)
    runner = Runner(target, drafter, end_token_ids(target, tokenizer), args.max_new_tokens, sample)
    runner.tokenizer, runner.drafter_tokenizer = tokenizer, drafter_tokenizer
    prompts = [(index, task, encode(tokenizer, text)) for index, (task, text) in enumerate(texts)]
    load_before = os.getloadavg()
    for method in methods:  # warm-up (and the cost models' calibration, once per machine)
        with learned_apart(method):
            runner.run(method, prompts[0][2][:32])
    with state.split_between_processes(prompts) as mine:
        records = run_all(runner, mine, methods, args.repeats, args.quiet or not state.is_main_process, args.seed)
    if state.num_processes > 1:
        records = gather_object(records)
        if not state.is_main_process:
            return {"records": records}
    summary = summarise(records, methods)
    verdict = noise_verdict(records, summary)
    steps = breakdown.summarise(records, methods)
    settings = {"mode": mode, "workload": args.workload, **(sample or {}), "model": args.model or "SmolLM2-135M-Instruct",
                "drafter": args.drafter or "bf16 copy of target", "quantize": args.quantize,
                "drafter_quantize": args.drafter_quantize, "max_new_tokens": args.max_new_tokens,
                "per_category": args.per_category, "repeats": args.repeats, "date": time.strftime("%Y-%m-%d"),
                "processes": state.num_processes,
                "load_average_before": load_before, "load_average_after": os.getloadavg(),
                "machine": machine(), "cost_table": pass_costs(target).table()}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(
        {"settings": settings, "verdict": verdict, "summary": summary, "breakdown": steps, "records": records}, indent=1))
    text = report(summary, methods, settings, verdict, mode)
    text += "\n".join(breakdown.report_lines(steps, BREAKDOWN_PAIRS)) + "\n"
    (args.out / "report.md").write_text(text)
    write_chart(args.out, summary, methods, verdict, mode)

    tasks_shown = tasks_in(summary)
    table = Table("method", *tasks_shown, "overall", "differences", title=f"speedup vs transformers ({mode}), [min-max]")
    for method in methods:
        tasks = summary[method]["tasks"]
        table.add_row(method, *[f"{tasks[t]['speedup']:.2f}x [{tasks[t]['speedup_min']:.2f}-{tasks[t]['speedup_max']:.2f}]"
                                if t in tasks else "-" for t in tasks_shown],
                      f"{summary[method]['overall']:.2f}x", describe(exactness(summary, method)) if mode == "greedy" else "-")
    console.print(table)
    console.print("[red]NOISY RUN[/red]: " + "; ".join(verdict["reasons"]) if verdict["noisy"] else
                  f"quiet run (median spread of repeats {verdict['median_spread']:.0%})")
    for line in goal_lines(summary, mode, verdict, args.workload):
        console.print(line)
    console.print(f"written to {args.out}/ (results.json, report.md, speedup.png)")
    return {"summary": summary, "records": records, "report": text, "verdict": verdict, "breakdown": steps}


if __name__ == "__main__":
    main()
