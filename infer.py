"""Interactive console: chat with a model and compare decoding methods side by side.

    python infer.py                      # the built-in SmolLM2-135M-Instruct, offline, n-gram drafter
    python infer.py --target NAME --drafter NAME   # Hub names or local folders

Type /help for the commands.
"""

from __future__ import annotations

if __name__ == "__main__":  # importing torch and transformers takes seconds: show that something happens
    import threading

    def _show_start(started: threading.Event) -> None:
        print("Starting the console (loading PyTorch and transformers)", end="", flush=True)
        while not started.wait(0.5):
            print(".", end="", flush=True)
        print(flush=True)

    _started = threading.Event()
    _dots = threading.Thread(target=_show_start, args=(_started,), daemon=True)
    _dots.start()

import argparse
import signal
import sys
import time
from dataclasses import dataclass, field

import torch
from rich.console import Console
from rich.table import Table
from rich.text import Text

from ngram_assisted import MultiDynaGram, SimpleDynaGram, ngram_assisted_speculative_generate
from ngram_assisted import ngram_assisted_speculative_generate_encoder_decoder as nasd_ed
from sampling import (
    SpeculativeStats,
    Step,
    autoregressive_generate,
    autoregressive_generate_encoder_decoder,
    beam_search_generate,
    speculative_generate,
    speculative_generate_encoder_decoder,
)
from utils.caching import is_encoder_decoder
from utils.calibration import is_measured, pass_costs
from utils.loading import end_token_ids, load_model
from utils.logits_processors import (
    GreedyProcessor,
    MultinomialProcessor,
    NucleusProcessor,
    TopKNucleusProcessor,
    TopKProcessor,
    TransformersProcessor,
)

# `/processor NAME [values] [key=value ...]`: each processor's own parameters, in this order.
PROCESSORS = {
    "greedy": (GreedyProcessor, ()),
    "multinomial": (MultinomialProcessor, ("temperature",)),
    "topk": (TopKProcessor, ("temperature", "top_k")),
    "nucleus": (NucleusProcessor, ("temperature", "top_p")),
    "topknucleus": (TopKNucleusProcessor, ("temperature", "top_k", "top_p")),
}
PROCESSOR_USAGE = ("usage: /processor greedy | multinomial [temperature] | topk [temperature] [top_k] | "
                   "nucleus [temperature] [top_p] | topknucleus [temperature] [top_k] [top_p]\n"
                   "   (or name key=value ..., e.g. nucleus temperature=0.7 top_p=0.9)\n"
                   "   or: /processor key=value ... (transformers' processors) with keys ")

# `/processor key=value ...`: transformers' processors, built as `generate` builds them.
GENERATE_KEYS = ("repetition_penalty", "no_repeat_ngram_size", "min_length", "do_sample", "temperature", "top_k",
                 "top_p", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff")
SAMPLING_KEYS = {"temperature", "top_k", "top_p", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff"}


def generate_settings(args: list[str]) -> dict:
    """["repetition_penalty=1.2", "min_p=0.05"] -> {...}; sampling is on when a sampling key is given."""
    settings: dict = {}
    for arg in args:
        key, sep, value = arg.partition("=")
        if not sep or key not in GENERATE_KEYS:
            raise ValueError(f"unknown setting {arg!r}")
        if key == "do_sample":
            if value.lower() not in ("true", "false"):
                raise ValueError(f"do_sample must be true or false, got {value!r}")
            settings[key] = value.lower() == "true"
        else:
            settings[key] = _number(key, value)
    settings.setdefault("do_sample", bool(SAMPLING_KEYS & set(settings)))
    return settings


def generate_processor(settings: dict) -> TransformersProcessor:
    from transformers import GenerationConfig

    return TransformersProcessor.from_generation_config(GenerationConfig(**settings))


INTEGER_KEYS = {"top_k", "no_repeat_ngram_size", "min_length"}


def _number(key: str, value: str) -> int | float:
    """A `/processor` value: an int for `INTEGER_KEYS`, else a float; the error names the key."""
    try:
        return int(value) if key in INTEGER_KEYS else float(value)
    except ValueError:
        raise ValueError(f"{key} must be {'an integer' if key in INTEGER_KEYS else 'a number'}, got {value!r}") from None


def parse_processor(args: list[str]) -> tuple[str, dict]:
    """`/processor` arguments -> (name, parameters), checked by building the processor.

    `nucleus 0.7 0.9` (the processor's own parameters in order: `PROCESSORS`), `nucleus
    temperature=0.7 top_p=0.9`, or `repetition_penalty=1.2 min_p=0.05 ...` (transformers'
    processors: name "generate"). Unset parameters take the processor's defaults.
    """
    if not args:
        raise ValueError("name a processor")
    if "=" in args[0]:
        settings = generate_settings(args)
        generate_processor(settings)  # validates
        return "generate", settings
    name, values = args[0], args[1:]
    if name not in PROCESSORS:
        raise ValueError(f"unknown processor {name!r}")
    processor_class, names = PROCESSORS[name]
    count = next((i for i, value in enumerate(values) if "=" in value), len(values))  # values in order, then key=value
    positional = values[:count]
    if len(positional) > len(names):
        raise ValueError(f"{name} takes {', '.join(names) or 'no parameters'}, got {len(positional)} values")
    if any("=" not in value for value in values[count:]):
        raise ValueError("give values in order first, then key=value")
    parameters = {key: _number(key, value) for key, value in zip(names, positional, strict=False)}
    for item in values[len(positional) :]:
        key, _, value = item.partition("=")
        if key not in names:
            raise ValueError(f"{name} has no parameter {key!r}; it takes {', '.join(names) or 'none'}")
        parameters[key] = _number(key, value)
    processor_class(**parameters)  # validates: errors name the parameter
    return name, parameters


HELP = """\
/help                      this list            /status               current settings
/quit (or Ctrl-D)          exit                 /clear                forget the conversation
/target /speculative /drafter /ngram /beam      toggle a method (target = plain autoregressive)
/chat                      chat template on/off /debug                colour drafts: accepted, rejected, target
/cache                     KV cache on/off      /length <n>           max new tokens
/gamma <n>                 draft length         /seed <n>             sampling seed
/processor nucleus [temperature] [top_p]        also greedy, multinomial [t], topk [t] [top_k], topknucleus [t] [top_k] [top_p]
/processor key=value ...   transformers' processors, e.g. repetition_penalty=1.2 no_repeat_ngram_size=3 min_p=0.05
/top_k_filler <k>          target top-k tokens added to the n-gram pool
/set_ngram <simple|multi> <n>                   a new n-gram pool
/stop_if_unknown           n-gram drafts stop at unknown grams on/off
/branching <n|auto>        n-gram candidates per node (token trees; 1: chains; auto: where they pay)
/reset_in_between          reset the n-gram pool before each prompt on/off
Ctrl-C stops a generation."""


@dataclass
class Settings:
    methods: dict = field(default_factory=lambda: {"target": True, "speculative": True, "drafter": False,
                                                   "ngram": True, "beam": False})
    chat: bool = True
    debug: bool = False
    use_cache: bool = True
    max_gen_len: int = 128
    gamma: int = 4
    processor_spec: tuple[str, dict] = ("greedy", {})  # `parse_processor`'s (name, parameters)
    top_k_filler: int = 3
    ngram_kind: str = "multi"
    ngram_n: int = 8  # MultiDynaGram(8): the benchmarked setting
    stop_if_unknown: bool = True
    branching: int | None = None  # NASD's candidates per node; None: the cost model decides
    reset_in_between: bool = False
    seed: int | None = None

    @property
    def processor(self):
        name, parameters = self.processor_spec
        if name == "generate":
            return generate_processor(parameters)
        return PROCESSORS[name][0](**parameters)


def run_method(method: str, inputs: list[int], s: Settings, *, target, drafter, pool, end_tokens: list[int],
               on_step) -> tuple[list[int], SpeculativeStats | None]:
    """Run one of the console's methods with its settings -> (generated ids, stats or None)."""
    generator = torch.Generator().manual_seed(s.seed) if s.seed is not None else None
    common = dict(max_gen_len=s.max_gen_len, end_tokens_id=end_tokens, use_cache=s.use_cache)
    sampling = dict(logits_processor=s.processor, generator=generator, on_step=on_step)
    encoder_decoder = is_encoder_decoder(target)
    if method in ("target", "drafter"):
        fn = autoregressive_generate_encoder_decoder if encoder_decoder else autoregressive_generate
        return fn(inputs, target if method == "target" else drafter, **common, **sampling), None
    if method == "beam":
        return beam_search_generate(inputs, target, **common, num_beams=4, top_k=3), None
    stats = SpeculativeStats()
    if method == "speculative":
        fn = speculative_generate_encoder_decoder if encoder_decoder else speculative_generate
        ids, _ = fn(inputs, drafter, target, gamma=s.gamma, stats=stats, **common, **sampling)
    else:
        fn = nasd_ed if encoder_decoder else ngram_assisted_speculative_generate
        ids, _ = fn(inputs, pool, target, gamma=s.gamma, top_k_filler=s.top_k_filler, stop_if_unknown=s.stop_if_unknown,
                    branching=s.branching, stats=stats, **common, **sampling)
    return ids, stats


def render_step(step: Step, tokenizer) -> Text:
    """Debug view of one step: accepted drafts green, rejected drafts (the rest of the chain, or the
    other branches of a tree) red and struck, the target's own token blue."""
    text = Text()
    for token in step.tokens[: step.accepted]:
        text.append(tokenizer.decode([token]), style="green")
    for token in step.drafts[step.accepted :]:
        text.append(tokenizer.decode([token]), style="red strike")
    if len(step.tokens) > step.accepted:
        text.append(tokenizer.decode([step.tokens[-1]]), style="blue")
    return text


class ChatConsole:
    """The console's state and commands; `run` is the read-eval-print loop."""

    def __init__(self, target, tokenizer, drafter, console: Console, system_prompt: str | None) -> None:
        self.target, self.tokenizer, self.drafter = target, tokenizer, drafter
        self.console = console
        self.settings = Settings()
        if drafter is None:
            self.settings.methods["speculative"] = False
        self.encoder_decoder = is_encoder_decoder(target)
        self.end_tokens = end_token_ids(target, tokenizer)
        self.system_prompt = system_prompt
        self.history: list[dict] = []
        self.pool = self._new_pool()

    def _new_pool(self):
        s = self.settings
        return (MultiDynaGram if s.ngram_kind == "multi" else SimpleDynaGram)(s.ngram_n)

    # Commands ---------------------------------------------------------------------------------

    def command(self, line: str) -> bool:
        """Run one /command; False means quit."""
        name, *args = line.split()
        s = self.settings
        toggles = {"/debug": "debug", "/cache": "use_cache", "/chat": "chat", "/stop_if_unknown": "stop_if_unknown",
                   "/reset_in_between": "reset_in_between"}
        if name == "/quit":
            return False
        if name == "/help":
            self.console.print(HELP, markup=False)
        elif name == "/status":
            self.status()
        elif name in toggles:
            setattr(s, toggles[name], not getattr(s, toggles[name]))
            self.say(f"{toggles[name]}: {'on' if getattr(s, toggles[name]) else 'off'}")
        elif name[1:] in s.methods:
            method = name[1:]
            if method in ("speculative", "drafter") and self.drafter is None:
                return self.error(f"{name} needs a drafter model: start with --drafter NAME")
            if method == "beam" and self.encoder_decoder:
                return self.error("beam search supports decoder-only models")
            s.methods[method] = not s.methods[method]
            self.say(f"{method}: {'on' if s.methods[method] else 'off'}")
        elif name == "/clear":
            self.history.clear()
            self.say("conversation cleared")
        elif name in ("/length", "/gamma", "/top_k_filler", "/seed"):
            usage = f"usage: {name} <n>, n an integer >= {0 if name == '/seed' else 1}"
            if len(args) != 1 or not args[0].isdigit() or (int(args[0]) < 1 and name != "/seed"):
                return self.error(usage)
            attribute = {"/length": "max_gen_len", "/gamma": "gamma", "/top_k_filler": "top_k_filler",
                         "/seed": "seed"}[name]
            value = int(args[0])
            if name == "/top_k_filler" and value > len(self.tokenizer):
                return self.error(f"top_k_filler must be at most the vocabulary size {len(self.tokenizer)}")
            setattr(s, attribute, value)
            self.say(f"{attribute}: {value}")
        elif name == "/processor":
            self.set_processor(args)
        elif name == "/branching":
            if len(args) != 1 or not (args[0] == "auto" or (args[0].isdigit() and int(args[0]) >= 1)):
                return self.error("usage: /branching <n|auto>, n an integer >= 1 (1: chains)")
            s.branching = None if args[0] == "auto" else int(args[0])
            self.say(f"branching: {args[0]}")
        elif name == "/set_ngram":
            if len(args) != 2 or args[0] not in ("simple", "multi") or not args[1].isdigit() or int(args[1]) < 2:
                return self.error("usage: /set_ngram <simple|multi> <n>, n an integer >= 2")
            s.ngram_kind, s.ngram_n = args[0], int(args[1])
            self.pool = self._new_pool()
            self.say(f"n-gram pool: {self.pool}")
        else:
            return self.error(f"unknown command {name}; /help lists the commands")
        return True

    def set_processor(self, args: list[str]) -> None:
        try:
            self.settings.processor_spec = parse_processor(args)
        except (ValueError, TypeError) as error:
            self.error(f"{error}\n{PROCESSOR_USAGE}{', '.join(GENERATE_KEYS)}")
            return
        self.say(f"processor: {self.settings.processor}")

    def status(self) -> None:
        s = self.settings
        table = Table(show_header=False, box=None)
        rows = {
            "methods": ", ".join(m for m, on in s.methods.items() if on) or "none",
            "processor": repr(s.processor), "chat": s.chat, "cache": s.use_cache, "debug": s.debug,
            "length": s.max_gen_len, "gamma": s.gamma, "n-gram pool": repr(self.pool),
            "top_k_filler": s.top_k_filler, "stop_if_unknown": s.stop_if_unknown,
            "branching": "auto" if s.branching is None else s.branching,
            "reset_in_between": s.reset_in_between, "seed": s.seed, "turns in history": len(self.history) // 2,
        }
        for key, value in rows.items():
            table.add_row(key, str(value))
        self.console.print(table)

    def say(self, message: str) -> None:
        self.console.print(message, markup=False, highlight=False)

    def error(self, message: str) -> bool:
        self.console.print(Text(message, style="red"))
        return True

    # Generation ------------------------------------------------------------------------------

    def encode(self, user_text: str) -> list[int]:
        if self.settings.chat and getattr(self.tokenizer, "chat_template", None):
            messages = ([{"role": "system", "content": self.system_prompt}] if self.system_prompt else [])
            messages += self.history + [{"role": "user", "content": user_text}]
            ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
            return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        return self.tokenizer(user_text)["input_ids"]

    def generate(self, method: str, inputs: list[int], on_step) -> tuple[list[int], SpeculativeStats | None]:
        if method == "ngram" and self.settings.reset_in_between:
            self.pool.reset()
        return run_method(method, inputs, self.settings, target=self.target, drafter=self.drafter, pool=self.pool,
                          end_tokens=self.end_tokens, on_step=on_step)

    def streamer(self, method: str):
        """An on_step callback that prints the new text (coloured by origin in debug mode)."""
        generated: list[int] = []
        printed = [""]

        def on_step(step: Step) -> None:
            if self.settings.debug and method in ("speculative", "ngram"):
                self.console.print(render_step(step, self.tokenizer), end="")
                return
            generated.extend(step.tokens)
            text = self.tokenizer.decode(generated, skip_special_tokens=True)
            self.console.print(text[len(printed[0]) :], end="", markup=False, highlight=False)
            printed[0] = text

        return on_step

    def answer(self, user_text: str) -> None:
        inputs = self.encode(user_text)
        methods = [m for m, on in self.settings.methods.items() if on]
        if not methods:
            self.error("every method is off: turn one on, e.g. /target")
            return
        results = []
        for method in methods:
            self.console.print(Text(f"[{method}] ", style="bold cyan"), end="")
            start = time.perf_counter()
            ids, stats = self.generate(method, inputs, None if method == "beam" else self.streamer(method))
            elapsed = time.perf_counter() - start
            if method == "beam":
                self.say(self.tokenizer.decode(ids, skip_special_tokens=True))
            else:
                self.console.print()
            results.append((method, ids, elapsed, stats))
        self.report(results)
        first = results[0][1]
        if self.settings.chat:
            self.history += [{"role": "user", "content": user_text},
                             {"role": "assistant", "content": self.tokenizer.decode(first, skip_special_tokens=True)}]

    def report(self, results) -> None:
        """Speed of each method against the target's plain decoding, then which methods produced
        the target's very tokens: all of them when greedy, NASD too under a seed (coupled sampling)."""
        target = next((r for r in results if r[0] == "target"), None)
        baseline = target[2] / max(len(target[1]), 1) if target else None
        table = Table("method", "tokens", "time (s)", "tokens/s", "alpha", "tau", "speedup vs target")
        for method, ids, elapsed, stats in results:
            per_token = elapsed / max(len(ids), 1)
            table.add_row(
                method, str(len(ids)), f"{elapsed:.2f}", f"{len(ids) / elapsed:.1f}",
                f"{stats.alpha:.2f}" if stats else "-", f"{stats.tau:.2f}" if stats else "-",
                f"{baseline / per_token:.2f}x" if baseline and method != "target" else "-",
            )
        self.console.print(table)
        if target is not None and (self.settings.processor.is_greedy or self.settings.seed is not None):
            verdicts = [f"{method} {'yes' if ids == target[1] else 'no'}" for method, ids, _, _ in results
                        if method not in ("target", "beam")]
            if verdicts:
                self.say("same tokens as target: " + ", ".join(verdicts))

    def run(self) -> None:
        self.say("Type a prompt, or /help for the commands.")
        while True:
            try:
                line = self.console.input("[bold]> [/bold]").strip()
            except EOFError:
                break
            except KeyboardInterrupt:
                self.console.print()
                continue
            if not line:
                continue
            if line.startswith("/"):
                if not self.command(line):
                    break
                continue
            try:
                self.answer(line)
            except KeyboardInterrupt:
                self.console.print(Text("\n[generation stopped]", style="yellow"))
            except (ValueError, TypeError) as error:  # bad input, explained by the library
                self.error(str(error))
            except Exception as error:  # nothing crashes the console
                self.error(f"generation failed: {type(error).__name__}: {error}")
        self.say("bye")


def measure_pass_costs(console: Console, models: list) -> None:
    """The first run on a machine measures what a forward pass costs (`utils.calibration`): say so
    and show its progress (stderr) now, rather than stall silently on the first prompt."""
    for model in models:
        if not is_measured(model):
            console.print(Text("First run with this model here: measuring what a forward pass costs on this machine, "
                               "once (cached; about 10-30 s for a 135M model).", style="yellow"))
            pass_costs(model)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default=None, help="Hub name or local folder (default: built-in SmolLM2-135M)")
    parser.add_argument("--drafter", default=None, help="a smaller model sharing the tokenizer (speculative decoding)")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1, mps ...")
    parser.add_argument("--device-map", default=None,
                        help="accelerate placement, e.g. auto (splits over GPUs, offloads what does not fit)")
    parser.add_argument("--dtype", default="float32", help="float32, bfloat16, float16 or auto")
    quant = parser.add_mutually_exclusive_group()
    quant.add_argument("--load-in-8bit", action="store_true", help="8-bit weights (bitsandbytes)")
    quant.add_argument("--load-in-4bit", action="store_true", help="4-bit weights (bitsandbytes)")
    parser.add_argument("--trust-remote-code", action="store_true", help="run model code from the Hub (off)")
    parser.add_argument("--system", default=None, help="system prompt for chat mode")
    parser.add_argument("--seed", type=int, default=None, help="sampling seed")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    if "_dots" in globals():  # run as a script: the imports are done, end the start-up dots
        _started.set()
        _dots.join()
    args = parse_args(argv)
    console = Console(highlight=False)
    options = dict(dtype=args.dtype, device=args.device, device_map=args.device_map, load_in_8bit=args.load_in_8bit,
                   load_in_4bit=args.load_in_4bit, trust_remote_code=args.trust_remote_code)
    try:
        with console.status(f"Loading {args.target or 'the built-in SmolLM2-135M-Instruct'}..."):
            target, tokenizer = load_model(args.target, **options)
        drafter = None
        if args.drafter:
            with console.status(f"Loading drafter {args.drafter}..."):
                drafter, _ = load_model(args.drafter, **options)
    except Exception as error:  # a wrong name or path: one clear line, no traceback
        console.print(Text(f"could not load the model: {type(error).__name__}: {error}".splitlines()[0], style="red"))
        return 1
    app = ChatConsole(target, tokenizer, drafter, console, args.system)
    app.settings.seed = args.seed
    measure_pass_costs(console, [model for model in (target, drafter) if model is not None])
    # Ctrl-C stops a generation even when the console was started with SIGINT ignored (a shell
    # script's background job inherits that, and Python then never raises KeyboardInterrupt).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    app.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
