"""Compiled passes over a static KV buffer against the memory bound and transformers' fastest plain decoding.

    python -m benchmarks.compiled --target qwen2.5-coder-1.5b-instruct --drafter qwen2.5-coder-0.5b-instruct

For each model (the target, and the drafter if given): the memory bound of a one-token pass (weight bytes over the
measured copy bandwidth), the one-token pass eager (a growing cache, the CPU shortcuts measured fastest) and compiled,
each compiled width's cost relative to the compiled one-token pass, and what `compile_model` took (the first start
on a machine compiles; run the script twice: the second run's figure is a later start's, from inductor's cache under
SPECDEC_CACHE). Then plain greedy decoding of the workload's prompts: ours eager, ours compiled, transformers'
`generate` eager and with `cache_implementation="static"` and a compiled forward (as transformers documents it,
`CompileConfig`, on CPU `_compile_all_devices`), interleaved prompt by prompt, medians of tokens/s, every output
checked against ours eager (near-ties told from defects, `benchmarks/exactness.py`). transformers' static generate
is warmed up on each prompt first (its graphs follow the cache's length: the warm-up is its compile).
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
from benchmarks.draft_cost import copy_bandwidth, weight_bytes
from benchmarks.exactness import Classifier, counts, describe
from benchmarks.prompts import encode, load_workload
from sampling import autoregressive_generate
from utils import compile_policy
from utils.loading import end_token_ids, load_model
from utils.machine import machine
from utils.runners import SequenceRunner
from utils.runners.compiled import DEFAULT_WIDTHS, compiled_passes, forget, register
from utils.runners.static import StaticSequence

CONTEXT = 256  # tokens in the cache while passes are timed
METHODS = ("ours_eager", "ours_compiled", "hf_eager", "hf_static_compiled")


def _timed_passes(runners: dict, widths: list[int], repeats: int) -> dict[tuple[str, int], float]:
    """Median seconds of a pass over `width` new tokens after `CONTEXT`, each runner, interleaved."""
    times: dict[tuple[str, int], list[float]] = {}
    for round_ in range(repeats + 1):  # the first round warms up
        for width in widths:
            for name, runner in runners.items():
                start = time.perf_counter()
                runner.forward(list(range(10, 10 + width)), num_logits=1)
                if round_:
                    times.setdefault((name, width), []).append(time.perf_counter() - start)
                runner.rollback(CONTEXT)
    return {key: statistics.median(values) for key, values in times.items()}


def passes_report(model, label: str, repeats: int) -> dict:
    """The bound, eager and compiled passes of `model`, and what `load_model(compile="auto")` took to
    have its compiled passes ready here (the first run on a machine compiles; a later run loads from
    the cache: run the script twice for both figures)."""
    bandwidth, size = copy_bandwidth(), weight_bytes(model)
    first = compile_policy.stored_verdict(model) is None
    start = time.perf_counter()
    compile_policy.apply(model, "auto")
    passes = compiled_passes(model)
    compile_seconds = time.perf_counter() - start
    report = {"model": label, "weight_gb": size / 1e9, "copy_gb_s": bandwidth / 1e9, "bound_ms": 1e3 * size / bandwidth,
              "compile_seconds": compile_seconds, "first_start": first, "compiled": passes is not None,
              "verdict": compile_policy.stored_verdict(model)}
    context = list(range(100, 100 + CONTEXT))
    runners = {"eager": SequenceRunner(model)}
    if passes is not None:
        runners["compiled"] = StaticSequence(model, slots=passes.slots, compiled=passes)
    for runner in runners.values():
        runner.forward(context)
    widths = sorted(set(DEFAULT_WIDTHS) | {8})  # 8: a verification pass between the graphs (padded to 16)
    times = _timed_passes(runners, widths, repeats)
    report["eager_ms"] = 1e3 * times[("eager", 1)]
    report["widths"] = {w: {name: 1e3 * times[(name, w)] for name in runners} for w in widths}
    if passes is not None:
        report["compiled_ms"] = 1e3 * times[("compiled", 1)]
    return report


def _hf(model, ids: list[int], n: int, end: list[int], static: bool) -> list[int]:
    from transformers import CompileConfig

    kwargs = {}
    if static:
        config = CompileConfig(fullgraph=False, dynamic=False, mode="default")
        config._compile_all_devices = True  # transformers compiles on accelerators only, unless told
        kwargs = dict(cache_implementation="static", compile_config=config, max_cache_len=2048)
    out = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long), do_sample=False,
                         max_new_tokens=n, eos_token_id=end, pad_token_id=end[0], **kwargs)
    return out[0, len(ids):].tolist()


def decoding_report(model, passes, prompts: list[list[int]], n: int, end: list[int], repeats: int) -> dict:
    """Plain greedy decoding, four ways, interleaved per prompt -> tokens/s medians and differences."""

    def ours(ids: list[int], compiled: bool) -> list[int]:
        if compiled:
            register(model, passes)
        else:
            forget(model)
        try:
            return autoregressive_generate(ids, model, max_gen_len=n, end_tokens_id=end)
        finally:
            forget(model)

    run = {"ours_eager": lambda ids: ours(ids, False), "ours_compiled": lambda ids: ours(ids, True),
           "hf_eager": lambda ids: _hf(model, ids, n, end, False), "hf_static_compiled": lambda ids: _hf(model, ids, n, end, True)}
    if passes is None:
        del run["ours_compiled"]
    rates: dict[str, list[float]] = {name: [] for name in run}
    differences: dict[str, list] = {name: [] for name in run}
    classify = Classifier(model)
    for ids in prompts:
        run["hf_static_compiled"](ids)  # its compile for this prompt's cache: not timed
        reference = None
        for _ in range(repeats):
            for name, method in run.items():
                start = time.perf_counter()
                out = method(ids)
                rates[name].append(len(out) / (time.perf_counter() - start))
                reference = out if name == "ours_eager" else reference
                differences[name].append(None if out == reference else classify(ids, reference, out))
    return {name: {"tokens_per_s": statistics.median(values), "min": min(values), "max": max(values),
                   "differences": counts(differences[name])} for name, values in rates.items()}


def main(argv: list[str] | None = None) -> dict:
    parser = cli.benchmark_parser(__doc__)
    cli.add_models(parser, drafter="a second model whose passes to report (e.g. the target's drafter)", device=False)
    cli.add_workload(parser, workload="humaneval", per_category=4)
    cli.add_run(parser, max_new_tokens=64, repeats=3, out=Path("bench_results/compiled"))
    args = cli.parse(parser, argv)
    console = Console()
    console.print(f"machine: {machine()}")
    start = time.perf_counter()
    target, tokenizer = load_model(args.model, dtype=args.dtype, compile=False)
    models = [("target", target)]
    if args.drafter:
        models.append(("drafter", load_model(args.drafter, dtype=args.dtype, compile=False)[0]))
    loaded = time.perf_counter() - start
    reports = [passes_report(model, f"{label} ({type(model).__name__}, {next(model.parameters()).dtype})", args.repeats)
               for label, model in models]
    table = Table("model", "bound", "eager", "compiled", "of the bound", "ready in", title="one-token pass after 256 tokens")
    for r in reports:
        compiled = f"{r['compiled_ms']:.1f} ms" if r["compiled"] else "-"
        share = f"{r['bound_ms'] / r['compiled_ms']:.0%}" if r["compiled"] else f"{r['bound_ms'] / r['eager_ms']:.0%} eager"
        start = "first start" if r["first_start"] else "later start"
        table.add_row(r["model"], f"{r['bound_ms']:.1f} ms", f"{r['eager_ms']:.1f} ms", compiled, share,
                      f"{r['compile_seconds']:.0f} s ({start})")
    console.print(table)
    for r in reports:
        console.print(f"{r['model']}: pass over w tokens / one-token pass: " + ", ".join(
            f"w={w}: " + ", ".join(f"{name} {ms / r['widths'][1][name]:.2f}" for name, ms in c.items())
            for w, c in r["widths"].items()))
    texts = load_workload(args.workload, args.per_category, path=args.data)
    prompts = [encode(tokenizer, text) for _, text in texts]
    end = end_token_ids(target, tokenizer)
    decoding = decoding_report(target, compiled_passes(target), prompts, args.max_new_tokens, end, args.repeats)
    table = Table("method", "tokens/s", "vs hf_eager", "vs hf_static_compiled", "differences",
                  title=f"plain greedy decoding, {len(prompts)} prompts, {args.max_new_tokens} new tokens")
    for name, d in decoding.items():
        table.add_row(name, f"{d['tokens_per_s']:.2f} [{d['min']:.2f}-{d['max']:.2f}]",
                      f"{d['tokens_per_s'] / decoding['hf_eager']['tokens_per_s']:.2f}x",
                      f"{d['tokens_per_s'] / decoding['hf_static_compiled']['tokens_per_s']:.2f}x", describe(d["differences"]))
    console.print(table)
    result = {"machine": machine(), "load_seconds": loaded, "passes": reports, "decoding": decoding,
              "date": time.strftime("%Y-%m-%d")}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(result, indent=1))
    console.print(f"written to {args.out}/results.json")
    return result


if __name__ == "__main__":
    main()
