"""Every pass against the memory bound: the target, its drafter and its four-bit self-drafter, then plain decoding
against transformers' eager `generate`.

    python -m benchmarks.passes --target qwen2.5-coder-1.5b-instruct --drafter qwen2.5-coder-0.5b-instruct

For each model: the bytes a one-token pass reads (its weights, the input embedding's other rows left out, and the
keys and values of the cached tokens), the read bandwidth of a memory-bound `sum` measured in the same process, so
the bound; then per pass width (1, 4, 8, 16 new tokens after --context cached ones (256 by default), the runner
generation gives the model, the kernels its calibration chose) the median time, its fraction of the bound (bound /
time: 1.0 is at the bound) and the share of the pass spent in GEMMs (torch's profiler: linear, mm, addmm and the
8/4-bit kernels, the layers run in Python for it, against the pass's median time); and the time to read the same
weights in the pass's own pieces and order with no arithmetic (`read_pieces`), against the bound, and the one-token
pass against it: how far the pieces alone keep a pass from the bound. Every model's passes and the `sum` are
interleaved round by round (a shared VM's bandwidth moves within a minute): each pass against its round's bound,
each one-token pass against the target's of the same round. Then plain greedy decoding of even HumanEval prompts,
ours and transformers' eager `generate` interleaved, medians of tokens/s, every output checked against transformers'
(near-ties told from defects, `benchmarks/exactness.py`).

`--emulate-avx2` holds this process to an AVX2-only CPU's code (torch's kernels, MKL, oneDNN and our own kernel
built for AVX2, no bfloat16 arithmetic), to measure the float32 paths on a machine that has more: its memory is
still this machine's, so the figures say what the code does, not what a Zen 3 measures.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from benchmarks import cli
from benchmarks.exactness import Classifier, counts, describe, transformers_greedy
from benchmarks.prompts import encode, load_humaneval
from sampling import autoregressive_generate, quantized_drafter
from utils.calibration import pass_costs
from utils.lean import forward_path, huge_pages, layer_ops, lean_decoder, native
from utils.loading import end_token_ids, load_model
from utils.machine import machine
from utils.runners.model_info import pass_bytes, weight_pieces
from utils.runners.static import StaticSequence

CONTEXT = 256  # tokens cached while a pass is timed (--context)
WIDTHS = (1, 4, 8, 16)
AVX2_ONLY = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
GEMMS = ("specdec::gemm", "aten::addmv_", "aten::mv", "aten::linear", "aten::mm", "aten::addmm",
         "aten::_weight_int4pack_mm_for_cpu", "aten::_weight_int8pack_mm")


def emulate_avx2(argv: list[str]) -> None:
    """Run again with torch held to AVX2 (its kernels are chosen at import), then build our kernel for AVX2 and say
    that this CPU has no bfloat16 arithmetic (`utils.lean.native`)."""
    if any(os.environ.get(name) != value for name, value in AVX2_ONLY.items()):
        os.execve(sys.executable, [sys.executable, "-m", "benchmarks.passes", *argv], os.environ | AVX2_ONLY)
    from utils.lean.build import MARCH_ENV

    os.environ[MARCH_ENV] = "haswell"  # our kernels built for an AVX2-only CPU (`utils/lean/build.py`)
    native._library.cache_clear()  # built for this CPU already, were they asked for before
    native.bfloat16_arithmetic = lambda: False


def profiled(kernel, name: str = "specdec::gemm"):
    """Our kernel under a name torch's profiler sees (its time is in a ctypes call torch does not know)."""
    def run(*args, **kwargs):
        with torch.profiler.record_function(name):
            return kernel(*args, **kwargs)
    return run


def read_bandwidth(gigabytes: float = 2.0, repeats: int = 5) -> float:
    """Bytes per second a memory-bound `sum` reads here (the best of `repeats`), over memory of the weights' kind
    (huge pages where the lean forward puts them: `utils/lean/huge_pages.py`)."""
    data = huge_pages.advised_empty((int(gigabytes * 2**30 // 4),), torch.float32).fill_(1.0)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return data.numel() * 4 / best


def read_pieces(pieces: list[torch.Tensor]) -> float:
    """Seconds to read `pieces` (`weight_pieces`: a pass's weights, in its order) once each with no arithmetic but
    a maximum (torch's int32 `max`: it reads faster than `sum` on the Xeon of docs/results.md, thirteenth round):
    what a pass's weights can be read at in their own pieces, many of them a few megabytes."""
    start = time.perf_counter()
    for piece in pieces:
        whole = piece.numel() % 4 == 0 and piece.data_ptr() % 4 == 0
        (piece.view(torch.int32) if whole else piece).max()
    return time.perf_counter() - start


def _pass(runner: StaticSequence, costs, width: int, context: int) -> float:
    start = time.perf_counter()
    runner.forward(list(range(10, 10 + width)), num_logits=1, shortcuts=costs.shortcuts_for(width - 1))
    seconds = time.perf_counter() - start
    runner.rollback(context)
    return seconds


def gemm_seconds(runner: StaticSequence, costs, width: int, context: int) -> float:
    """Seconds one pass spends in GEMM kernels (torch's profiler, self times). The layers run in Python for it
    (`decoder.py`'s one call hides its GEMMs from the profiler): their GEMMs are the same calls."""
    lean = lean_decoder(runner.model)
    stack = None if lean is None else lean.stack
    try:
        if stack is not None:
            lean.stack = None
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
            _pass(runner, costs, width, context)
    finally:
        if stack is not None:
            lean.stack = stack
    events = profile.key_averages()
    return sum(event.self_cpu_time_total for event in events if event.key in GEMMS or "gemm" in event.key.lower()) / 1e6


def pass_reports(models: dict, repeats: int, context: int = CONTEXT) -> tuple[list[dict], list[float]]:
    """The bound and every width's pass of each model in `models` (label -> model), their passes interleaved round by
    round with a `sum`'s read (a shared machine's bandwidth moves within a minute: measured apart, a pass and its
    bound, or two models, drift apart): each pass against the bound of its round's bandwidth, each model's one-token
    pass against the first model's (the target's) of the same round -> (reports, each round's bandwidth)."""
    runners = {}
    for label, model in models.items():
        runner = StaticSequence(model, slots=context + max(WIDTHS) + 64, costs=None)
        runner.forward([3 + i % (model.config.vocab_size - 3) for i in range(context)])  # ids past the special ones
        runners[label] = (pass_costs(model), runner)
    times = {label: {width: [] for width in WIDTHS} for label in models}
    pieces = {label: weight_pieces(model) for label, model in models.items()}
    ceilings: dict[str, list[float]] = {label: [] for label in models}
    bandwidths = []
    for round_ in range(repeats + 1):  # the first round warms up
        if round_:
            bandwidths.append(read_bandwidth(repeats=3))
        for label, (costs, runner) in runners.items():
            ceiling = read_pieces(pieces[label])
            for width in WIDTHS:
                seconds = _pass(runner, costs, width, context)
                if round_:
                    times[label][width].append(seconds)
            if round_:
                ceilings[label].append(ceiling)
    first = next(iter(models))
    reports = []
    for label, model in models.items():
        costs, runner = runners[label]
        weights, cached = pass_bytes(model), runner.cache_bytes(context)
        bytes_read = weights + cached
        one = statistics.median(times[label][1])
        of_target = statistics.median(mine / theirs for mine, theirs in zip(times[label][1], times[first][1], strict=True))
        reports.append({
            "model": label, "path": forward_path(model), "weight_gb": weights / 1e9, "cache_gb": cached / 1e9,
            "bound_ms": 1000 * bytes_read / statistics.median(bandwidths), "of_target": of_target,
            # the weights read in their pieces with no arithmetic: against the bound, and the one-token pass against it
            "ceiling_ms": 1000 * statistics.median(ceilings[label]),
            "ceiling_of_bound": statistics.median(weights / bandwidth / seconds
                                                  for bandwidth, seconds in zip(bandwidths, ceilings[label], strict=True)),
            "of_ceiling": statistics.median(ceiling / seconds
                                            for ceiling, seconds in zip(ceilings[label], times[label][1], strict=True)),
            "widths": {width: {"ms": 1000 * statistics.median(values),
                               "of_bound": statistics.median(bytes_read / bandwidth / seconds
                                                             for bandwidth, seconds in zip(bandwidths, values, strict=True)),
                               "relative": statistics.median(values) / one,
                               "gemm_share": gemm_seconds(runner, costs, width, context) / statistics.median(values)}
                       for width, values in times[label].items()}})
    return reports, bandwidths


def plain_decoding(model, tokenizer, prompts: list[list[int]], tokens: int, repeats: int) -> dict:
    """Ours and transformers' eager greedy decoding, interleaved prompt by prompt -> tokens/s medians, ratio."""
    eos = end_token_ids(model, tokenizer)
    rates: dict[str, list[float]] = {"ours": [], "hf_eager": []}
    classifier, differences = Classifier(model), []
    for _ in range(repeats):
        for prompt in prompts:
            start = time.perf_counter()
            ours = autoregressive_generate(prompt, model, max_gen_len=tokens, end_tokens_id=eos)
            rates["ours"].append(len(ours) / (time.perf_counter() - start))
            start = time.perf_counter()
            theirs = transformers_greedy(model, prompt, tokens, eos)
            rates["hf_eager"].append(len(theirs) / (time.perf_counter() - start))
            differences.append(classifier(prompt, theirs, ours))
    medians = {name: statistics.median(values) for name, values in rates.items()}
    return {"tokens_per_s": medians, "ratio": medians["ours"] / medians["hf_eager"],
            "spread": {name: (max(v) - min(v)) / statistics.median(v) for name, v in rates.items()},
            "outputs": describe(counts(differences))}


def main(argv: list[str] | None = None) -> None:
    parser = cli.benchmark_parser(__doc__)
    cli.add_models(parser, drafter="a drafter model whose passes are measured too", quantize=True)
    parser.add_argument("--no-self-drafter", action="store_true", help="leave out the four-bit self-drafter (left out with --quantize)")
    parser.add_argument("--prompts", type=int, default=3, help="HumanEval development prompts decoded (even ids; 0: the passes only)")
    cli.add_run(parser, max_new_tokens=64, repeats=3, out=Path("benchmarks/results/passes"))
    parser.add_argument("--emulate-avx2", action="store_true", help="hold this process to an AVX2-only CPU's code")
    parser.add_argument("--context", type=int, default=CONTEXT, help="tokens cached while a pass is timed")
    args = cli.parse(parser, argv)
    if args.context < 1:
        parser.error(f"--context must be >= 1, got {args.context}")
    if args.prompts < 0:
        parser.error(f"--prompts must be >= 0 (0: the passes only), got {args.prompts}")
    if args.emulate_avx2:
        emulate_avx2(sys.argv[1:] if argv is None else argv)
    native.gemm, native.gemm_q4 = profiled(native.gemm), profiled(native.gemm_q4)
    for op in ("rms_norm", "add_rms_norm", "rope_write", "attention"):  # in the pass's total, not in the GEMMs'
        setattr(layer_ops, op, profiled(getattr(layer_ops, op), "specdec::layer"))
    console = Console(stderr=True)
    target, tokenizer = load_model(args.model, dtype=args.dtype, device=args.device, quantize=args.quantize)
    models = {"target": target}
    if args.drafter:
        models["drafter"] = load_model(args.drafter, dtype=args.dtype, device=args.device,
                                       quantize=args.drafter_quantize)[0]
    if not args.no_self_drafter and not args.quantize:  # a quantized target has no float weights to draft from
        models["self-drafter (int4)"] = quantized_drafter(target, bits=4)
    passes, bandwidths = pass_reports(models, args.repeats, args.context)
    bandwidth = statistics.median(bandwidths)
    prompts = [encode(tokenizer, text) for _, text in load_humaneval(args.prompts)]  # the file holds even ids only
    decoding = plain_decoding(target, tokenizer, prompts, args.max_new_tokens, args.repeats) if prompts else None
    result = {"machine": machine(), "emulated_avx2": args.emulate_avx2, "quantize": args.quantize, "context": args.context,
              "read_gb_per_s": bandwidth / 1e9, "read_gb_per_s_by_round": [b / 1e9 for b in bandwidths],
              "passes": passes, "plain_decoding": decoding}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(result, indent=1))
    table = Table(title=f"Passes after {args.context} cached tokens against the read bound (median {bandwidth / 1e9:.1f} GB/s, "
                        f"{min(bandwidths) / 1e9:.1f}-{max(bandwidths) / 1e9:.1f} over the rounds)")
    for column in ("model", "path", "bound ms", "pieces read: ms / of bound", "1 tok: of pieces' read",
                   "1 tok / target's", *(f"{w} tok: ms / of bound / gemm" for w in WIDTHS)):
        table.add_column(column)
    for report in passes:
        table.add_row(report["model"], report["path"], f"{report['bound_ms']:.1f}",
                      f"{report['ceiling_ms']:.1f} / {report['ceiling_of_bound']:.2f}", f"{report['of_ceiling']:.2f}",
                      f"{report['of_target']:.2f}",
                      *(f"{r['ms']:.1f} / {r['of_bound']:.2f} / {r['gemm_share']:.2f}" for r in report["widths"].values()))
    console.print(table)
    if decoding:
        console.print(f"plain decoding: ours {decoding['tokens_per_s']['ours']:.2f} tok/s, transformers' eager "
                      f"{decoding['tokens_per_s']['hf_eager']:.2f} (ours {decoding['ratio']:.2f}x); outputs: {decoding['outputs']}")


if __name__ == "__main__":
    main()
