"""The console's settings and the parsers of their values: each raises a one-line ValueError."""

from __future__ import annotations

from dataclasses import dataclass, field

from utils.logits_processors import (
    GreedyProcessor,
    LogitsProcessor,
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

# `/processor key=value ...`: transformers' processors, built as `generate` builds them.
GENERATE_KEYS = ("repetition_penalty", "no_repeat_ngram_size", "min_length", "do_sample", "temperature", "top_k",
                 "top_p", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff")
SAMPLING_KEYS = {"temperature", "top_k", "top_p", "min_p", "typical_p", "epsilon_cutoff", "eta_cutoff"}
INTEGER_KEYS = {"top_k", "no_repeat_ngram_size", "min_length"}

METHODS = ("target", "speculative", "self", "drafter", "ngram", "beam")
SPECULATIVE = ("speculative", "self", "ngram")  # the methods that draft and verify: stats, debug colours, pass costs


@dataclass
class Settings:
    methods: dict = field(default_factory=lambda: {"target": True, "speculative": True, "self": False,
                                                   "drafter": False, "ngram": True, "beam": False})
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
    seed: int | None = None  # None: unseeded sampling

    @property
    def processor(self) -> LogitsProcessor:
        name, parameters = self.processor_spec
        if name == "generate":
            return generate_processor(parameters)
        return PROCESSORS[name][0](**parameters)

    @property
    def processor_label(self) -> str:
        """"greedy" for argmax decoding (its temperature means nothing), else the processor's repr."""
        return "greedy" if self.processor_spec[0] == "greedy" else repr(self.processor)


def parse_switch(current: bool, args: list[str], name: str) -> bool:
    """A toggle's new value: `/debug` flips it, `/debug on` and `/debug off` set it."""
    if not args:
        return not current
    if len(args) == 1 and args[0].lower() in ("on", "off"):
        return args[0].lower() == "on"
    raise ValueError(f"usage: /{name} [on|off], got {' '.join(args)!r}")


def parse_count(args: list[str], name: str, minimum: int = 1, maximum: int | None = None, why: str = "") -> int:
    """`/length 16` -> 16: one integer from `minimum` to `maximum` (`why`: what bounds it, for the message)."""
    if len(args) != 1 or not args[0].isdigit() or not minimum <= int(args[0]) <= (maximum or int(args[0])):
        bounds = f">= {minimum}" if maximum is None else f"from {minimum} to {maximum}{f' ({why})' if why else ''}"
        raise ValueError(f"usage: /{name} <n>, n an integer {bounds}, got {' '.join(args) or 'nothing'!r}")
    return int(args[0])


MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed's largest


def parse_seed(args: list[str]) -> int | None:
    """`/seed 7` -> 7; `/seed off` (or `none`) -> None: unseeded sampling."""
    if len(args) == 1 and args[0].lower() in ("off", "none"):
        return None
    if len(args) != 1 or not args[0].isdigit() or int(args[0]) > MAX_SEED:
        raise ValueError(f"usage: /seed <n> or /seed off, n an integer from 0 to 2**64 - 1, got {' '.join(args) or 'nothing'!r}")
    return int(args[0])


# `/processor key=value`: each transformers key's range, in the console's words (transformers' own
# messages name its processors' parameters, e.g. `penalty` for repetition_penalty).
GENERATE_RANGES = {
    "repetition_penalty": (lambda v: v > 0, "> 0 (1: off)"),
    "no_repeat_ngram_size": (lambda v: v >= 0, ">= 0 (0: off)"),
    "min_length": (lambda v: v >= 0, ">= 0"),
    "temperature": (lambda v: v > 0, "> 0"),
    "top_k": (lambda v: v >= 0, ">= 0 (0: off)"),
    "top_p": (lambda v: 0 < v <= 1, "in (0, 1] (1: off)"),
    "min_p": (lambda v: 0 <= v <= 1, "in [0, 1]"),
    "typical_p": (lambda v: 0 < v <= 1, "in (0, 1] (1: off)"),
    "epsilon_cutoff": (lambda v: 0 <= v < 1, "in [0, 1) (0: off)"),
    "eta_cutoff": (lambda v: 0 <= v < 1, "in [0, 1) (0: off)"),
}


def _number(key: str, value: str) -> int | float:
    """A `/processor` value: an int for `INTEGER_KEYS`, else a float; the error names the key."""
    try:
        return int(value) if key in INTEGER_KEYS else float(value)
    except ValueError:
        raise ValueError(f"{key} must be {'an integer' if key in INTEGER_KEYS else 'a number'}, got {value!r}") from None


def generate_settings(args: list[str]) -> dict:
    """["repetition_penalty=1.2", "min_p=0.05"] -> {...}; sampling is on when a sampling key is given."""
    settings: dict = {}
    for arg in args:
        key, sep, value = arg.partition("=")
        if not sep or key not in GENERATE_KEYS:
            raise ValueError(f"unknown setting {arg!r}; transformers' keys: {', '.join(GENERATE_KEYS)}")
        if key == "do_sample":
            if value.lower() not in ("true", "false"):
                raise ValueError(f"do_sample must be true or false, got {value!r}")
            settings[key] = value.lower() == "true"
        else:
            settings[key] = _number(key, value)
            valid, expected = GENERATE_RANGES[key]
            if not valid(settings[key]):
                raise ValueError(f"{key} must be {expected}, got {value}")
    settings.setdefault("do_sample", bool(SAMPLING_KEYS & set(settings)))
    return settings


def generate_processor(settings: dict) -> TransformersProcessor:
    from transformers import GenerationConfig

    return TransformersProcessor.from_generation_config(GenerationConfig(**settings))


def parse_processor(args: list[str]) -> tuple[str, dict]:
    """`/processor` arguments -> (name, parameters), checked by building the processor.

    `nucleus 0.7 0.9` (the processor's own parameters in order: `PROCESSORS`), `nucleus
    temperature=0.7 top_p=0.9`, or `repetition_penalty=1.2 min_p=0.05 ...` (transformers'
    processors: name "generate"). Unset parameters take the processor's defaults.
    """
    if not args:
        raise ValueError(f"name a processor: {', '.join(PROCESSORS)}, or transformers' key=value (/help)")
    if "=" in args[0]:
        settings = generate_settings(args)
        try:
            generate_processor(settings)  # validates what the ranges above do not (combinations)
        except ValueError as error:
            raise ValueError(f"transformers refuses {' '.join(args)}: {error}") from None
        return "generate", settings
    name, values = args[0], args[1:]
    if name not in PROCESSORS:
        raise ValueError(f"unknown processor {name!r}: {', '.join(PROCESSORS)}, or transformers' key=value (/help)")
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
