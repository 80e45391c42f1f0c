"""Time to the first token (the prompt pass), ours against transformers' on its own copy of the weights, against the
machine's matrix peak; and a user's own checkpoint loaded by path against the same model by its short name.

    python -m benchmarks first_token --model qwen2.5-coder-0.5b-instruct --lengths 512,2048 --repeats 3
    python -m benchmarks first_token --model smollm2-135m-instruct \\
        --path ~/.cache/speculative-decoding/SmolLM2-135M-Instruct-bf16

First token: for each prompt length (--lengths, each capped at the model's context less one position), a prompt
of exactly that many tokens cut from HumanEval's development prompts (even task ids, concatenated until long
enough, repeated if they are not), and per repeat, in a rotating order, our `autoregressive_generate(ids, model,
max_gen_len=1)` against transformers' `generate(..., max_new_tokens=1, do_sample=False)` on a second
`load_model` of the same model: neither warms the other's caches, and transformers' weights are not laid out for
our kernels (our forward fuses its model's weights in place). Median, min and max seconds; both first tokens
checked equal (a difference is a near-tie or a defect, `benchmarks/exactness.py`).

Against the peak: a GEMM of --gemm-size rows by a square matrix of that size, in bfloat16 and float32 (and the
model's dtype), best of a few runs, in FLOP/s, measured in the same process; each prompt pass's FLOP/s by
`FLOPS_FORMULA` and its fraction of the peak of the model's dtype.

By path (--path DIR): the folder loaded with `load_model(DIR)` and the model by its short name (--model), each
one's dtype and forward path (`utils.lean.forward_path`), and the per-token time of plain greedy decoding
(--max-new-tokens tokens, no end token) of one HumanEval prompt, the two interleaved: a bfloat16 checkpoint loaded
by path should get the dtype and the time that its short name gets. Writes first_token.json and first_token.md
to --out, and prints the tables.
"""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from benchmarks import cli
from benchmarks.exactness import Classifier, counts, describe, transformers_greedy
from benchmarks.prompts import encode, load_humaneval
from sampling import autoregressive_generate
from utils.lean import forward_path, lean_decoder
from utils.loading import end_token_ids, load_model
from utils.machine import machine
from utils.runners.model_info import input_device

LENGTHS = (512, 2048, 4096, 8192)  # prompt tokens
GEMM_SIZE = 4096  # the peak's GEMM: GEMM_SIZE rows times a GEMM_SIZE x GEMM_SIZE matrix
GEMM_RUNS = 3  # the peak is the best of these
FLOPS_FORMULA = ("2 * P * T + 2 * V * H + 2 * L * A * T^2, where P: parameters in the decoder's linears (not the "
                 "head: both generates compute logits at the last position only), T: prompt tokens, V * H: the "
                 "head, L: layers, A: heads * head dim; the last term is attention's two products (4 * L * A * T^2) "
                 "halved by the causal mask; sliding windows not counted: roughly")
METHODS = ("ours", "transformers")


def parse_lengths(text: str) -> list[int]:
    """"512,2048" -> [512, 2048]; a ValueError naming the value for anything but positive integers."""
    try:
        lengths = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        lengths = []
    if not lengths or min(lengths) < 1:
        raise ValueError(f"--lengths must be positive integers separated by commas, got {text!r}")
    return lengths


def context_of(model) -> int | None:
    """The positions the model's config allows, None where it does not say."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return getattr(config, "max_position_embeddings", None)


def capped(lengths: list[int], context: int | None) -> list[int]:
    """Each length capped at `context` less one (the first token's position), duplicates dropped, order kept."""
    limit = float("inf") if context is None else context - 1
    return list(dict.fromkeys(int(min(length, limit)) for length in lengths))


def humaneval_prompt(tokenizer, length: int) -> list[int]:
    """Exactly `length` token ids: HumanEval's development prompts concatenated (repeated where they are too few)
    and tokenized, cut to `length`."""
    texts = "\n\n".join(text for _, text in load_humaneval(10**6))
    text = texts
    while len(ids := tokenizer(text)["input_ids"]) < length:
        text = f"{text}\n\n{texts}"
    return ids[:length]


def timed(run: Callable[[], list[int]], device: torch.device) -> tuple[float, list[int]]:
    """(seconds, output) of one call, the device's queue drained before the clock stops."""
    start = time.perf_counter()
    output = run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start, output


def rotated(names: tuple[str, ...], repeat: int) -> tuple[str, ...]:
    """`names` rotated by `repeat`: each method goes first in turn (a burst of load lands on one method's run)."""
    shift = repeat % len(names)
    return names[shift:] + names[:shift]


def spread(seconds: list[float]) -> dict:
    return {"median_s": statistics.median(seconds), "min_s": min(seconds), "max_s": max(seconds)}


@torch.no_grad()
def matrix_peak(dtype: torch.dtype, device: torch.device, size: int = GEMM_SIZE, runs: int = GEMM_RUNS) -> float:
    """FLOP/s of the best of `runs` GEMMs of `size` rows by a `size` x `size` matrix, in `dtype` on `device`."""
    a = torch.randn(size, size, device=device).to(dtype)
    b = torch.randn(size, size, device=device).to(dtype)
    a @ b  # warm-up: the library's first call picks its kernel
    best = min(timed(lambda: a @ b, device)[0] for _ in range(runs))
    return 2 * size**3 / best


def prompt_flops(model, tokens: int) -> float:
    """The prompt pass's arithmetic by `FLOPS_FORMULA`."""
    head = model.get_output_embeddings()
    linears = sum(module.weight.numel() for module in model.modules()
                  if isinstance(module, torch.nn.Linear) and module is not head)
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    attention_width = config.num_attention_heads * head_dim
    return (2 * linears * tokens + 2 * head.weight.numel()
            + 2 * config.num_hidden_layers * attention_width * tokens**2)


def time_first_token(ours, theirs, end: list[int], prompt: list[int], repeats: int, classifier: Classifier) -> dict:
    """Our prompt pass and transformers' (on its own copy `theirs`; `end`: its end tokens) over `prompt`, a warm-up
    each, then `repeats` rounds in a rotating order -> each one's spread of seconds, and the first tokens' differences."""
    device = input_device(ours)
    runs = {"ours": lambda: autoregressive_generate(prompt, ours, max_gen_len=1),
            "transformers": lambda: transformers_greedy(theirs, prompt, 1, end)}
    outputs = {name: run() for name, run in runs.items()}  # warm-up: buffers sized for this length
    seconds: dict[str, list[float]] = {name: [] for name in METHODS}
    differences = [classifier(prompt, outputs["transformers"], outputs["ours"])]
    for repeat in range(repeats):
        for name in rotated(METHODS, repeat):
            elapsed, outputs[name] = timed(runs[name], device)
            seconds[name].append(elapsed)
        differences.append(classifier(prompt, outputs["transformers"], outputs["ours"]))
    return {"seconds": {name: spread(values) for name, values in seconds.items()},
            "first_tokens": {"ours": outputs["ours"][:1], "transformers": outputs["transformers"][:1]},
            "outputs": counts(differences), "difference": next((d.as_dict() for d in differences if d), None)}


def first_token_report(args) -> dict:
    """The peaks and every length's prompt pass, ours against transformers' on its own copy of the model."""
    ours, tokenizer = load_model(args.model, dtype=args.dtype, device=args.device)
    theirs, _ = load_model(args.model, dtype=args.dtype, device=args.device)  # transformers' own copy
    dtype, device = next(ours.parameters()).dtype, input_device(ours)
    peaks = {str(d).removeprefix("torch."): matrix_peak(d, device, args.gemm_size)
             for d in dict.fromkeys((torch.bfloat16, torch.float32, dtype))}
    peak = peaks[str(dtype).removeprefix("torch.")]
    classifier, end = Classifier(theirs), end_token_ids(theirs, tokenizer)  # the reference's logits: transformers'
    rows = []
    for length in capped(args.lengths, context_of(ours)):
        timing = time_first_token(ours, theirs, end, humaneval_prompt(tokenizer, length), args.repeats, classifier)
        flops = prompt_flops(theirs, length)
        medians = {name: timing["seconds"][name]["median_s"] for name in METHODS}
        rows.append({"tokens": length, **timing, "flops": flops,
                     "flop_per_s": {name: flops / seconds for name, seconds in medians.items()},
                     "of_peak": {name: flops / seconds / peak for name, seconds in medians.items()},
                     "ours_speedup": medians["transformers"] / medians["ours"]})
    lean = lean_decoder(ours)
    return {"model": args.model or "SmolLM2-135M-Instruct", "dtype": str(dtype), "forward_path": forward_path(ours),
            "prompt_attention": lean.prompt_attention() if lean is not None else "transformers' own",
            "context": context_of(ours), "peak_flop_per_s": peaks, "flops_formula": FLOPS_FORMULA, "lengths": rows}


def by_path_report(args) -> dict:
    """The folder `args.path` loaded by path and the model by its short name: dtype, forward path, and per-token
    seconds of plain greedy decoding, the two interleaved in a rotating order."""
    models = {"path": load_model(args.path, dtype=args.dtype, device=args.device),
              "name": load_model(args.model, dtype=args.dtype, device=args.device)}
    text = load_humaneval(1)[0][1]
    prompts = {label: encode(tokenizer, text) for label, (_, tokenizer) in models.items()}
    runs = {label: (lambda model=model, label=label:
                    autoregressive_generate(prompts[label], model, max_gen_len=args.max_new_tokens, end_tokens_id=None))
            for label, (model, _) in models.items()}
    outputs = {label: run() for label, run in runs.items()}  # warm-up (and any calibration)
    per_token: dict[str, list[float]] = {label: [] for label in models}
    for repeat in range(args.repeats):
        for label in rotated(tuple(models), repeat):
            elapsed, outputs[label] = timed(runs[label], input_device(models[label][0]))
            per_token[label].append(elapsed / max(len(outputs[label]), 1))
    report = {label: {"loaded_as": str(args.path) if label == "path" else args.model or "SmolLM2-135M-Instruct",
                      "dtype": str(next(model.parameters()).dtype), "forward_path": forward_path(model),
                      "per_token": spread(per_token[label])}
              for label, (model, _) in models.items()}
    medians = {label: statistics.median(values) for label, values in per_token.items()}
    return {**report, "path_over_name": medians["path"] / medians["name"], "tokens": args.max_new_tokens,
            "same_tokens": outputs["path"] == outputs["name"]}


def markdown(result: dict) -> str:
    """The report's tables in markdown."""
    first = result["first_token"]
    peaks = ", ".join(f"{dtype} {value / 1e9:.1f} GFLOP/s" for dtype, value in first["peak_flop_per_s"].items())
    lines = [f"# Time to the first token: {first['model']} ({first['dtype']}), {result['date']}", "",
             f"Machine: {result['machine']['cpu']}, {result['machine']['threads']} threads, torch "
             f"{result['machine']['torch']}, transformers {result['machine']['transformers']}. "
             f"Forward path: {first['forward_path']}; a prompt's attention: {first['prompt_attention']}.", "",
             f"Matrix peak (GEMM {result['gemm_size']}^3, best of {GEMM_RUNS}): {peaks}.",
             f"A prompt pass's FLOPs: {first['flops_formula']}.", "",
             "| tokens | ours s (min-max) | transformers s (min-max) | ours / transformers' speed | ours GFLOP/s, "
             "of peak | transformers GFLOP/s, of peak | first tokens |", "|---|---|---|---|---|---|---|"]
    for row in first["lengths"]:
        cells = [f"{s['median_s']:.3f} ({s['min_s']:.3f}-{s['max_s']:.3f})" for s in row["seconds"].values()]
        rates = [f"{row['flop_per_s'][m] / 1e9:.1f}, {row['of_peak'][m]:.0%}" for m in METHODS]
        lines.append(f"| {row['tokens']} | {' | '.join(cells)} | {row['ours_speedup']:.2f}x | {' | '.join(rates)} "
                     f"| {describe(row['outputs'])} |")
    path = result["by_path"]
    if path is not None:
        lines += ["", f"## By path against by name ({path['tokens']} greedy tokens, per-token ms)", "",
                  "| loaded as | dtype | forward path | per token ms (min-max) |", "|---|---|---|---|"]
        for label in ("path", "name"):
            one, s = path[label], path[label]["per_token"]
            lines.append(f"| {one['loaded_as']} | {one['dtype']} | {one['forward_path']} | {1000 * s['median_s']:.2f} "
                         f"({1000 * s['min_s']:.2f}-{1000 * s['max_s']:.2f}) |")
        lines += ["", f"By path / by name, per-token time: {path['path_over_name']:.2f}; "
                      f"the same tokens: {path['same_tokens']}."]
    return "\n".join(lines) + "\n"


def print_tables(console: Console, result: dict) -> None:
    first = result["first_token"]
    table = Table("tokens", "ours s [min-max]", "transformers s [min-max]", "ours / transformers'",
                  "ours of peak", "transformers of peak", "first tokens",
                  title=f"time to the first token: {first['model']} ({first['dtype']}) on {result['machine']['cpu']}")
    for row in first["lengths"]:
        table.add_row(str(row["tokens"]), *(f"{s['median_s']:.3f} [{s['min_s']:.3f}-{s['max_s']:.3f}]"
                                            for s in row["seconds"].values()),
                      f"{row['ours_speedup']:.2f}x", *(f"{row['of_peak'][m]:.0%}" for m in METHODS),
                      describe(row["outputs"]))
    console.print(table)
    console.print("matrix peak: " + ", ".join(f"{d} {v / 1e9:.1f} GFLOP/s" for d, v in first["peak_flop_per_s"].items())
                  + f"; forward path: {first['forward_path']}; a prompt's attention: {first['prompt_attention']}")
    path = result["by_path"]
    if path is not None:
        table = Table("loaded as", "dtype", "forward path", "per token ms [min-max]", title="by path against by name")
        for label in ("path", "name"):
            s = path[label]["per_token"]
            table.add_row(path[label]["loaded_as"], path[label]["dtype"], path[label]["forward_path"],
                          f"{1000 * s['median_s']:.2f} [{1000 * s['min_s']:.2f}-{1000 * s['max_s']:.2f}]")
        console.print(table)
        console.print(f"by path / by name, per-token time: {path['path_over_name']:.2f}; the same tokens: "
                      f"{path['same_tokens']}")


def main(argv: list[str] | None = None) -> dict:
    parser = cli.benchmark_parser(__doc__)
    cli.add_models(parser)
    parser.add_argument("--lengths", default=",".join(map(str, LENGTHS)),
                        help="prompt lengths in tokens, each capped at the model's context (default: %(default)s)")
    parser.add_argument("--path", type=Path, default=None,
                        help="a checkpoint folder, loaded by path and compared with --model loaded by its name")
    parser.add_argument("--gemm-size", type=int, default=GEMM_SIZE, help="the peak GEMM's size (default: %(default)s)")
    cli.add_run(parser, max_new_tokens=32, repeats=3, out=Path("bench_results/first_token"))
    args = cli.parse(parser, argv)
    try:
        args.lengths = parse_lengths(args.lengths)
    except ValueError as error:
        parser.error(str(error))
    if args.gemm_size < 1:
        parser.error(f"--gemm-size must be >= 1, got {args.gemm_size}")
    if args.path is not None and not args.path.is_dir():
        parser.error(f"--path {args.path} is not a folder")
    result = {"machine": machine(), "date": time.strftime("%Y-%m-%d"), "repeats": args.repeats,
              "gemm_size": args.gemm_size, "first_token": first_token_report(args),
              "by_path": None if args.path is None else by_path_report(args)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "first_token.json").write_text(json.dumps(result, indent=1, default=str))
    (args.out / "first_token.md").write_text(markdown(result))
    console = Console()
    print_tables(console, result)
    console.print(f"written to {args.out}/ (first_token.json, first_token.md)")
    return result


if __name__ == "__main__":
    main()
