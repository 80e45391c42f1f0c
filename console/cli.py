"""`python infer.py`'s options and start-up: load the models, measure their passes, run the console."""

from __future__ import annotations

import argparse
import signal

from rich.console import Console
from rich.text import Text

from console.app import ChatConsole
from console.models import STAND_IN, check_pair, drafter_hint, load, measure_pass_costs, stand_in
from console.terminal import own_ctrl_c

USAGE = """\
Interactive console: chat with a model and compare decoding methods side by side.

    python infer.py                      # the built-in SmolLM2-135M-Instruct, offline, n-gram drafter
    python infer.py --target qwen2.5-coder-1.5b-instruct --drafter qwen2.5-coder-0.5b-instruct
                                         # a real pair, offline once `make models` installed it (make chat-coder)
    python infer.py --target NAME --drafter NAME   # short names, Hub names or local folders

Type /help for the commands.
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=USAGE, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=None,
                        help="short name (e.g. qwen2.5-coder-1.5b-instruct), Hub name or local folder "
                             "(default: built-in SmolLM2-135M)")
    parser.add_argument("--drafter", default=None,
                        help="a smaller model sharing the target's tokenizer (speculative decoding), "
                             "e.g. qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1, mps ...")
    parser.add_argument("--device-map", default=None,
                        help="accelerate placement, e.g. auto (splits over GPUs, offloads what does not fit)")
    parser.add_argument("--dtype", default=None,
                        help="float32, bfloat16, float16 or auto (default: float32; for the offline real models "
                             "whichever of float32 and bfloat16 runs faster here)")
    quant = parser.add_mutually_exclusive_group()
    quant.add_argument("--load-in-8bit", action="store_true", help="8-bit weights (bitsandbytes)")
    quant.add_argument("--load-in-4bit", action="store_true", help="4-bit weights (bitsandbytes)")
    parser.add_argument("--trust-remote-code", action="store_true", help="run model code from the Hub (off)")
    parser.add_argument("--system", default=None, help="system prompt for chat mode")
    parser.add_argument("--seed", type=int, default=None, help="sampling seed")
    return parser.parse_args(argv)


def one_line(message: str) -> Text:
    return Text(" ".join(message.split()), style="red")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    console = Console(highlight=False)
    options = dict(dtype=args.dtype, device=args.device, device_map=args.device_map, load_in_8bit=args.load_in_8bit,
                   load_in_4bit=args.load_in_4bit, trust_remote_code=args.trust_remote_code)
    try:
        target = load(args.target, options, console, "target")
        if args.drafter == STAND_IN:
            drafter = stand_in(target)
        else:
            drafter = load(args.drafter, options, console, "drafter") if args.drafter else None
    except Exception as error:  # a wrong name or path: one clear line, no traceback
        console.print(one_line(f"could not load the model: {type(error).__name__}: {error}"), soft_wrap=True)
        return 1
    if drafter is not None:
        try:
            check_pair(target, drafter)
        except ValueError as error:
            console.print(one_line(str(error)), soft_wrap=True)
            return 1
    app = ChatConsole(target, drafter, console, args.system, options)
    app.settings.seed = args.seed
    measure_pass_costs(console, [model for model in (target, drafter) if model is not None])
    if drafter is None:
        console.print(f"No drafter model: /speculative is off; {drafter_hint(target)}", markup=False, highlight=False,
                      soft_wrap=True)
    # Ctrl-C stops a generation even when the console was started with SIGINT ignored (a shell
    # script's background job inherits that, and Python then never raises KeyboardInterrupt).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    own_ctrl_c()  # under `make chat`: Ctrl-C reaches the console only, and make ends with its status
    app.run()
    return 0
