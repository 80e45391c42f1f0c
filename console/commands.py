"""The console's /commands: one small handler each, registered with its usage and help line.

A handler takes the console and the command's arguments and returns what to print (or None); a
bad argument raises a one-line ValueError, which the console prints in red. `/help` is built from
this registry, so that the list and the commands cannot disagree.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rich.text import Text

from console.models import (
    PAIR_COMMAND,
    STAND_IN,
    STAND_IN_WHAT,
    check_pair,
    drafter_hint,
    load,
    measure_pass_costs,
    own_drafter,
    stand_in,
)
from console.render import legend, status_table
from console.settings import METHODS, parse_count, parse_processor, parse_seed, parse_switch
from utils.cost_model import DRAFT_SIZES
from utils.runners.model_info import context_length

# The console a handler works on (`console.app.ChatConsole`, which imports this module: named here
# without an import, so that the two modules form no circle).
ChatConsole = Any

QUIT = object()  # a handler's answer that ends the console
# Bounds of the console's counts, against typos (`/gamma 1000`); the library takes any positive value.
MAX_BRANCHING = 8  # n-gram candidates per node (the default trees use up to 3 where they pay: docs/nasd.md)
MAX_NGRAM = 32  # the n of a new pool


@dataclass(frozen=True)
class Command:
    usage: str
    help: str
    run: Callable[[ChatConsole, list[str]], object]


COMMANDS: dict[str, Command] = {}  # name -> its command
LISTED: list[Command] = []  # what /help lists, in order (a command may have two usage lines)


def command(usage: str, help: str):
    """Register a handler under the first word of `usage`; a second usage of the same name only adds a help line."""
    def register(run):
        entry = Command(usage, help, run)
        COMMANDS.setdefault(usage.split()[0], entry)
        LISTED.append(entry)
        return run
    return register


def dispatch(app: ChatConsole, line: str) -> object:
    """Run one /command line -> what to print, None, or QUIT; raises ValueError for bad input."""
    name, *args = line.split()
    entry = COMMANDS.get(name)
    if entry is None:
        raise ValueError(f"unknown command {name}; /help lists the commands")
    return entry.run(app, args)


def help_text(app: ChatConsole) -> str:
    lines = [f"{entry.usage:<36} {entry.help}" for entry in LISTED]
    lines.append("Ctrl-C stops a generation. A toggle takes on or off, or flips without one.")
    drafter = "loaded: " + app.drafter.label if app.drafter else drafter_hint(app.target)
    lines.append(f"A drafter model: make models installs Qwen2.5-Coder-1.5B and its 0.5B drafter (offline), "
                 f"{PAIR_COMMAND} starts the console on them. Here: {drafter}.")
    return "\n".join(lines)


def _no_arguments(name: str, args: list[str]) -> None:
    if args:
        raise ValueError(f"/{name} takes no arguments, got {' '.join(args)!r}")


@command("/help", "this list")
def _help(app, args):
    return help_text(app)


@command("/quit", "exit (or Ctrl-D)")
def _quit(app, args):
    return QUIT


@command("/status", "current settings")
def _status(app, args):
    _no_arguments("status", args)
    s = app.settings
    return status_table({
        "target": app.target.label, "drafter": app.drafter.label if app.drafter else "none",
        "methods": ", ".join(m for m, on in s.methods.items() if on) or "none",
        "processor": s.processor_label, "chat": s.chat, "cache": s.use_cache, "debug": s.debug,
        "length": s.max_gen_len, "gamma": s.gamma, "n-gram pool": repr(app.pool),
        "top_k_filler": s.top_k_filler, "stop_if_unknown": s.stop_if_unknown,
        "branching": "auto" if s.branching is None else s.branching,
        "reset_in_between": s.reset_in_between, "seed": "off" if s.seed is None else s.seed,
        "turns in history": len(app.history) // 2,
    })


@command("/clear", "forget the conversation")
def _clear(app, args):
    _no_arguments("clear", args)
    app.history.clear()
    app.prompt_caches.clear()
    return "conversation cleared"


METHOD_HELP = {
    "target": "plain decoding with the target model (the baseline)",
    "speculative": "speculative decoding: the drafter model drafts, the target verifies (needs a drafter: --drafter, "
                   "/load drafter)",
    "self": "the target drafts for itself: its own weights in four bits draft, the target verifies; no second model",
    "drafter": "the drafter model alone, plain decoding: its own text and speed, for comparison",
    "ngram": "NASD: drafts from an n-gram pool of the conversation, no drafter model",
    "beam": "beam search with the target (4 beams; its output is not the target's)",
}


def _method(method: str):
    def run(app, args):
        s = app.settings
        on = parse_switch(s.methods[method], args, method)
        if on and method in ("speculative", "drafter") and app.drafter is None:
            raise ValueError(f"/{method} needs a drafter model: {drafter_hint(app.target)}")
        if on and method == "beam" and app.target.encoder_decoder:
            raise ValueError("beam search supports decoder-only models")
        if on and method == "self":
            own_drafter(app.console, app.target)  # now, not on the next prompt: seconds on a real model, once
        s.methods[method] = on
        return f"{method}: {'on' if on else 'off'}"
    return run


for _name in METHODS:
    command(f"/{_name} [on|off]", METHOD_HELP[_name])(_method(_name))


SWITCHES = {  # command -> (setting, help)
    "chat": ("chat", "chat template on/off"),
    "debug": ("debug", "colour each step's tokens: accepted drafts, rejected drafts, the target's own"),
    "cache": ("use_cache", "KV cache on/off"),
    "stop_if_unknown": ("stop_if_unknown", "n-gram drafts stop at unknown grams on/off"),
    "reset_in_between": ("reset_in_between", "reset the n-gram pool before each prompt on/off"),
}


def _switch(name: str, attribute: str):
    def run(app, args):
        value = parse_switch(getattr(app.settings, attribute), args, name)
        setattr(app.settings, attribute, value)
        message = f"{attribute}: {'on' if value else 'off'}"
        if name == "debug" and value:
            return Text(message + "; ").append_text(legend())
        return message
    return run


for _name, (_attribute, _help_line) in SWITCHES.items():
    command(f"/{_name} [on|off]", _help_line)(_switch(_name, _attribute))


COUNTS = {  # command -> (setting, help)
    "length": ("max_gen_len", "max new tokens"),
    "gamma": ("gamma", "draft length"),
    "top_k_filler": ("top_k_filler", "the target's top-k tokens added to the n-gram pool"),
}


def count_bounds(app, name: str) -> tuple[int | None, str]:
    """The largest value of a count command and what bounds it."""
    if name == "length":
        return context_length(app.target.model), "the model's context"
    if name == "gamma":
        return max(DRAFT_SIZES), "the draft lengths whose passes the cost model measures"
    return None, ""


def _count(name: str, attribute: str):
    def run(app, args):
        value = parse_count(args, name, 1, *count_bounds(app, name))
        if name == "top_k_filler" and value > len(app.target.tokenizer):
            raise ValueError(f"top_k_filler must be at most the vocabulary size {len(app.target.tokenizer)}, got {value}")
        setattr(app.settings, attribute, value)
        return f"{attribute}: {value}"
    return run


for _name, (_attribute, _help_line) in COUNTS.items():
    command(f"/{_name} <n>", _help_line)(_count(_name, _attribute))


@command("/seed <n|off>", "sampling seed; off: unseeded")
def _seed(app, args):
    app.settings.seed = parse_seed(args)
    return f"seed: {'off' if app.settings.seed is None else app.settings.seed}"


@command("/processor <name> [values]", "greedy, multinomial [t], topk [t] [top_k], nucleus [t] [top_p], "
         "topknucleus [t] [top_k] [top_p]; or name key=value")
def _processor(app, args):
    app.settings.processor_spec = parse_processor(args)
    return f"processor: {app.settings.processor_label}"


command("/processor key=value ...", "transformers' processors, e.g. repetition_penalty=1.2 "
        "no_repeat_ngram_size=3 min_p=0.05")(_processor)


@command("/branching <n|auto>", "n-gram candidates per node (token trees; 1: chains; auto: where they pay)")
def _branching(app, args):
    if len(args) != 1 or not (args[0] == "auto" or (args[0].isdigit() and 1 <= int(args[0]) <= MAX_BRANCHING)):
        raise ValueError(f"usage: /branching <n|auto>, n an integer from 1 (chains) to {MAX_BRANCHING}, "
                         f"got {' '.join(args) or 'nothing'!r}")
    app.settings.branching = None if args[0] == "auto" else int(args[0])
    return f"branching: {args[0]}"


@command("/set_ngram <simple|multi> <n>", "a new n-gram pool")
def _set_ngram(app, args):
    if len(args) != 2 or args[0] not in ("simple", "multi") or not args[1].isdigit() or not 2 <= int(args[1]) <= MAX_NGRAM:
        raise ValueError(f"usage: /set_ngram <simple|multi> <n>, n an integer from 2 to {MAX_NGRAM}, "
                         f"got {' '.join(args) or 'nothing'!r}")
    app.settings.ngram_kind, app.settings.ngram_n = args[0], int(args[1])
    app.pool = app.new_pool()
    return f"n-gram pool: {app.pool}"


@command("/load <target|drafter> <name>", "load a model: a short name (e.g. qwen2.5-coder-0.5b-instruct), a folder, "
         f"a Hub name; /load drafter {STAND_IN}: a bfloat16 copy of the target")
def _load(app, args):
    if len(args) != 2 or args[0] not in ("target", "drafter"):
        raise ValueError(f"usage: /load <target|drafter> <name>, got {' '.join(args) or 'nothing'!r}")
    role, name = args
    try:
        model = stand_in(app.target) if (role, name) == ("drafter", STAND_IN) else load(name, app.options, app.console, role)
    except Exception as error:  # a wrong name or path: one clear line
        raise ValueError(f"could not load {name}: {type(error).__name__}: {error}") from None
    if role == "drafter":
        check_pair(app.target, model)
        app.drafter = model
        app.settings.methods["speculative"] = True
        measure_pass_costs(app.console, [model])
        what = f": {STAND_IN_WHAT}" if name == STAND_IN else ""
        return f"drafter: {model.label} (/speculative on){what}"
    note = app.set_target(model)
    measure_pass_costs(app.console, [model])
    return f"target: {model.label}" + (f"; {note}" if note else "")
